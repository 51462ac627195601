"""The NumberColumns protocol: both kinds of number columns answer every method a kernel calls,
and the ten digits' columns bind nothing (the kernels' hot path)."""

from __future__ import annotations

import dataclasses

import torch

import del_megatron as dm
from del_megatron.kernels.common import VocabShard
from del_megatron.kernels.digit_columns import DigitColumns
from del_megatron.kernels.number_columns import NumberColumns
from del_megatron.kernels.slot_columns import SlotColumns

from .cases import SPLIT_VOCAB

CHUNKED = dm.DigitVocab(range(10), [1110, 1111], range(10, 1110))
PROTOCOL_MEMBERS = {
    name
    for name in (*vars(NumberColumns), *NumberColumns.__annotations__)
    if not name.startswith("_")
}


def _shards(vocab: dm.DigitVocab, full_size: int, tp: int):
    local = full_size // tp
    return [VocabShard(None, rank, tp, local) for rank in range(tp)]


def test_both_kinds_answer_every_protocol_member():
    digits = DigitColumns.of(SPLIT_VOCAB, _shards(SPLIT_VOCAB, 64, 2)[0])
    slot_columns = SlotColumns.of(CHUNKED, _shards(CHUNKED, 1112, 1)[0])
    for columns in (digits, slot_columns):
        missing = {name for name in PROTOCOL_MEMBERS if not hasattr(columns, name)}
        assert not missing, (type(columns).__name__, missing)
    assert (digits.out_width, digits.maxima_width) == (10, 0)
    assert (slot_columns.out_width, slot_columns.maxima_width) == (30, 20)


def test_digit_columns_carry_only_their_digits_and_bind_nothing():
    assert [f.name for f in dataclasses.fields(DigitColumns)] == ["digits", "columns"]
    target = torch.tensor([5, 14, 0, -100])
    held = set()
    for shard in _shards(SPLIT_VOCAB, 64, 4):
        digits = DigitColumns.of(SPLIT_VOCAB, shard)
        held.update(digits.digits)
        assert digits.for_labels(target) is digits
        assert digits.rows(slice(0, 2)) is digits
        assert digits.with_forward(None, torch.zeros(4, 10)) is digits
        assert digits.saved() == () and digits.from_saved(()) is digits
        maxima = torch.empty(4, 0)
        digits.write_local_maxima_(maxima, None)  # a no-op, never a refusal
        logits = torch.randn(4, shard.local_size)
        values = digits.values(logits, torch.float32)
        assert (values is None) == (not digits.columns)
    assert held == set(range(10))


def test_slot_columns_bind_rows_outside_equality():
    columns = SlotColumns.of(CHUNKED, _shards(CHUNKED, 1112, 2)[1])
    bound = columns.for_labels(torch.tensor([3, 10, 600, 1111]))
    assert bound == columns and hash(bound) == hash(columns)
    assert bound.prefix.shape == (4, 4) and columns.prefix is None
    part = bound.rows(slice(1, 3))
    assert torch.equal(part.prefix, bound.prefix[1:3])
    restored = columns.from_saved(bound.with_forward(None, torch.zeros(4, 30)).saved())
    assert torch.equal(restored.prefix, bound.prefix)
    tile = bound.within(0, 100)
    assert tile.prefix is bound.prefix and all(0 <= c < 100 for c in tile.columns)
