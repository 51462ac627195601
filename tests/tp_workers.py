"""Bodies of the tensor-parallel tests; each runs on every rank of a gloo group.

Every check takes (seed, kernel); checks_for(kernel, tp) lists those that apply."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F

import del_megatron as dm
from del_megatron.loss import LOSSES, REDUCTIONS
from del_megatron.reference import reference_lm_loss

from .cases import (
    IGNORE,
    PADDED_VOCAB_SIZE,
    SPLIT_VOCAB,
    TOKEN_FORM,
    logits_for,
    number_rich_labels,
    token_share,
)

ALPHA = 0.7
# Rows a "recompute"/"compiled" pass takes at once in the reference checks: several chunks.
SMALL_CHUNK = 7


def _shard(full: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous vocab shard of [s, b, V] logits."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return full.chunk(world, dim=-1)[rank]


def _reference(labels, full_logits, loss):
    """Reference per-token loss and its gradient with respect to the whole-vocab logits."""
    leaf = full_logits.detach().to(torch.float64).requires_grad_(True)
    ce, term = reference_lm_loss(labels, leaf, SPLIT_VOCAB, loss=loss, ignore_index=IGNORE)
    total = ce + ALPHA * term
    (grad,) = torch.autograd.grad((total * _upstream(labels)).sum(), leaf)
    return ce.detach(), term.detach(), total.detach(), grad


def _upstream(labels):
    gen = torch.Generator().manual_seed(7)
    return torch.rand(labels.shape, generator=gen, dtype=torch.float64) + 0.5


def _ours(labels, full_logits, loss, dtype, kernel, chunk_tokens=None):
    shard = _shard(full_logits).to(dtype).detach().requires_grad_(True)
    cfg = dm.NumericalLossConfig(
        loss=loss, alpha=ALPHA, vocab=SPLIT_VOCAB, ignore_index=IGNORE, **TOKEN_FORM
    )
    how = dict(
        layout=dm.VocabParallelLayout(tp_group=dist.group.WORLD),
        kernel=kernel,
        chunk_tokens=chunk_tokens,
    )
    parts = dm.numerical_lm_loss(labels, shard, cfg, return_parts=True, **how)
    total = dm.numerical_lm_loss(labels, shard, cfg, **how)
    (total * _upstream(labels).to(total.dtype)).sum().backward()
    return parts, total, shard.grad


def _close(actual, expected, what: str, rtol: float, atol: float) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, check_dtype=False, msg=lambda m: f"{what}: {m}"
    )


def check_heads_match_reference(seed: int, kernel: str) -> None:
    """Every head, fp32 and fp64: per-token values and gradients equal the reference (passes of
    SMALL_CHUNK rows where the kernel chunks)."""
    labels = number_rich_labels(3, 29, seed)
    full = logits_for(29, 3, PADDED_VOCAB_SIZE, seed)
    chunk = None if kernel == "softmax" else SMALL_CHUNK
    for loss in LOSSES:
        for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
            ref_ce, ref_term, ref_total, ref_grad = _reference(labels, full.to(dtype), loss)
            parts, total, grad = _ours(labels, full.to(dtype), loss, dtype, kernel, chunk)
            assert total.dtype == dtype
            what = f"{loss} {dtype}"
            _close(parts.ce, ref_ce, f"ce {what}", tol, tol)
            _close(parts.term, ref_term, f"term {what}", tol, tol)
            _close(total, ref_total, f"total {what}", tol, tol)
            # fp32 gradients of NTL-MSE go through cancellations: a few ulps of relative error.
            _close(grad, _shard(ref_grad), f"grad {what}", 5 * tol, tol)
            assert torch.equal(
                parts.is_digit, torch.isin(labels, torch.tensor(SPLIT_VOCAB.digit_ids))
            )
            ignored = labels == IGNORE
            assert torch.all(total[ignored] == 0)
            assert torch.all(grad.transpose(0, 1)[ignored] == 0)


def check_half_precision(seed: int, kernel: str) -> None:
    """bf16 / fp16 logits: values to fp32 rounding of the rounded inputs, gradients to bf16/fp16
    rounding."""
    labels = number_rich_labels(2, 23, seed)
    full = logits_for(23, 2, PADDED_VOCAB_SIZE, seed)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = full.to(dtype)
        for loss in LOSSES:
            _, _, ref_total, ref_grad = _reference(labels, rounded, loss)
            _, total, grad = _ours(labels, rounded, loss, dtype, kernel)
            assert total.dtype == torch.float32 and grad.dtype == dtype
            torch.testing.assert_close(total, ref_total.float(), rtol=2e-6, atol=2e-6)
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(
                grad.float(), _shard(ref_grad).float(), rtol=eps, atol=eps * 0.1
            )


def check_huge_logits(seed: int, kernel: str) -> None:
    """Digit logits of magnitude 1e4 give finite values and gradients equal to the reference."""
    labels = number_rich_labels(2, 17, seed)
    full = logits_for(17, 2, PADDED_VOCAB_SIZE, seed, scale=1.0)
    signs = torch.randn(
        full.shape, generator=torch.Generator().manual_seed(seed), dtype=full.dtype
    ).sign()
    full[..., list(SPLIT_VOCAB.digit_ids)] = 1e4 * signs[..., :10]
    for loss in LOSSES:
        _, _, ref_total, ref_grad = _reference(labels, full.float(), loss)
        _, total, grad = _ours(labels, full.float(), loss, torch.float32, kernel)
        assert torch.isfinite(total).all() and torch.isfinite(grad).all(), loss
        torch.testing.assert_close(total, ref_total.float(), rtol=1e-5, atol=1e-3)
        # fp32 intermediates of size 1e4: errors are relative to the largest gradient entry.
        scale = ref_grad.abs().max().item()
        torch.testing.assert_close(grad, _shard(ref_grad).float(), rtol=1e-5, atol=1e-6 * scale)


def check_ce_matches_megatron(seed: int, kernel: str) -> None:
    """loss='ce' equals torch's cross_entropy and Megatron's vocab_parallel_cross_entropy."""
    from megatron.core import tensor_parallel

    labels = number_rich_labels(2, 31, seed)
    labels[labels == IGNORE] = 3  # Megatron's CE has no ignore_index
    full = logits_for(31, 2, PADDED_VOCAB_SIZE, seed).float()
    torch_ce = F.cross_entropy(full.permute(1, 2, 0), labels, reduction="none")

    ours_in = _shard(full).clone().requires_grad_(True)
    cfg = dm.NumericalLossConfig(loss="ce")
    ours = dm.numerical_lm_loss(labels, ours_in, cfg, dist.group.WORLD, kernel=kernel)
    upstream = _upstream(labels).float()
    (ours * upstream).sum().backward()

    mega_in = _shard(full).clone().requires_grad_(True)
    mega = tensor_parallel.vocab_parallel_cross_entropy(mega_in.clone(), labels.t().contiguous())
    (mega.t() * upstream).sum().backward()

    torch.testing.assert_close(ours, torch_ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours, mega.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_in.grad, mega_in.grad, rtol=1e-6, atol=1e-7)
    # Our fp32 input is left as it was unless inplace=True is asked for.
    torch.testing.assert_close(ours_in.detach(), _shard(full))


def check_inplace_opt_in(seed: int, kernel: str) -> None:
    """inplace=True gives the same loss and gradient and reuses the caller's buffer: fp32 logits
    under kernel "softmax" (as Megatron's CE), fp32 and bf16 logits under the others."""
    labels = number_rich_labels(2, 13, seed)
    full = logits_for(13, 2, PADDED_VOCAB_SIZE, seed)
    dtypes = (torch.float32,) if kernel == "softmax" else (torch.float32, torch.bfloat16)
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, alpha=ALPHA, **TOKEN_FORM)
    for dtype in dtypes:
        results = []
        for inplace in (False, True):
            logits = _shard(full).to(dtype).requires_grad_(True)
            loss = dm.numerical_lm_loss(
                labels, logits, cfg, dist.group.WORLD, kernel=kernel, inplace=inplace
            )
            loss.sum().backward()
            changed = not torch.equal(logits.detach(), _shard(full).to(dtype))
            results.append((loss.detach(), logits.grad, changed))
        what = f"{kernel} {dtype}"
        torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0, msg=what)
        torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0, msg=what)
        assert results[0][2] is False and results[1][2] is True, what


def check_unequal_shards_refused(seed: int, kernel: str) -> None:
    """A group whose shards differ in size raises on every rank (no rank is left hanging)."""
    rank = dist.get_rank()
    logits = torch.randn(5, 2, PADDED_VOCAB_SIZE + rank)
    labels = torch.zeros(2, 5, dtype=torch.long)
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, **TOKEN_FORM)
    try:
        dm.numerical_lm_loss(labels, logits, cfg, dist.group.WORLD, kernel=kernel)
    except ValueError as exc:
        assert "shards disagree in size" in str(exc), exc
    else:
        raise AssertionError("unequal shards were not refused")


def check_label_outside_full_vocab(seed: int, kernel: str) -> None:
    """A label past the whole vocab (all shards) is refused; one on another shard is not."""
    local = PADDED_VOCAB_SIZE // dist.get_world_size()
    logits = torch.randn(4, 1, local)
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, **TOKEN_FORM)
    labels = torch.full((1, 4), PADDED_VOCAB_SIZE - 1)
    dm.numerical_lm_loss(labels, logits, cfg, dist.group.WORLD, kernel=kernel)
    labels[0, 2] = PADDED_VOCAB_SIZE
    try:
        dm.numerical_lm_loss(labels, logits, cfg, dist.group.WORLD, kernel=kernel)
    except ValueError as exc:
        assert "outside the vocabulary of 64 ids" in str(exc), exc
    else:
        raise AssertionError("a label outside the vocab was not refused")


class _ShardOfReplicated(torch.autograd.Function):
    """Forward: this rank's vocab shard of a tensor every rank holds whole. Backward: the whole
    gradient, all-gathered from the shards (Megatron's scatter-to-TP-region, on CPU)."""

    @staticmethod
    def forward(ctx, full):
        return _shard(full).contiguous()

    @staticmethod
    def backward(ctx, grad):
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, grad.contiguous())
        return torch.cat(pieces, dim=-1)


def check_gradcheck_float64(seed: int, kernel: str) -> None:
    """fp64 gradcheck of every loss through the real collectives: every rank holds the same whole
    logits and perturbs them in lockstep, so the checked Jacobian is the whole one."""
    labels = number_rich_labels(2, 4, seed)
    full = logits_for(4, 2, PADDED_VOCAB_SIZE, seed).requires_grad_(True)
    for loss in LOSSES:
        for reduction in REDUCTIONS:
            cfg = dm.NumericalLossConfig(
                loss=loss,
                alpha=ALPHA,
                vocab=SPLIT_VOCAB,
                reduction=reduction,
                digit_share=token_share(reduction),
            )

            def fn(x, cfg=cfg):
                shard = _ShardOfReplicated.apply(x)
                return dm.numerical_lm_loss(labels, shard, cfg, dist.group.WORLD, kernel=kernel)

            assert torch.autograd.gradcheck(fn, (full,), fast_mode=True), (loss, reduction)


def check_keeps_no_fp32_copy(seed: int, kernel: str) -> None:
    """The recompute kernels save the caller's bf16 logits and a [N] normaliser, nothing [N, V]
    in fp32, and leaves the logits as they were."""
    labels = number_rich_labels(2, 13, seed)
    full = logits_for(13, 2, PADDED_VOCAB_SIZE, seed).to(torch.bfloat16)
    logits = _shard(full).clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, alpha=ALPHA, **TOKEN_FORM)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = dm.numerical_lm_loss(labels, logits, cfg, dist.group.WORLD, kernel=kernel)
    big = [t for t in saved if t.dim() == 2 and t.size(-1) == logits.size(-1)]
    assert big and all(t.dtype == torch.bfloat16 for t in big), [(t.dtype, t.shape) for t in big]
    loss.sum().backward()
    assert torch.equal(logits.detach(), _shard(full))


def checks_for(kernel: str, tp: int) -> List[str]:
    """Names of the checks that apply to `kernel` at this tensor-parallel size."""
    names = [
        "check_gradcheck_float64",
        "check_heads_match_reference",
        "check_half_precision",
        "check_huge_logits",
        "check_ce_matches_megatron",
        "check_inplace_opt_in",
        "check_label_outside_full_vocab",
    ]
    if kernel != "softmax":  # the softmax kernel keeps an fp32 softmax by design
        names.append("check_keeps_no_fp32_copy")
    if tp > 1:
        names.append("check_unequal_shards_refused")
    return names
