"""Context parallelism and packed sequences: every digit weighed as in its whole document."""

import pytest
import torch

import del_megatron as dm
from del_megatron.sequence import cp_positions

from . import sequence_workers
from .cases import PADDED_VOCAB_SIZE, SPLIT_VOCAB, TOKEN_FORM, logits_for
from .sequence_workers import assert_pieces_equal, documents_one_by_one, long_number_labels

POINT, OTHER = 33, 1

CASES = [
    pytest.param(cp, check, id=f"cp{cp}-{check.removeprefix('check_')}")
    for cp in (2, 4)
    for check in sequence_workers.CHECKS
]


@pytest.mark.parametrize("cp, check", CASES)
def test_context_parallel_equals_whole_sequence(gloo, cp, check):
    gloo(cp).run(getattr(sequence_workers, check), 77 + cp)


@pytest.mark.parametrize("separated", [True, False])
def test_packed_documents_weigh_as_one_by_one(separated):
    """A number never joins across a document start, with or without a separator token."""
    docs = [long_number_labels(1, n, seed) for seed, n in enumerate((13, 7, 21, 5))]
    if not separated:  # every document starts and ends inside a number
        docs = [torch.cat([d[:, :1] * 0 + SPLIT_VOCAB.digit_ids[4], d], dim=1) for d in docs]
        docs = [torch.cat([d, d[:, :1] * 0 + SPLIT_VOCAB.digit_ids[7]], dim=1) for d in docs]
    else:
        docs = [torch.cat([d, torch.full((1, 1), OTHER)], dim=1) for d in docs]
    packed = torch.cat(docs, dim=1)
    cu_seqlens = torch.tensor([0] + [d.size(1) for d in docs]).cumsum(0).to(torch.int32)
    full = logits_for(packed.size(1), 1, PADDED_VOCAB_SIZE, 5)
    for loss in ("del", "dist2", "ntl_was"):
        cfg = dm.NumericalLossConfig(loss=loss, alpha=0.3, vocab=SPLIT_VOCAB, **TOKEN_FORM)
        parts = dm.numerical_lm_loss(
            packed, full, cfg, dm.VocabParallelLayout(cu_seqlens=cu_seqlens), return_parts=True
        )
        assert_pieces_equal(parts, documents_one_by_one(docs, full, cfg))
    weights = dm.place_weights(packed, SPLIT_VOCAB)
    one_by_one = torch.cat([dm.place_weights(d, SPLIT_VOCAB) for d in docs], dim=1)
    # Without cu_seqlens the unseparated documents' numbers would join: the test has teeth.
    assert torch.equal(weights, one_by_one) == separated


def test_cp_positions_are_megatrons_load_balanced_chunks():
    assert cp_positions(4, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(4, 2, 1).tolist() == [2, 3, 4, 5]
    cu = torch.tensor([0, 8, 12])
    assert cp_positions(6, 2, 0, cu).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_positions(6, 2, 1, cu).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cu_seqlens": torch.tensor([0, 5])}, "rise from 0 to the packed length 6"),
        ({"cu_seqlens": torch.tensor([[0, 6]])}, "1-D tensor of document offsets"),
        ({"cu_seqlens": torch.tensor([0, 4, 3, 6])}, "rise from 0"),
    ],
)
def test_bad_packing_is_refused(kwargs, match):
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, **TOKEN_FORM)
    with pytest.raises(ValueError, match=match):
        dm.numerical_lm_loss(
            torch.zeros(1, 6, dtype=torch.long),
            torch.randn(6, 1, 64),
            cfg,
            dm.VocabParallelLayout(**kwargs),
        )


def test_cu_seqlens_needs_one_packed_row():
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, **TOKEN_FORM)
    with pytest.raises(ValueError, match=r"one packed row \(THD"):
        dm.numerical_lm_loss(
            torch.zeros(2, 6, dtype=torch.long),
            torch.randn(6, 2, 64),
            cfg,
            dm.VocabParallelLayout(cu_seqlens=torch.tensor([0, 6])),
        )


def test_cp_chunks_must_divide():
    with pytest.raises(ValueError, match="multiple of 2 \\* cp"):
        cp_positions(3, 2, 0, torch.tensor([0, 2, 6]))
