"""The "digit" reduction does not depend on how a global batch is cut into micro-batches and
data-parallel ranks (Megatron's schedule, calculate_per_token_loss on and off)."""

import pytest

from . import accounting_workers as workers


@pytest.mark.parametrize("dp", [1, 2])
def test_digit_reduction_does_not_depend_on_the_cut(gloo, dp):
    gloo(dp, tensor_model_parallel_size=1).run(workers.check_cut_independence, 31 + dp)


def test_counting_needs_a_wrapped_iterator(gloo):
    gloo(1, tensor_model_parallel_size=1).run(workers.check_count_needs_a_wrapped_iterator)


def test_megatron_lm_glue_shares_counts_over_tensor_parallel_ranks(gloo):
    gloo(2, tensor_model_parallel_size=2).run(workers.check_megatron_lm_glue, 5)
