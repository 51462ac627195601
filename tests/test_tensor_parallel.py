"""Every loss at TP = 1, 2, 4 on real gloo process groups equals the single-device reference."""

import pytest

from .distributed import run_distributed
from .tp_workers import run_all


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_losses_are_exact_at_every_tp_size(tp):
    run_distributed(run_all, tp, 1234 + tp, megatron_tp=tp)
