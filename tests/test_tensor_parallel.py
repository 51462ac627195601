"""Every loss at TP = 1, 2, 4 on real gloo process groups equals the single-device reference."""

import pytest

from .distributed import run_distributed
from .tp_workers import run_all


@pytest.mark.parametrize("kernel", ["recompute", "softmax"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_losses_are_exact_at_every_tp_size(tp, kernel):
    run_distributed(run_all, tp, 1234 + tp, kernel, megatron_tp=tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_kernel_is_exact(tp):
    """The torch.compile'd kernel (inductor's CPU backend here; chosen automatically on CUDA)
    passes the same checks as the eager one."""
    run_distributed(run_all, tp, 99 + tp, "compiled", megatron_tp=tp)
