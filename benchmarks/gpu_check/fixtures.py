"""Inputs the stages make (labels with numbers, logits) and how they compare results."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .sizes import OTHER


def make_labels(tokens: int, vocab: int, device, seed: int = 0, boundary: Optional[int] = None):
    """[1, tokens]: about 15% digits, some decimal points, some ignored; at `boundary - 1` a
    plain token, so that no number runs across the first `boundary` positions' end."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(OTHER, vocab, (1, tokens), generator=gen)
    pick = torch.rand(1, tokens, generator=gen)
    digits = torch.randint(15, 25, (1, tokens), generator=gen)
    labels = torch.where(pick < 0.15, digits, labels)
    labels = torch.where((pick >= 0.15) & (pick < 0.18), torch.full_like(labels, 13), labels)
    labels = torch.where(pick > 0.97, torch.full_like(labels, -100), labels)
    if boundary is not None:
        labels[0, boundary - 1] = OTHER
    return labels.to(device)


def make_logits(tokens: int, vocab: int, dtype, device, seed: int = 0) -> torch.Tensor:
    """[tokens, 1, vocab] with magnitudes up to about 30, made on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, 1, vocab, generator=gen, device=device, dtype=torch.float32)
    return logits.mul_(6.0).to(dtype)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in fp64 on the CPU)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).abs().max() / e.abs().max().clamp(min=1e-30)).item()


def rel_error_on_device(
    actual: torch.Tensor, expected: torch.Tensor, keep: Optional[torch.Tensor] = None
) -> float:
    """rel_error for big tensors, on their device (in fp32, one block of rows at a time); keep
    (bool, the leading dimensions of the tensors): the rows compared, others are zeroed."""
    worst, scale = 0.0, 0.0
    rows = max(1, 2**28 // max(1, expected[0].numel()))
    for start in range(0, expected.size(0), rows):
        e = expected[start : start + rows].float()
        a = actual[start : start + rows].float()
        if keep is not None:
            kept = keep[start : start + rows].reshape(
                *e.shape[: keep.dim()], *[1] * (e.dim() - keep.dim())
            )
            e, a = e * kept, a * kept
        worst = max(worst, (a - e).abs().max().item())
        scale = max(scale, e.abs().max().item())
    return worst / max(scale, 1e-30)


@contextlib.contextmanager
def strict_fp32():
    """fp32 matmuls without TF32 (as far as torch can turn it off)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
