"""Bodies of the context-parallel tests; each runs on every rank of a gloo group (the CP group).

Every check takes (seed,); CHECKS lists them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron.loss import LOSSES, REDUCTIONS
from del_megatron.sequence import cp_positions

from .cases import IGNORE, PADDED_VOCAB_SIZE, SPLIT_VOCAB, TOKEN_FORM, logits_for, token_share
from .gpt_helpers import batch_on_this_cp_rank

ALPHA = 0.7
# The per-token pieces every layout must reproduce.
PER_TOKEN = ("ce", "term", "is_digit")


def long_number_labels(batch: int, seq: int, seed: int) -> torch.Tensor:
    """int64 [batch, seq]: numbers of 5..12 digits (some with a decimal point) separated by one
    or two other tokens, so that chunk borders of any CP size fall inside numbers."""
    gen = torch.Generator().manual_seed(seed)
    digits = torch.tensor(SPLIT_VOCAB.digit_ids)
    rows = []
    for _ in range(batch):
        row = []
        while len(row) < seq:
            length = int(torch.randint(5, 13, (1,), generator=gen))
            number = digits[torch.randint(0, 10, (length,), generator=gen)].tolist()
            if torch.rand(1, generator=gen) < 0.5:
                number[int(torch.randint(1, length - 1, (1,), generator=gen))] = 33
            row += number + [1] * int(torch.randint(1, 3, (1,), generator=gen))
        rows.append(row[:seq])
    labels = torch.tensor(rows)
    labels[:, -3] = IGNORE
    return labels


def _upstream(shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5


def _whole_sequence(labels, logits, cfg, cu_seqlens=None):
    """The unsplit single-rank loss [b, S] and its logits gradient [S, b, V]."""
    logits = logits.clone().requires_grad_(True)
    loss = dm.numerical_lm_loss(labels, logits, cfg, dm.VocabParallelLayout(cu_seqlens=cu_seqlens))
    (loss * _upstream(loss.shape)).sum().backward()
    return loss.detach(), logits.grad


def check_cp_equals_whole_sequence(seed: int) -> None:
    """Megatron's own CP split (get_batch_on_this_cp_rank): per-token losses and gradients at
    this rank's positions equal the whole sequence's, for every loss and reduction."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    seq = 8 * cp * 3
    labels = long_number_labels(2, seq, seed)
    full = logits_for(seq, 2, PADDED_VOCAB_SIZE, seed)
    local = batch_on_this_cp_rank(
        {"labels": labels.clone(), "logits": full.transpose(0, 1).clone()}, dist.group.WORLD
    )
    positions = cp_positions(seq // cp, cp, rank)
    assert torch.equal(local["labels"], labels[:, positions])
    for loss in LOSSES:
        for reduction in REDUCTIONS:
            cfg = dm.NumericalLossConfig(
                loss=loss,
                alpha=ALPHA,
                vocab=SPLIT_VOCAB,
                reduction=reduction,
                digit_share=token_share(reduction),
            )
            ref_loss, ref_grad = _whole_sequence(labels, full, cfg)
            logits = local["logits"].transpose(0, 1).contiguous().requires_grad_(True)
            ours = dm.numerical_lm_loss(
                local["labels"], logits, cfg, dm.VocabParallelLayout(cp_group=dist.group.WORLD)
            )
            (ours * _upstream(ref_loss.shape)[:, positions]).sum().backward()
            what = f"cp {cp} {loss} {reduction}"
            torch.testing.assert_close(
                ours, ref_loss[:, positions], rtol=1e-12, atol=1e-12, msg=what
            )
            torch.testing.assert_close(
                logits.grad, ref_grad[positions], rtol=1e-12, atol=1e-12, msg=what
            )
    # The test has teeth: without the CP group the local weights are wrong.
    split = dm.place_weights(local["labels"], SPLIT_VOCAB)
    assert not torch.equal(split, dm.place_weights(labels, SPLIT_VOCAB)[:, positions])


def documents_one_by_one(docs, full, cfg):
    """{piece: [1, T]} of each document's LossParts computed alone, concatenated along the
    packed row (PER_TOKEN pieces)."""
    parts, start = [], 0
    for doc in docs:
        end = start + doc.size(1)
        parts.append(dm.numerical_lm_loss(doc, full[start:end], cfg, return_parts=True))
        start = end
    return {f: torch.cat([getattr(p, f) for p in parts], dim=1) for f in PER_TOKEN}


def assert_pieces_equal(parts, expected, positions=slice(None)) -> None:
    for name in PER_TOKEN:
        torch.testing.assert_close(
            getattr(parts, name), expected[name][:, positions], rtol=1e-12, atol=1e-12, msg=name
        )


def check_cp_with_packed_documents(seed: int) -> None:
    """THD packing under CP: each (padded) document is cut into 2 * cp chunks; every position's
    pieces equal those of its document computed alone."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    lengths = [2 * cp * k for k in (3, 1, 4)]
    docs = [long_number_labels(1, n, seed + i) for i, n in enumerate(lengths)]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    packed = torch.cat(docs, dim=1)
    total = packed.size(1)
    positions = cp_positions(total // cp, cp, rank, cu_seqlens)
    full = logits_for(total, 1, PADDED_VOCAB_SIZE, seed)
    for loss in ("del", "dist2"):
        cfg = dm.NumericalLossConfig(loss=loss, alpha=ALPHA, vocab=SPLIT_VOCAB, **TOKEN_FORM)
        parts = dm.numerical_lm_loss(
            packed[:, positions],
            full[positions],
            cfg,
            dm.VocabParallelLayout(cp_group=dist.group.WORLD, cu_seqlens=cu_seqlens),
            return_parts=True,
        )
        assert_pieces_equal(parts, documents_one_by_one(docs, full, cfg), positions)


def check_linear_loss_under_cp_and_packing(seed: int) -> None:
    """numerical_linear_loss takes cp_group and cu_seqlens as numerical_lm_loss does: the same
    per-token pieces as the materialised logits of this rank's positions."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    lengths = [2 * cp * k for k in (2, 3)]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    packed = torch.cat([long_number_labels(1, n, seed + i) for i, n in enumerate(lengths)], dim=1)
    positions = cp_positions(packed.size(1) // cp, cp, rank, cu_seqlens)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(packed.size(1), 1, 8, generator=gen, dtype=torch.float64)[positions]
    weight = torch.randn(PADDED_VOCAB_SIZE, 8, generator=gen, dtype=torch.float64)
    labels = packed[:, positions]
    for loss in ("del", "dist2"):
        cfg = dm.NumericalLossConfig(loss=loss, alpha=ALPHA, vocab=SPLIT_VOCAB, reduction="digit")
        layout = dm.VocabParallelLayout(cp_group=dist.group.WORLD, cu_seqlens=cu_seqlens)
        ours = dm.numerical_linear_loss(hidden, weight, labels, cfg, chunk_tokens=5, layout=layout)
        want = dm.numerical_lm_loss(labels, hidden @ weight.t(), cfg, layout=layout)
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)
        parts = dm.numerical_linear_loss(
            hidden, weight, labels, cfg, return_parts=True, layout=layout
        )
        want_parts = dm.numerical_lm_loss(
            labels, hidden @ weight.t(), cfg, return_parts=True, layout=layout
        )
        assert_pieces_equal(parts, {f: getattr(want_parts, f) for f in PER_TOKEN})


def _packed_unpadded(seed: int, total: int):
    """(documents, packed [1, total]): documents of lengths that are no multiple of 2 * cp."""
    lengths = [13, 7, 21]
    lengths.append(total - sum(lengths))
    docs = [long_number_labels(1, n, seed + i) for i, n in enumerate(lengths)]
    return docs, torch.cat(docs, dim=1)


def check_cp_sequence_balancing_with_packed_documents(seed: int) -> None:
    """cp_balancing="sequence": the whole packed sequence cut into 2 * cp chunks (Megatron's
    per-sequence split, get_batch_on_this_cp_rank without cu_seqlens), documents of any length;
    every position's pieces equal those of its document computed alone. Then hybrid context
    parallelism's case: the group is a per-micro-batch subgroup (PackedSeqParams.cp_group),
    here two ranks that hold one packed sequence between them."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    total = 32 * cp
    docs, packed = _packed_unpadded(seed, total)
    cu_seqlens = torch.tensor([0] + [d.size(1) for d in docs]).cumsum(0).to(torch.int32)
    full = logits_for(total, 1, PADDED_VOCAB_SIZE, seed)
    local = batch_on_this_cp_rank(
        {"labels": packed.clone(), "logits": full.transpose(0, 1).clone()}, dist.group.WORLD
    )
    positions = cp_positions(total // cp, cp, rank, cu_seqlens, balancing="sequence")
    assert torch.equal(local["labels"], packed[:, positions])
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=SPLIT_VOCAB, **TOKEN_FORM)
    layout = dm.VocabParallelLayout(
        cp_group=dist.group.WORLD, cu_seqlens=cu_seqlens, cp_balancing="sequence"
    )
    logits = local["logits"].transpose(0, 1).contiguous()
    parts = dm.numerical_lm_loss(local["labels"], logits, cfg, return_parts=True, layout=layout)
    assert_pieces_equal(parts, documents_one_by_one(docs, full, cfg), positions)
    # The test has teeth: per-document balancing reads these positions differently.
    with pytest.raises(ValueError, match="cannot be cut into 2 \\* cp"):
        dm.numerical_lm_loss(
            local["labels"],
            logits,
            cfg,
            dm.VocabParallelLayout(cp_group=dist.group.WORLD, cu_seqlens=cu_seqlens),
        )

    # Hybrid CP: pairs of ranks, each pair one sequence of its own.
    pairs = [dist.new_group([r, r + 1]) for r in range(0, cp, 2)]
    group, pair_rank = pairs[rank // 2], rank % 2
    docs, packed = _packed_unpadded(seed + rank // 2, 64)
    cu_seqlens = torch.tensor([0] + [d.size(1) for d in docs]).cumsum(0).to(torch.int32)
    full = logits_for(64, 1, PADDED_VOCAB_SIZE, seed + rank // 2)
    positions = cp_positions(32, 2, pair_rank, cu_seqlens, balancing="sequence")
    layout = dm.VocabParallelLayout(cp_group=group, cu_seqlens=cu_seqlens, cp_balancing="sequence")
    parts = dm.numerical_lm_loss(
        packed[:, positions], full[positions], cfg, return_parts=True, layout=layout
    )
    assert_pieces_equal(parts, documents_one_by_one(docs, full, cfg), positions)
    for pair in pairs:
        dist.destroy_process_group(pair)


CHECKS = [
    "check_cp_equals_whole_sequence",
    "check_cp_with_packed_documents",
    "check_cp_sequence_balancing_with_packed_documents",
    "check_linear_loss_under_cp_and_packing",
]
