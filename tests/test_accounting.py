"""The "digit" reduction does not depend on how a global batch is cut into micro-batches and
data-parallel ranks (Megatron's schedule, calculate_per_token_loss on and off)."""

import pytest

from . import accounting_workers as workers

PER_TOKEN = pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_batch"])


@pytest.mark.parametrize("dp", [1, 2])
@PER_TOKEN
def test_digit_reduction_does_not_depend_on_the_cut(gloo, dp, per_token):
    gloo(dp, tensor_model_parallel_size=1).run(workers.check_cut_independence, 31 + dp, per_token)


@pytest.mark.parametrize("dp", [1, 2])
def test_without_the_step_accounting_the_cut_shows(gloo, dp):
    gloo(dp, tensor_model_parallel_size=1).run(
        workers.check_without_accounting_the_cut_shows, 31 + dp
    )


def test_counting_needs_a_wrapped_iterator(gloo):
    gloo(1, tensor_model_parallel_size=1).run(workers.check_count_needs_a_wrapped_iterator)


@PER_TOKEN
def test_megatron_lm_glue_shares_counts_over_tensor_parallel_ranks(gloo, per_token):
    gloo(2, tensor_model_parallel_size=2).run(workers.check_megatron_lm_glue, 5, per_token)


def test_evaluation_steps_are_counted_by_the_evaluation_micro_batch_count(gloo):
    gloo(2, tensor_model_parallel_size=1).run(
        workers.check_evaluation_counts_its_own_micro_batches, 7
    )


def test_the_accounting_is_made_again_on_new_process_groups_after_a_restart(gloo):
    gloo(2, tensor_model_parallel_size=2).run(
        workers.check_the_accounting_follows_new_process_groups, 8
    )
