"""Data and the gloo body of tests/test_digit_ce.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

import del_megatron as dm

from .cases import IGNORE, PADDED_VOCAB_SIZE, SPLIT_VOCAB, logits_for, number_rich_labels

VOCAB = SPLIT_VOCAB
DIGITS = set(SPLIT_VOCAB.digit_ids)
HIDDEN = 12

__all__ = ["DIGITS", "IGNORE", "VOCAB", "batch", "hidden_and_weight", "tp_equals_whole_vocab"]


def batch(seed: int, b: int = 2, s: int = 9):
    """labels int64 [b, s] (digits, decimal points, other ids, ignored) and fp64 logits
    [s, b, V] over the padded vocabulary."""
    return number_rich_labels(b, s, seed), logits_for(s, b, PADDED_VOCAB_SIZE, seed)


def hidden_and_weight(labels: torch.Tensor, seed: int):
    """fp64 hidden [s, b, h] and output weight [V, h]."""
    gen = torch.Generator().manual_seed(seed + 100)
    b, s = labels.shape
    hidden = torch.randn(s, b, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED_VOCAB_SIZE, HIDDEN, generator=gen, dtype=torch.float64) / 3
    return hidden, weight


def tp_equals_whole_vocab(alpha: float) -> None:
    """On every rank: digit_ce's per-token loss and its logits' gradient from this rank's vocab
    shard, under both reductions, equal the whole vocabulary's on one device (TP 1)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    labels, logits = batch(seed=11, b=3, s=17)
    n_tokens = int((labels != IGNORE).sum())
    n_digits = int(torch.isin(labels, torch.tensor(VOCAB.digit_ids)).sum())
    for share in (None, n_digits / n_tokens):
        reduction = "digit" if share is None else "token"
        cfg = dm.NumericalLossConfig(
            loss="digit_ce",
            alpha=alpha,
            vocab=VOCAB,
            reduction=reduction,
            digit_share=share,
            ignore_index=IGNORE,
        )
        whole = logits.clone().requires_grad_(True)
        want = dm.numerical_lm_loss(labels, whole, cfg)
        want.sum().backward()
        shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        got = dm.numerical_lm_loss(
            labels, shard, cfg, dm.VocabParallelLayout(tp_group=dist.group.WORLD)
        )
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            shard.grad, whole.grad.chunk(world, dim=-1)[rank], rtol=1e-12, atol=1e-14
        )
