"""The logits-free path (numerical_linear_loss) equals the materialised-logits path."""

import pytest
import torch

import del_megatron as dm

from .cases import PADDED_VOCAB_SIZE, SPLIT_VOCAB
from .distributed import run_distributed
from .linear_workers import run_all

CFG = dm.NumericalLossConfig(vocab=SPLIT_VOCAB)
LABELS = torch.zeros(2, 5, dtype=torch.long)


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_free_equals_materialised(tp):
    run_distributed(run_all, tp, 4321 + tp)


@pytest.mark.parametrize(
    "hidden, weight, labels, kwargs, error, match",
    [
        (torch.randn(5, 2), torch.randn(64, 4), LABELS, {}, ValueError, r"hidden must be \[seq"),
        (torch.randn(5, 2, 4), torch.randn(64, 3), LABELS, {}, ValueError, r"weight must be"),
        (torch.randn(5, 2, 4), torch.randn(64), LABELS, {}, ValueError, r"weight must be"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4, dtype=torch.float64),
            LABELS,
            {},
            TypeError,
            "share one floating dtype",
        ),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS.t(), {}, ValueError, r"labels must be"),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS.float(), {}, TypeError, "integer tensor"),
        (torch.randn(5, 2, 4), torch.randn(64, 4), LABELS + 64, {}, ValueError, "outside the voc"),
        (torch.randn(5, 2, 4), torch.randn(8, 4), LABELS, {}, ValueError, "vocab"),
        (
            torch.randn(5, 2, 4),
            torch.randn(64, 4),
            LABELS,
            {"chunk_tokens": 0},
            ValueError,
            "chunk",
        ),
        (torch.randn(5, 2, 4), [[1.0]], LABELS, {}, TypeError, "weight must be a torch.Tensor"),
    ],
)
def test_bad_input_is_refused(hidden, weight, labels, kwargs, error, match):
    with pytest.raises(error, match=match):
        dm.numerical_linear_loss(hidden, weight, labels, CFG, **kwargs)


def test_default_chunk_holds_no_more_than_256_mib_of_logits():
    from del_megatron.linear import default_chunk_rows

    assert default_chunk_rows(151936) == 441
    assert default_chunk_rows(PADDED_VOCAB_SIZE) * PADDED_VOCAB_SIZE * 4 <= 256 * 2**20
    assert default_chunk_rows(2**40) == 1
