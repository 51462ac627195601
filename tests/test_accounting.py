"""The "digit" reduction does not depend on how a global batch is cut into micro-batches and
data-parallel ranks (Megatron's schedule, calculate_per_token_loss on and off)."""

import pytest

from .accounting_workers import run_all, run_megatron_lm_glue
from .distributed import run_distributed


@pytest.mark.parametrize("dp", [1, 2])
def test_digit_reduction_is_global(dp):
    run_distributed(run_all, dp, 31 + dp, megatron_tp=1)


def test_megatron_lm_glue_shares_counts_over_tensor_parallel_ranks():
    run_distributed(run_megatron_lm_glue, 2, 5, megatron_tp=2)
