"""The logits_free stage: numerical_linear_loss against the materialised output layer, and the
weight-gradient sink's exact product."""

from __future__ import annotations

import torch

import del_megatron as dm

from ..context import Context
from ..fixtures import make_labels, rel_error_on_device, strict_fp32
from ..sizes import ALPHA, VOCAB

# Tolerances, relative to the largest magnitude compared.
LINEAR_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
TF32_TOL = 2e-3  # fp32 matmuls where TF32 cannot be turned off (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE)


def stage_logits_free(ctx: Context) -> None:
    """numerical_linear_loss (as --del-logits-free runs it: loss_mask given) against the
    materialised output layer + numerical_lm_loss: loss, grad of hidden and of weight, every
    weight-gradient route, bf16 and strict fp32."""
    tokens, h, vocab = ctx.sizes.linear_tokens, ctx.sizes.linear_hidden, ctx.sizes.vocab
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    labels = make_labels(tokens, vocab, ctx.device, seed=5)
    mask = (labels != -100).float()
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    hidden32 = torch.randn(tokens, 1, h, generator=gen, device=ctx.device)
    weight32 = torch.randn(vocab, h, generator=gen, device=ctx.device) / h**0.5 * 4
    for dtype in (torch.bfloat16, torch.float32):
        hidden, weight = hidden32.to(dtype), weight32.to(dtype)
        tolerance = TF32_TOL if dtype == torch.float32 and ctx.tf32_forced else LINEAR_TOL[dtype]
        with strict_fp32():
            want = _linear_grads(hidden, weight, labels, mask, cfg, None)
            for route in ("auto", "forward", "backward"):
                got = _linear_grads(hidden, weight, labels, mask, cfg, route)
                errors = {
                    k: rel_error_on_device(g, w)
                    for k, g, w in zip(
                        ("value", "grad_hidden", "grad_weight"), got, want, strict=True
                    )
                }
                ctx.results.add(
                    "logits_free",
                    f"logits-free vs materialised, route {route}",
                    max(errors.values()) < tolerance,
                    tokens=tokens,
                    hidden=h,
                    vocab=vocab,
                    dtype=dtype,
                    tf32_forced=ctx.tf32_forced and dtype == torch.float32,
                    **{f"{k}_error": v for k, v in errors.items()},
                )
                del got
                ctx.free()
        del want
        ctx.free()
    _check_sink_product(ctx)


def _check_sink_product(ctx: Context) -> None:
    """The weight-gradient sink's exact product (Megatron's fp32 main_grad += grad.t() @ hidden,
    bf16 operands): which way the device forms it (kernels.linear.exact_product_route: one
    GEMM with fp32 output on CUDA where torch has it, else the operands upcast to fp32), its
    error against the fp64 product, and on CUDA the time of each way."""
    from del_megatron.kernels import linear

    tokens, h = ctx.sizes.linear_tokens, ctx.sizes.linear_hidden
    columns = min(ctx.sizes.vocab, 4 * h)
    gen = torch.Generator(device=ctx.device).manual_seed(9)
    grad_t = torch.randn(columns, tokens, generator=gen, device=ctx.device).bfloat16()
    hidden = torch.randn(tokens, h, generator=gen, device=ctx.device).bfloat16()
    route = linear.exact_product_route(ctx.device, torch.bfloat16, torch.float32)
    accumulator = torch.zeros(columns, h, device=ctx.device)
    with strict_fp32():
        linear._add_product_(accumulator, grad_t, hidden, exact=True)
        want = torch.matmul(grad_t.double(), hidden.double())
        error = rel_error_on_device(accumulator, want)
        del want
        times = {}
        if ctx.device.type == "cuda":
            upcast = (grad_t.float(), hidden.float())
            for name, run in (
                ("fp32-output GEMM", lambda: torch.mm(grad_t, hidden, out_dtype=torch.float32)),
                ("upcast", lambda: torch.mm(*upcast)),
            ):
                if name == "upcast" or linear.fp32_output_gemm(ctx.device):
                    run()
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    for _ in range(ctx.sizes.reps):
                        run()
                    end.record()
                    end.synchronize()
                    times[f"{name} ms"] = start.elapsed_time(end) / ctx.sizes.reps
    ctx.results.add(
        "logits_free",
        "weight-gradient sink product (bf16 into fp32) vs fp64",
        error < (TF32_TOL if ctx.tf32_forced and route == "upcast" else 1e-5),
        route=route,
        shape=[columns, tokens, h],
        error=error,
        **times,
    )
    ctx.free()


def _linear_grads(hidden, weight, labels, mask, cfg, route):
    """(loss, grad hidden, grad weight); route None: the materialised path."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    if route is None:
        loss = dm.numerical_lm_loss(labels, torch.matmul(h, w.t()), cfg)
    else:
        loss = dm.numerical_linear_loss(h, w, labels, cfg, loss_mask=mask, weight_gradient=route)
    grads = torch.autograd.grad((loss * mask).sum(), (h, w))
    return (loss.detach(), *grads)
