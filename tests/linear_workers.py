"""Bodies of the logits-free path tests; each runs on every rank of a gloo group.

Every check takes (seed,); checks_for(tp) lists those that apply."""

from __future__ import annotations

import itertools
from typing import List

import pytest
import torch
import torch.distributed as dist

import del_megatron as dm
from del_megatron.kernels import linear
from del_megatron.loss import CE_TERM_LOSSES, LOSSES
from del_megatron.sequence import cp_positions

from .cases import (
    IGNORE,
    PADDED_VOCAB_SIZE,
    SPLIT_VOCAB,
    TOKEN_FORM,
    number_rich_labels,
    token_share,
)

SEQ, BATCH, HIDDEN = 23, 3, 16
# The weight gradient's two routes (kernels/linear.py); "auto" picks one by size.
ROUTES = ("forward", "backward")


def _inputs(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(PADDED_VOCAB_SIZE, HIDDEN, generator=gen, dtype=torch.float64) / 2
    upstream = torch.rand(BATCH, SEQ, generator=gen) + 0.5
    return number_rich_labels(BATCH, SEQ, seed), hidden, weight.to(dtype), upstream


def _materialised(labels, hidden, weight, cfg, upstream):
    """numerical_lm_loss of the whole-vocab logits on one device, and its gradients."""
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = torch.matmul(hidden, weight.t())
    loss = dm.numerical_lm_loss(labels, logits, cfg)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _logits_free(labels, hidden, weight, cfg, upstream, chunk_tokens, loss_mask=None, route=None):
    """numerical_linear_loss on this rank's vocab shard of the weight (the weight gradient on
    `route`, None: "auto"), and its gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hidden = hidden.clone().requires_grad_(True)
    shard = weight.chunk(world, dim=0)[rank].clone().requires_grad_(True)
    loss = dm.numerical_linear_loss(
        hidden,
        shard,
        labels,
        cfg,
        dm.VocabParallelLayout(tp_group=dist.group.WORLD),
        chunk_tokens=chunk_tokens,
        loss_mask=loss_mask,
        weight_gradient=route or "auto",
    )
    (loss * upstream.to(loss.dtype)).sum().backward()
    full_weight_grad = [torch.empty_like(shard.grad) for _ in range(world)]
    dist.all_gather(full_weight_grad, shard.grad)
    return loss.detach(), hidden.grad, torch.cat(full_weight_grad)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().double().clamp(min=1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


def check_equals_materialised(seed: int, route: str = "forward") -> None:
    """Every loss and reduction, fp32 and bf16, several chunk sizes: values and gradients of
    hidden and weight equal those of the materialised logits path."""
    # fp32: a few ulps. bf16: both paths round logits and gradients to bf16, but the "forward"
    # route sums the weight gradient over chunks in fp32; a few bf16 ulps apart.
    for dtype, tol, grad_tol in ((torch.float32, 2e-6, 2e-6), (torch.bfloat16, 2e-6, 3e-2)):
        labels, hidden, weight, upstream = _inputs(seed, dtype)
        for loss in LOSSES:
            for reduction, chunk in (("token", 5), ("digit", SEQ * BATCH)):
                cfg = dm.NumericalLossConfig(
                    loss=loss,
                    alpha=0.7,
                    vocab=SPLIT_VOCAB,
                    reduction=reduction,
                    digit_share=token_share(reduction),
                )
                ref = _materialised(labels, hidden, weight, cfg, upstream)
                ours = _logits_free(labels, hidden, weight, cfg, upstream, chunk, None, route)
                what = f"{loss} {reduction} {dtype} chunk {chunk} {route}"
                assert ours[0].dtype == torch.float32, what
                assert ours[1].dtype == dtype and ours[2].dtype == dtype, what
                torch.testing.assert_close(ours[0], ref[0], rtol=tol, atol=tol, msg=what)
                assert _relative_error(ours[1], ref[1]) < grad_tol, f"grad hidden {what}"
                assert _relative_error(ours[2], ref[2]) < grad_tol, f"grad weight {what}"
                assert torch.all(ours[0][labels == IGNORE] == 0), what


class CountedChunks:
    """Records, while active, the rows of every token chunk the linear kernel multiplies out
    (forward and backward) and the columns of every vocab tile ("backward" route)."""

    def __enter__(self):
        self.rows, self.tiles = [], []
        self._chunk, self._tile = linear._chunk_logits, linear._tile_logits

        def chunk(hidden, weight):
            self.rows.append(hidden.size(0))
            return self._chunk(hidden, weight)

        def tile(hidden, weight_tile):
            self.tiles.append(weight_tile.size(0))
            return self._tile(hidden, weight_tile)

        linear._chunk_logits, linear._tile_logits = chunk, tile
        return self

    def __exit__(self, *exc):
        linear._chunk_logits, linear._tile_logits = self._chunk, self._tile

    @property
    def calls(self) -> int:
        return len(self.rows)


def check_loss_mask_forms_gradients_in_forward(seed: int, route: str = "forward") -> None:
    """With loss_mask and an upstream gradient c * loss_mask (Megatron's loss_func), backward
    multiplies no token chunk out again, and values and gradients equal the materialised path;
    any other upstream gradient is refused there (checked on the device: NOT_PROPORTIONAL, a
    ValueError on a CPU). The "backward" route forms nothing in forward either way: backward
    multiplies each vocab tile out once, for any upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.randint(0, 3, (BATCH, SEQ), generator=gen).float() / 2  # 0, 0.5 and 1
    chunk, chunks = 5, -(-SEQ * BATCH // 5)
    local = PADDED_VOCAB_SIZE // dist.get_world_size()
    tile = linear.default_tile_columns(local, SEQ * BATCH)
    tiles = [min(tile, local - start) for start in range(0, local, tile)]
    for dtype, grad_tol in ((torch.float32, 2e-6), (torch.bfloat16, 3e-2)):
        labels, hidden, weight, upstream = _inputs(seed, dtype)
        for loss in LOSSES:
            for reduction in ("token", "digit"):
                cfg = dm.NumericalLossConfig(
                    loss=loss,
                    alpha=0.7,
                    vocab=SPLIT_VOCAB,
                    reduction=reduction,
                    digit_share=token_share(reduction),
                )
                # digit_ce weighs CE's own gradient again at digit targets, so its upstream
                # gradient is never loss_mask's: its chunks are multiplied out again in backward
                in_forward = route == "forward" and loss not in CE_TERM_LOSSES
                for grad_out, proportional in ((mask * 0.37, True), (upstream, False)):
                    what = f"{loss} {reduction} {dtype} proportional={proportional} {route}"
                    if in_forward and not proportional:
                        with CountedChunks() as counted, pytest.raises(ValueError) as refused:
                            _logits_free(labels, hidden, weight, cfg, grad_out, chunk, mask, route)
                        assert linear.NOT_PROPORTIONAL in str(refused.value), what
                        assert counted.calls == chunks and counted.tiles == [], what
                        continue
                    ref = _materialised(labels, hidden, weight, cfg, grad_out)
                    with CountedChunks() as counted:
                        ours = _logits_free(
                            labels, hidden, weight, cfg, grad_out, chunk, mask, route
                        )
                    if in_forward:
                        assert counted.calls == chunks and counted.tiles == [], what
                    elif route == "forward":
                        assert counted.calls == 2 * chunks and counted.tiles == [], what
                    else:
                        assert counted.calls == chunks and counted.tiles == tiles, what
                    torch.testing.assert_close(ours[0], ref[0], rtol=2e-6, atol=2e-6, msg=what)
                    assert _relative_error(ours[1], ref[1]) < grad_tol, f"grad hidden {what}"
                    assert _relative_error(ours[2], ref[2]) < grad_tol, f"grad weight {what}"


def check_compiled_passes(seed: int) -> None:
    """The passes over a chunk torch.compile'd, each over the whole chunk (what CUDA runs),
    forced on CPU: check_loss_mask_forms_gradients_in_forward holds with them on both routes
    (gradients formed in forward, and recomputed in backward)."""
    from del_megatron.kernels import recompute

    linear.COMPILED_PASSES = True
    try:
        hidden = torch.zeros(4, HIDDEN)
        assert linear.chunk_passes(hidden, 64, 5) == (*recompute.passes(compiled=True), 5)
        for route in ROUTES:
            check_loss_mask_forms_gradients_in_forward(seed, route)
    finally:
        linear.COMPILED_PASSES = None


def check_loss_mask_second_backward(seed: int) -> None:
    """A second backward through the same graph (retain_graph) recomputes: the gradients formed
    in forward are spent by the first, and both equal the materialised path's."""
    labels, hidden, weight, _ = _inputs(seed, torch.float32)
    mask = torch.ones(BATCH, SEQ)
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.7, vocab=SPLIT_VOCAB, **TOKEN_FORM)
    ref = _materialised(labels, hidden, weight, cfg, mask * 2)
    world, rank = dist.get_world_size(), dist.get_rank()
    for route in ROUTES:
        h = hidden.clone().requires_grad_(True)
        shard = weight.chunk(world)[rank].clone().requires_grad_(True)
        loss = dm.numerical_linear_loss(
            h,
            shard,
            labels,
            cfg,
            dm.VocabParallelLayout(tp_group=dist.group.WORLD),
            loss_mask=mask,
            weight_gradient=route,
        )
        loss.sum().backward(retain_graph=True)
        with CountedChunks() as counted:
            loss.sum().backward()
        recomputed = counted.calls if route == "forward" else len(counted.tiles)
        assert recomputed > 0 and counted.calls + len(counted.tiles) == recomputed, route
        assert _relative_error(h.grad, ref[1]) < 2e-6, route
        weight_grad = _gathered_rows(shard.grad, dist.group.WORLD)
        assert _relative_error(weight_grad, ref[2]) < 2e-6, route


def check_large_logits(seed: int) -> None:
    """Logits of size ~1e4: the softmax recomputed from the same chunks ("forward" route) is as
    exact as the materialised one. The "backward" route multiplies vocab tiles out, another
    matmul whose logits may differ from forward's in the last bit (ulp(1e4) = 1e-3 in fp32),
    so its gradient is exact to about eps * max|logit|, no closer."""
    labels, hidden, weight, upstream = _inputs(seed, torch.float32)
    hidden = hidden * 2000
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.7, vocab=SPLIT_VOCAB, **TOKEN_FORM)
    ref = _materialised(labels, hidden, weight, cfg, upstream)
    largest = torch.matmul(hidden, weight.t()).abs().max().item()
    assert largest > 1e4
    bound = {"forward": 1e-5, "backward": 4 * torch.finfo(torch.float32).eps * largest}
    for route in ROUTES:
        ours = _logits_free(labels, hidden, weight, cfg, upstream, 4, None, route)
        assert torch.isfinite(ours[0]).all()
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-3, msg=route)
        assert _relative_error(ours[1], ref[1]) < bound[route], route
        assert _relative_error(ours[2], ref[2]) < bound[route], route


def check_gradcheck_float64(seed: int) -> None:
    """fp64 gradcheck through the collectives: every rank perturbs the same hidden and whole weight
    in lockstep; the weight shard's gradient is all-gathered back to the whole weight."""
    labels = number_rich_labels(2, 4, seed)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(PADDED_VOCAB_SIZE, 3, generator=gen, dtype=torch.float64)
    weight.requires_grad_(True)
    for loss, route in itertools.product(LOSSES, ROUTES):
        cfg = dm.NumericalLossConfig(loss=loss, alpha=0.7, vocab=SPLIT_VOCAB, reduction="digit")

        def fn(h, w, cfg=cfg, route=route):
            shard = _RowShardOfReplicated.apply(w)
            layout = dm.VocabParallelLayout(tp_group=dist.group.WORLD)
            return dm.numerical_linear_loss(
                h, shard, labels, cfg, layout, chunk_tokens=3, weight_gradient=route
            )

        assert torch.autograd.gradcheck(fn, (hidden, weight), fast_mode=True), (loss, route)


class _RowShardOfReplicated(torch.autograd.Function):
    """This rank's rows of a weight every rank holds whole; backward all-gathers the rows."""

    @staticmethod
    def forward(ctx, full):
        return full.chunk(dist.get_world_size(), dim=0)[dist.get_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, grad.contiguous())
        return torch.cat(pieces, dim=0)


def check_sequence_parallel_hidden_refused(seed: int) -> None:
    """A sequence-parallel hidden (seq / tp rows) without sequence_parallel=True is refused on
    every rank with the fix named."""
    world = dist.get_world_size()
    labels = number_rich_labels(BATCH, 4 * world, 0)
    hidden = torch.randn(4, BATCH, HIDDEN)
    weight = torch.randn(PADDED_VOCAB_SIZE // world, HIDDEN)
    cfg = dm.NumericalLossConfig(vocab=SPLIT_VOCAB, **TOKEN_FORM)
    try:
        dm.numerical_linear_loss(
            hidden, weight, labels, cfg, dm.VocabParallelLayout(tp_group=dist.group.WORLD)
        )
    except ValueError as exc:
        assert "sequence-parallel" in str(exc) and "sequence_parallel=True" in str(exc), exc
    else:
        raise AssertionError("a sequence-parallel hidden was not refused")


def _whole_reference(labels, hidden, weight, cfg, upstream):
    """The materialised path on the whole sequence, in fp64, and its gradients."""
    hidden = hidden.double().requires_grad_(True)
    weight = weight.double().requires_grad_(True)
    loss = dm.numerical_lm_loss(labels, hidden @ weight.t(), cfg)
    (loss * upstream.double()).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _gathered_rows(t: torch.Tensor, group) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return torch.cat(pieces)


def check_sequence_parallel_equals_materialised(seed: int) -> None:
    """sequence_parallel=True: each TP rank holds its slice of the positions; loss, grad of its
    hidden slice and grad of its weight shard equal the whole-sequence materialised path."""
    tp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    seq = 5 * tp
    labels = number_rich_labels(BATCH, seq, seed)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(PADDED_VOCAB_SIZE, HIDDEN, generator=gen) / 2
    upstream = torch.rand(BATCH, seq, generator=gen) + 0.5
    rows = slice(rank * 5, (rank + 1) * 5)
    for loss, route in itertools.product(LOSSES, ROUTES):
        what = f"{loss} {route}"
        cfg = dm.NumericalLossConfig(loss=loss, alpha=0.7, vocab=SPLIT_VOCAB, reduction="digit")
        want = _whole_reference(labels, hidden, weight, cfg, upstream)
        mine = hidden[rows].clone().requires_grad_(True)
        shard = weight.chunk(tp)[rank].clone().requires_grad_(True)
        got = dm.numerical_linear_loss(
            mine,
            shard,
            labels,
            cfg,
            dm.VocabParallelLayout(tp_group=group, sequence_parallel=True),
            chunk_tokens=7,
            weight_gradient=route,
        )
        (got * upstream).sum().backward()
        assert got.shape == (BATCH, seq), what
        torch.testing.assert_close(got.double(), want[0], rtol=2e-6, atol=2e-6, msg=what)
        assert _relative_error(mine.grad, want[1][rows]) < 2e-6, f"grad hidden {what}"
        assert _relative_error(_gathered_rows(shard.grad, group), want[2]) < 2e-6, what


def check_tp_sp_and_cp(seed: int) -> None:
    """TP=2 with sequence parallelism inside CP=2 (Megatron's groups): every rank's loss and the
    gradients of its hidden slice and weight shard (summed over CP, as Megatron's gradient
    all-reduce does) equal the whole-sequence materialised path."""
    from megatron.core import parallel_state as ps

    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    local = 2 * cp * 3  # this CP rank's positions; tp divides it
    seq = local * cp
    labels = number_rich_labels(BATCH, seq, seed)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(PADDED_VOCAB_SIZE, HIDDEN, generator=gen) / 2
    upstream = torch.rand(BATCH, seq, generator=gen) + 0.5
    positions = cp_positions(local, cp, cp_rank)
    rows = slice(tp_rank * local // tp, (tp_rank + 1) * local // tp)
    mask = (torch.rand(BATCH, seq, generator=gen) > 0.2).float()
    cases = [("del", None), ("dist2", None), ("ntl_was", None), ("del", mask)]
    for (loss, loss_mask), route in itertools.product(cases, ROUTES):
        # with loss_mask, the upstream gradient is proportional to it: formed in forward
        if loss_mask is not None:
            upstream = loss_mask * 0.25
        cfg = dm.NumericalLossConfig(loss=loss, alpha=0.7, vocab=SPLIT_VOCAB, reduction="digit")
        want = _whole_reference(labels, hidden, weight, cfg, upstream)
        mine = hidden[positions][rows].clone().requires_grad_(True)
        shard = weight.chunk(tp)[tp_rank].clone().requires_grad_(True)
        got = dm.numerical_linear_loss(
            mine,
            shard,
            labels[:, positions],
            cfg,
            dm.VocabParallelLayout(tp_group=tp_group, cp_group=cp_group, sequence_parallel=True),
            chunk_tokens=5,
            loss_mask=None if loss_mask is None else loss_mask[:, positions],
            weight_gradient=route,
        )
        (got * upstream[:, positions]).sum().backward()
        what = f"{loss} {route} loss_mask={loss_mask is not None}"
        torch.testing.assert_close(
            got.double(), want[0][:, positions], rtol=2e-6, atol=2e-6, msg=what
        )
        assert _relative_error(mine.grad, want[1][positions][rows]) < 2e-6, f"hidden {what}"
        weight_grad = _gathered_rows(shard.grad, tp_group)
        dist.all_reduce(weight_grad, group=cp_group)
        assert _relative_error(weight_grad, want[2]) < 2e-6, f"weight {what}"


def check_equals_materialised_by_tile(seed: int) -> None:
    """check_equals_materialised with the weight gradient formed by vocab tile in backward."""
    check_equals_materialised(seed, "backward")


def check_loss_mask_by_tile(seed: int) -> None:
    """check_loss_mask_forms_gradients_in_forward on the "backward" route: with loss_mask or
    not, proportional or not, each chunk once in forward and each vocab tile once in backward."""
    check_loss_mask_forms_gradients_in_forward(seed, "backward")


def checks_for(tp: int) -> List[str]:
    names = ["check_equals_materialised", "check_large_logits", "check_gradcheck_float64"]
    names += ["check_loss_mask_forms_gradients_in_forward", "check_loss_mask_second_backward"]
    if tp < 4:
        # the routes differ per rank only: TP 1 and 2 cover them (the CI budget is tight)
        names += ["check_equals_materialised_by_tile", "check_loss_mask_by_tile"]
        names += ["check_compiled_passes"]
    if tp > 1:
        names += ["check_sequence_parallel_hidden_refused"]
        names += ["check_sequence_parallel_equals_materialised"]
    return names
