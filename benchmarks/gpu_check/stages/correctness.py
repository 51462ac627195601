"""The correctness stage: numerical_lm_loss against Megatron's CE and the fp64 reference."""

from __future__ import annotations

import itertools

import torch

import del_megatron as dm
from del_megatron.reference import reference_lm_loss

from ..context import Context
from ..fixtures import make_labels, make_logits, rel_error, rel_error_on_device, strict_fp32
from ..sizes import ALPHA, TOKEN_DIGIT_SHARE, VOCAB

# Tolerances, relative to the largest magnitude compared.
VALUE_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # bf16 gradients: 1 ulp of the largest


def _megatron_ce(logits: torch.Tensor, labels: torch.Tensor):
    """Megatron's vocab_parallel_cross_entropy [b, s] and its logits gradient."""
    from megatron.core import tensor_parallel

    leaf = logits.detach().clone().requires_grad_(True)
    target = labels.clamp(min=0).t().contiguous()  # Megatron's CE knows no ignore_index
    ce = tensor_parallel.vocab_parallel_cross_entropy(leaf, target).t()
    (grad,) = torch.autograd.grad(ce.sum(), leaf)
    return ce.detach(), grad


def _ours(logits, labels, cfg, kernel: str):
    leaf = logits.detach().clone().requires_grad_(True)
    loss = dm.numerical_lm_loss(labels, leaf, cfg, kernel=kernel)
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), grad


def stage_correctness(ctx: Context) -> None:
    """numerical_lm_loss against Megatron's CE (values and gradients, loss "ce") and against
    the fp64 reference on a slice (loss "del", with its digit term)."""
    sizes, vocab = ctx.sizes, ctx.sizes.vocab
    kernels = ("auto", "recompute", "softmax")
    for tokens, dtype in itertools.product(sizes.tokens, (torch.bfloat16, torch.float32)):
        labels = make_labels(tokens, vocab, ctx.device, seed=tokens, boundary=sizes.reference_rows)
        logits = make_logits(tokens, vocab, dtype, ctx.device, seed=tokens)
        case = dict(tokens=tokens, vocab=vocab, dtype=dtype, n_times_v=tokens * vocab)
        with strict_fp32():
            ce_want, ce_grad_want = _megatron_ce(logits, labels)
            valid = (labels != -100).t()
            for kernel in kernels if tokens == sizes.tokens[0] else ("auto",):
                cfg = dm.NumericalLossConfig(loss="ce", vocab=VOCAB)
                ce, grad = _ours(logits, labels, cfg, kernel)
                # Megatron's CE has no ignore_index: ignored rows are left out
                value_error = rel_error(ce[labels != -100], ce_want[labels != -100])
                grad_error = rel_error_on_device(grad, ce_grad_want, keep=valid)
                ok = value_error < VALUE_TOL[dtype] and grad_error < GRAD_TOL[dtype]
                ctx.results.add(
                    "correctness",
                    f"ce vs Megatron CE, kernel {kernel}",
                    ok,
                    **case,
                    kernel=_kernel_taken(kernel, logits),
                    value_error=value_error,
                    grad_error=grad_error,
                )
                del grad
                ctx.free()
            del ce_grad_want
            ctx.free()
            _check_against_reference(ctx, logits, labels, case)
        del logits
        ctx.free()


def _kernel_taken(kernel: str, logits: torch.Tensor) -> str:
    from del_megatron.kernels import resolve_kernel

    return resolve_kernel(kernel, logits, inplace=False)


def _check_against_reference(ctx: Context, logits, labels, case) -> None:
    """DEL (digit term included) on the full sequence, checked on its first reference_rows
    positions against reference_lm_loss in fp64 on the CPU: values and logits gradients."""
    rows = ctx.sizes.reference_rows
    for reduction in ("token", "digit"):
        share = TOKEN_DIGIT_SHARE if reduction == "token" else None
        cfg = dm.NumericalLossConfig(
            loss="del", alpha=ALPHA, vocab=VOCAB, reduction=reduction, digit_share=share
        )
        loss, grad = _ours(logits, labels, cfg, "auto")
        head = logits[:rows].detach().cpu().double().requires_grad_(True)
        ce, term = reference_lm_loss(labels[:, :rows].cpu(), head, VOCAB, loss="del")
        if reduction == "digit":  # the term scaled by the whole sequence's tokens / digits
            full = dm.numerical_lm_loss(labels, logits, cfg, return_parts=True)
            term = term * (full.n_tokens.double() / full.n_digits.double()).item()
        total = ce + cfg.token_weight * term
        (grad_want,) = torch.autograd.grad(total.sum(), head)
        value_error = rel_error(loss[:, :rows], total)
        grad_error = rel_error(grad[:rows], grad_want)
        dtype = case["dtype"]
        ok = value_error < 1e-5 and grad_error < GRAD_TOL[dtype]
        ctx.results.add(
            "correctness",
            f"del ({reduction}) vs fp64 reference, {rows} rows",
            ok,
            **case,
            kernel=_kernel_taken("auto", logits),
            value_error=value_error,
            grad_error=grad_error,
        )
        del grad
        ctx.free()
