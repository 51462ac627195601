import atexit
import importlib.util
import os
import sys
from collections import OrderedDict

import pytest

from .distributed import GlooWorkers

# Megatron-Bridge 0.6.2 and NeMo 2.7.0 (tests/requirements-bridge.txt, Python >= 3.12) are in the
# bridge environment only (examples/setup_env.sh bridge). Their tests run wherever Bridge is
# installed, and wherever DEL_TEST_BRIDGE=1 (tests/run.sh): there they must import, not skip.
_bridge = os.environ.get("DEL_TEST_BRIDGE") == "1" or (
    sys.version_info >= (3, 12) and importlib.util.find_spec("megatron.bridge") is not None
)
collect_ignore = [] if _bridge else ["test_bridge.py", "test_nemo.py"]

# Worker groups kept alive at once (each process holds torch and Megatron-Core, ~0.5 GB; a new
# group costs its processes' imports, ~10 s). The suite uses 7 layouts.
MAX_LIVE_GROUPS = 4


def pytest_configure(config: pytest.Config) -> None:
    # megatron-core warns on import when apex / Transformer Engine are absent (GPU-only extras).
    config.addinivalue_line(
        "filterwarnings", "ignore:Transformer Engine and Apex are not installed"
    )


@pytest.fixture(scope="session")
def gloo():
    """gloo(world_size, **megatron) -> GlooWorkers of that size and Megatron layout (keywords of
    initialize_model_parallel; default: tensor parallel over all), shared by the whole session
    (a new one after a failure)."""
    groups: OrderedDict[tuple, GlooWorkers] = OrderedDict()

    def get(world_size: int, **megatron: int) -> GlooWorkers:
        megatron = megatron or {"tensor_model_parallel_size": world_size}
        key = (world_size, *sorted(megatron.items()))
        group = groups.pop(key, None)
        if group is None or not group.alive():
            if group is not None:
                group.close()
            while len(groups) >= MAX_LIVE_GROUPS:
                groups.popitem(last=False)[1].close()
            group = GlooWorkers(world_size, **megatron)
        groups[key] = group
        return group

    def close_all() -> None:
        while groups:
            groups.popitem()[1].close()

    atexit.register(close_all)  # also when the session ends without its teardown
    yield get
    close_all()
