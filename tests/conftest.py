import atexit
import importlib.util
import os
import sys
from importlib.metadata import version
from typing import Dict

import pytest

from del_megatron.cpu.quick_exit import skip_final_collections
from del_megatron.megatron.logits_free import MIN_CORE as LOGITS_FREE_CORE

from .distributed import GlooWorkers

# Megatron-Bridge 0.6.2 and NeMo 2.7.0 (tests/requirements-bridge.txt, Python >= 3.12) are in the
# bridge environment only (examples/setup_env.sh bridge). Their tests run wherever Bridge is
# installed, and wherever DEL_TEST_BRIDGE=1 (tests/run.sh): there they must import, not skip.
_bridge = os.environ.get("DEL_TEST_BRIDGE") == "1" or (
    sys.version_info >= (3, 12) and importlib.util.find_spec("megatron.bridge") is not None
)


collect_ignore = (
    []
    if _bridge
    else ["test_bridge.py", "test_nemo.py", "test_qa_bridge.py", "test_bridge_scoring.py"]
)
# NeMo AutoModel 0.7.0's recipe runs in its own environment (examples/setup_env.sh automodel), as
# the automodel stage (DEL_TEST_AUTOMODEL=1, tests/run.sh); elsewhere its test is not collected.
_automodel = os.environ.get("DEL_TEST_AUTOMODEL") == "1" or (
    importlib.util.find_spec("nemo_automodel") is not None
)
if not _automodel:
    collect_ignore.append("test_automodel.py")
# Megatron's Hugging Face tokenizer wrappers need transformers, pinned for Python 3.12 only.
if sys.version_info < (3, 12):
    collect_ignore.append("test_megatron_tokenizers.py")
# Megatron-LM's own argument parser comes with megatron-core 0.19's wheel (megatron.training).
if importlib.util.find_spec("megatron.training") is None:
    collect_ignore += ["test_docs_megatron_flags.py", "test_model_examples.py"]
# gpu_check.sh --cpu as a whole, where its integration stage runs (megatron-core >= 0.18, as in
# the GPU image); without it the run's other stages are the code the Python 3.12 run tests.
if tuple(int(part) for part in version("megatron-core").split(".")[:2]) < LOGITS_FREE_CORE:
    collect_ignore.append("test_gpu_check_run.py")


def pytest_configure(config: pytest.Config) -> None:
    skip_final_collections()
    # megatron-core warns on import when apex / Transformer Engine are absent (GPU-only extras).
    config.addinivalue_line(
        "filterwarnings", "ignore:Transformer Engine and Apex are not installed"
    )


@pytest.fixture(scope="session")
def gloo():
    """gloo(world_size, **megatron) -> GlooWorkers of that size with Megatron's parallel_state in
    that layout (keywords of initialize_model_parallel; default: tensor parallel over all). One
    group per world size for the whole session, switched between layouts in place (a new group
    costs its processes' imports, ~10 s; a failure closes the group and the next call makes one)."""
    groups: Dict[int, GlooWorkers] = {}

    def get(world_size: int, **megatron: int) -> GlooWorkers:
        group = groups.get(world_size)
        if group is None or not group.alive():
            if group is not None:
                group.close()
            group = groups[world_size] = GlooWorkers(world_size, **megatron)
        return group.use_layout(**megatron)

    def close_all() -> None:
        for group in groups.values():  # every group winds down at once
            group.stop()
        while groups:
            groups.popitem()[1].close()

    atexit.register(close_all)  # also when the session ends without its teardown
    yield get
    close_all()
