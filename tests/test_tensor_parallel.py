"""Every loss at TP = 1, 2, 4 on real gloo process groups equals the single-device reference:
each check of tp_workers is its own test, for every kernel ("compiled", torch.compile on CPU
inductor here and chosen automatically on CUDA, at TP 1 and 2)."""

import pytest

from . import tp_workers

KERNELS_AT = {1: ("softmax", "recompute", "compiled"), 2: ("softmax", "recompute", "compiled")}
KERNELS_AT[4] = ("softmax", "recompute")

CASES = [
    pytest.param(tp, kernel, check, id=f"tp{tp}-{kernel}-{check.removeprefix('check_')}")
    for tp, kernels in KERNELS_AT.items()
    for kernel in kernels
    for check in tp_workers.checks_for(kernel, tp)
]


@pytest.mark.parametrize("tp, kernel, check", CASES)
def test_tensor_parallel(gloo, tp, kernel, check):
    gloo(tp).run(getattr(tp_workers, check), 1234 + tp, kernel)
