"""Shared test data: vocabularies whose digit ids fall on different shards, and batches of labels
that are rich in numbers."""

from __future__ import annotations

import torch

from del_megatron import DigitVocab

# 64 ids, padded: the tokenizer has 61, ids 61..63 are padding columns of the last shard. At TP=4
# (16 ids a shard) the digits sit on all four shards; at TP=2 on both.
PADDED_VOCAB_SIZE = 64
TOKENIZER_VOCAB_SIZE = 61
SPLIT_VOCAB = DigitVocab(
    digit_ids=[5, 14, 15, 16, 30, 31, 47, 48, 58, 60], decimal_point_ids=[33, 49]
)
IGNORE = -100


def number_rich_labels(batch: int, seq: int, seed: int, vocab: DigitVocab = SPLIT_VOCAB):
    """int64 [batch, seq]: about half digits, some decimal points, some ignored positions."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, TOKENIZER_VOCAB_SIZE, (batch, seq), generator=gen)
    pick = torch.rand(batch, seq, generator=gen)
    digits = torch.tensor(vocab.digit_ids)[torch.randint(0, 10, (batch, seq), generator=gen)]
    points = torch.tensor(vocab.decimal_point_ids)[
        torch.randint(0, len(vocab.decimal_point_ids), (batch, seq), generator=gen)
    ]
    labels = torch.where(pick < 0.5, digits, labels)
    labels = torch.where((pick >= 0.5) & (pick < 0.6), points, labels)
    labels = torch.where(pick > 0.93, torch.full_like(labels, IGNORE), labels)
    return labels


def logits_for(seq: int, batch: int, vocab_size: int, seed: int, scale: float = 3.0):
    """float64 [seq, batch, vocab_size] whole-vocab logits."""
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(seq, batch, vocab_size, generator=gen, dtype=torch.float64)


# The per-token form: each digit target's term weighs alpha itself (the token reduction with a
# digit share of 1). The kernel, parallelism and glue tests hold the package to the per-token
# oracle `ce + alpha * term` in this form; tests/test_weight_unit.py holds the reductions to
# alpha's meaning, the weight on the mean term over digit targets.
TOKEN_FORM = {"reduction": "token", "digit_share": 1.0}


def token_share(reduction: str):
    """digit_share for a test looping over the reductions: 1 for "token" (the per-token form)."""
    return 1.0 if reduction == "token" else None
