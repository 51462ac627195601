"""A GPTModel in Megatron-Core's own DistributedDataParallel and distributed optimizer, trained
through Megatron's schedule on gloo ranks: the settings GPU users run (bf16, the distributed
optimizer with overlapped gradient reduce-scatter and parameter all-gather, small DDP buckets, an
untied output layer, MTP, gradient-accumulation fusion). Each body runs on every rank.

Gradient-accumulation fusion calls apex's CUDA extension fused_weight_gradient_mlp_cuda, which
cannot load without CUDA. FusedWeightGradientStandIn (tests only) does what its two functions do
(apex csrc/megatron/fused_weight_gradient_dense.cpp: a cuBLAS GEMM with beta = 1 into the
weight's main_grad, d_weight += d_output^T @ input, accumulated in fp32), so that Megatron's own
fused code path (tensor_parallel/layers.py) runs unchanged around it.
"""

from __future__ import annotations

import contextlib
import sys
import types
from functools import partial
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron import megatron as dmm

from .cases import TOKEN_FORM
from .gpt_helpers import GPT_VOCAB, build_gpt, number_batch

CFG = dm.NumericalLossConfig(loss="del", alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM)
MICRO_BATCHES, MICRO_BATCH = 2, 2
# Small enough that the untied output weight (128 x 64) fills a DDP bucket of its own: the last
# bucket group to be all-gathered, dispatched by the one before it and waited on only by a hook
# of the output layer.
BUCKET_SIZE = 1000


# (data_ptr, shape) of every d_weight the stand-in added to, in call order.
WGRAD_CALLS: List[tuple] = []


def _wgrad_gemm_accum(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor):
    """d_weight [out, in] += d_output [n, out]^T @ input [n, in], formed in fp32 and added in
    d_weight's dtype (apex: cublasGemmEx with fp32 compute, beta = 1, row-major operands)."""
    assert input.is_contiguous() and d_output.is_contiguous() and d_weight.is_contiguous()
    WGRAD_CALLS.append((d_weight.data_ptr(), tuple(d_weight.shape)))
    product = torch.matmul(d_output.t().float(), input.float())
    d_weight.add_(product.to(d_weight.dtype))


def _stand_in() -> types.ModuleType:
    stand_in = types.ModuleType("fused_weight_gradient_mlp_cuda")
    stand_in.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum
    stand_in.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum
    return stand_in


def install_fused_wgrad_stand_in() -> None:
    """Make Megatron's layers see fused_weight_gradient_mlp_cuda (the stand-in above)."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = _stand_in()
    layers._grad_accum_fusion_available = True


@contextlib.contextmanager
def fused_wgrad_for_the_loss():
    """While active, the logits-free loss imports the stand-in as Megatron does and hands it
    these CPU tensors (kernels/linear.py: on CUDA only otherwise); undone after, as these
    processes serve later tests."""
    from del_megatron.kernels import linear

    saved = (sys.modules.get(linear.FUSED_WGRAD_MODULE), linear.FUSED_WGRAD_DEVICE_TYPES)
    sys.modules[linear.FUSED_WGRAD_MODULE] = _stand_in()
    linear.FUSED_WGRAD_DEVICE_TYPES, linear._fused_wgrad = ("cuda", "cpu"), linear._NOT_IMPORTED
    try:
        yield
    finally:
        if saved[0] is None:
            del sys.modules[linear.FUSED_WGRAD_MODULE]
        else:
            sys.modules[linear.FUSED_WGRAD_MODULE] = saved[0]
        linear.FUSED_WGRAD_DEVICE_TYPES, linear._fused_wgrad = saved[1], linear._NOT_IMPORTED


def _ddp_gpt(mtp_layers, fusion: bool):
    """The tiny GPT (same weights on every rank and every call), untied, in bf16, wrapped in
    Megatron's DDP with the distributed optimizer, overlapped reduce-scatter and all-gather."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if fusion:
        install_fused_wgrad_stand_in()
    config = dict(bf16=True, gradient_accumulation_fusion=fusion)
    model = build_gpt(
        1, mtp_layers=mtp_layers, config_kwargs=config, share_embeddings_and_output_weights=False
    )
    model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        bucket_size=BUCKET_SIZE,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def _optimizer(model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
    )
    return get_megatron_optimizer(config, [model])


def _batches(step: int) -> List[tuple]:
    """This rank's micro-batches of a step: (tokens, labels, positions, loss_mask)."""
    rank, batches = dist.get_rank(), []
    for i in range(MICRO_BATCHES):
        tokens, labels, positions = number_batch(MICRO_BATCH, seed=100 * step + 10 * rank + i)
        mask = torch.ones(labels.shape)
        mask[:, :3] = 0.0  # some tokens do not count
        batches.append((tokens, labels, positions, mask))
    return batches


def _forward_step(data_iterator, model):
    tokens, labels, positions, mask = next(data_iterator)
    output = model(tokens, positions, None, labels=labels, loss_mask=mask)
    return output, partial(dmm.numerical_loss_func, mask)


def _output_weight(model) -> torch.nn.Parameter:
    return model.module.module.output_layer.weight


def train(logits_free, mtp_layers, fusion: bool, steps: int) -> Dict[str, Any]:
    """`steps` training steps through Megatron's schedule, DDP and distributed optimizer
    (logits_free: False, or the weight gradient's route). Returns per step the summed report and
    the optimizer's grad norm, and after the first step's backward the output weight's main_grad
    [V, h] (after the reduce-scatter: this rank's shard summed over DP, the rest its own) with
    the attributes Megatron's DDP hook reads."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _ddp_gpt(mtp_layers, fusion)
    optimizer = _optimizer(model)
    config = model.config
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
    weight, record = _output_weight(model), {"reports": [], "grad_norms": []}
    dmm.register(CFG, logits_free=logits_free)
    try:
        for step in range(steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            batches = _batches(step)
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=iter(batches),
                model=[model],
                num_microbatches=MICRO_BATCHES,
                seq_length=batches[0][0].size(1),
                micro_batch_size=MICRO_BATCH,
            )
            if step == 0:
                record["main_grads"] = [p.main_grad for p in model.parameters()]
                record["main_grad"] = weight.main_grad.clone()
                record["grad_added_to_main_grad"] = weight.grad_added_to_main_grad
                record["grad"] = weight.grad
            _, grad_norm, _ = optimizer.step()
            record["grad_norms"].append(float(grad_norm))
            record["reports"].append({k: sum(r[k] for r in reports) for k in reports[0]})
    finally:
        dmm.unregister()
        config.no_sync_func = config.finalize_model_grads_func = None
    return record


def _values(record: Dict[str, Any], step: int) -> Dict[str, float]:
    """What Megatron-LM would log for a step: every report entry's sum / count, the grad norm."""
    values = {k: (v[0] / v[1]).item() for k, v in record["reports"][step].items()}
    return {**values, "grad norm": record["grad_norms"][step]}


def check_logits_free_under_ddp(mtp_layers, fusion: bool, route, steps: int) -> None:
    """Logits-free (weight gradient on `route`) against the materialised path, each trained
    `steps` steps from the same weights on the same batches:
    - every step runs (with the overlapped all-gather a logits-free step that never waits for
      the output weight's gather stops the next one on `param_gather_handle is None`);
    - the output weight's main_grad after the first backward: the same fp32 values, and with
      fusion the protocol's attributes: grad_added_to_main_grad set, no .grad left, and the
      logits-free loss's own products added by the fused extension (the stand-in) as
      Megatron's layers add theirs;
    - every logged value: step 1 (same weights) to fp32 rounding but the grad norm, later steps
      to one bf16 eps (2^-8, relative; the digit accuracy to one digit target): the two paths
      round the bf16 gradients at different points (chunked or tiled sums against one GEMM), so
      the weights differ by bf16 roundings from step 2 on."""
    from del_megatron.cpu.training import torch_cuda_on_cpu

    from .megatron_workers.logits_free import _refused_by_this_core

    if _refused_by_this_core():
        return
    fused = fused_wgrad_for_the_loss() if fusion else contextlib.nullcontext()
    with torch_cuda_on_cpu(), fused:
        want = train(False, mtp_layers, fusion, steps)
        WGRAD_CALLS.clear()
        ours = train(route, mtp_layers, fusion, steps)
    if fusion:
        # the logits-free loss's own products (its accumulator, or main_grad's vocab tiles) went
        # through the fused extension too, not only Megatron's layers
        params = {(p.data_ptr(), tuple(p.shape)) for p in ours["main_grads"]}
        assert [call for call in WGRAD_CALLS if call not in params], "no fused call of the loss"
    assert len(ours["reports"]) == len(want["reports"]) == steps
    for record in (ours, want):
        assert record["main_grad"].dtype == torch.float32
        assert record["grad"] is None  # DDP's hook took it (or there was none)
        assert record["grad_added_to_main_grad"] is fusion
    scale = want["main_grad"].abs().max().item()
    assert scale > 0
    # The "backward" route forms the same bf16 gradient of the logits as the materialised path
    # and multiplies it out in fp32 as the fused GEMM does: fp32 summation order apart (a
    # product rounded to bf16 would be 2^-9 off). The "forward" route rounds the gradient to
    # bf16 before the loss scale, the materialised path after it: one bf16 rounding apart.
    rounding = 2**-16 if route == "backward" else 2**-8
    torch.testing.assert_close(ours["main_grad"], want["main_grad"], rtol=0, atol=rounding * scale)
    for step in range(steps):
        got, expected = _values(ours, step), _values(want, step)
        assert got.keys() == expected.keys(), step
        for key, value in expected.items():
            exact = step == 0 and key != "grad norm"
            tolerance = dict(rel=1e-6, abs=1e-7) if exact else dict(rel=2**-8, abs=1e-6)
            if key.endswith("digit acc") and not exact:
                # an argmax between two digit logits within bf16 rounding may flip: one target
                tolerance = dict(abs=1.0 / want["reports"][step][key][1].item() + 1e-6)
            assert got[key] == pytest.approx(value, **tolerance), (step, key, got[key], value)
