"""The logits-free loss inside Megatron-Core's DistributedDataParallel and distributed optimizer
(tests/ddp_workers.py): bf16, reduce-scatter and all-gather overlapped, small DDP buckets, an
untied output layer, MTP and gradient-accumulation fusion, on 2 data-parallel gloo ranks. On a
megatron-core without GPTModel's output_processor (< 0.18) each checks that register() refuses
the logits-free loss instead."""

import pytest

from . import ddp_workers

STEPS = 3


def test_the_overlapped_param_all_gather_is_waited_on_before_the_output_weight_is_read(gloo):
    """The output weight alone in the last bucket to be all-gathered, no MTP head to call the
    output layer: only the logits-free loss can wait for the gather (F1)."""
    gloo(2, tensor_model_parallel_size=1).run(
        ddp_workers.check_logits_free_under_ddp, None, False, "auto", STEPS
    )


@pytest.mark.parametrize("route", ["forward", "backward"])
def test_with_mtp_and_fusion_the_main_heads_weight_gradient_reaches_main_grad_in_fp32(gloo, route):
    """MTP's materialised output layer sets grad_added_to_main_grad; the logits-free gradient
    goes straight into main_grad too (F2), formed in fp32."""
    gloo(2, tensor_model_parallel_size=1).run(
        ddp_workers.check_logits_free_under_ddp, 1, True, route, STEPS
    )
