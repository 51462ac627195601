import atexit
import sys
from collections import OrderedDict

import pytest

from .distributed import GlooWorkers

# Megatron-Bridge 0.6.2 and NeMo 2.7.0 belong to the Python 3.12 environment only
# (tests/requirements-bridge.txt): they need Python >= 3.12. There they must import, not skip.
collect_ignore = [] if sys.version_info >= (3, 12) else ["test_bridge.py", "test_nemo.py"]

# Worker groups kept alive at once (each process holds torch, and some Megatron-Core).
MAX_LIVE_GROUPS = 2


def pytest_configure(config: pytest.Config) -> None:
    # megatron-core warns on import when apex / Transformer Engine are absent (GPU-only extras).
    config.addinivalue_line(
        "filterwarnings", "ignore:Transformer Engine and Apex are not installed"
    )


@pytest.fixture(scope="session")
def gloo():
    """gloo(world_size) -> GlooWorkers of that size, shared by the whole session (a new one
    after a failure)."""
    groups: OrderedDict[int, GlooWorkers] = OrderedDict()

    def get(world_size: int) -> GlooWorkers:
        group = groups.pop(world_size, None)
        if group is None or not group.alive():
            if group is not None:
                group.close()
            while len(groups) >= MAX_LIVE_GROUPS:
                groups.popitem(last=False)[1].close()
            group = GlooWorkers(world_size)
        groups[world_size] = group
        return group

    def close_all() -> None:
        while groups:
            groups.popitem()[1].close()

    atexit.register(close_all)  # also when the session ends without its teardown
    yield get
    close_all()
