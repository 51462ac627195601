"""Bodies of the host-sync tests on gloo workers (test_host_syncs.py): every rank runs a first
step (what is made once per run is made there), then the counted step under HostSyncs."""

from __future__ import annotations

import itertools
import json
from functools import partial

import torch
import torch.distributed as dist

import del_megatron as dm
import del_megatron.megatron as dmm
from benchmarks.host_syncs import HostSyncs
from del_megatron.sequence import cp_positions

from .cases import (
    IGNORE,
    PADDED_VOCAB_SIZE,
    SPLIT_VOCAB,
    TOKEN_FORM,
    number_rich_labels,
    token_share,
)
from .gpt_helpers import GPT_VOCAB, SEQ, build_gpt, number_batch

# Packings of the parallel checks: (cu_seqlens of the whole sequence or None, cp_balancing).
# Documents of 8 * k positions: every one can be cut into 2 * cp = 4 chunks.
DOCUMENTS = torch.tensor([0, 16, 24, 48], dtype=torch.int32)
PACKINGS = {
    "bshd": (None, "document"),
    "thd": (DOCUMENTS, "document"),
    "thd-sequence-balanced": (torch.tensor([0, 13, 30, 48], dtype=torch.int32), "sequence"),
}


def _groups():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()


def _counted(what: str, step, *args, **kwargs) -> None:
    """step(*args, **kwargs) twice under HostSyncs; the second must record nothing. (Under a
    TorchDispatchMode torch.compile runs nothing: the "compiled" kernel takes its eager chunks,
    which are all the Python it has; Inductor's code itself cannot sync from Python.)"""
    with HostSyncs():
        step(*args, **kwargs)
    with HostSyncs() as syncs:
        step(*args, **kwargs)
    assert not syncs.events, f"rank {dist.get_rank()} {what}:\n{syncs.report()}"


def _lm_loss_step(labels, logits, cfg, layout, **how) -> None:
    leaf = logits.clone().requires_grad_(True)
    (dm.numerical_lm_loss(labels, leaf, cfg, layout, **how) * 0.5).sum().backward()


def _linear_step(hidden, weight, labels, cfg, layout, mask, **how) -> None:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    (dm.numerical_linear_loss(h, w, labels, cfg, layout, **how) * mask).sum().backward()


def _local_batch(seed: int, packing: str, tp_group, cp_group):
    """This rank's (labels [b, s/cp], cu_seqlens, cp_balancing) and a seed for its logits."""
    cu_seqlens, balancing = PACKINGS[packing]
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if cu_seqlens is None:
        labels = number_rich_labels(2, 48, seed)
    else:
        labels = number_rich_labels(1, 48, seed)
    positions = cp_positions(48 // cp, cp, cp_rank, cu_seqlens, balancing)
    return labels[:, positions], cu_seqlens, balancing


def check_lm_loss_steps(seed: int) -> None:
    """numerical_lm_loss forward + backward at TP 2 x CP 2: every kernel, DEL and DIST2 (the
    two place-weight schemes), both reductions, BSHD and THD (per-document and whole-sequence
    CP balancing)."""
    tp_group, cp_group = _groups()
    tp = dist.get_world_size(tp_group)
    cases = itertools.product(
        ("softmax", "recompute", "compiled"), ("del", "dist2"), ("token", "digit"), PACKINGS
    )
    for kernel, loss, reduction, packing in cases:
        labels, cu_seqlens, balancing = _local_batch(seed, packing, tp_group, cp_group)
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        shape = (labels.size(1), labels.size(0), PADDED_VOCAB_SIZE // tp)
        logits = torch.randn(shape, generator=gen).to(torch.bfloat16)
        cfg = dm.NumericalLossConfig(
            loss=loss,
            alpha=0.5,
            vocab=SPLIT_VOCAB,
            reduction=reduction,
            digit_share=token_share(reduction),
            ignore_index=IGNORE,
        )
        layout = dm.VocabParallelLayout(
            tp_group=tp_group, cp_group=cp_group, cu_seqlens=cu_seqlens, cp_balancing=balancing
        )
        what = f"{kernel} {loss} {reduction} {packing}"
        _counted(what, _lm_loss_step, labels, logits, cfg, layout, kernel=kernel)


def _linear_steps(seed: int, cases) -> None:
    tp_group, cp_group = _groups()
    tp = dist.get_world_size(tp_group)
    for (route, masked, sequence_parallel), packing in itertools.product(cases, PACKINGS):
        labels, cu_seqlens, balancing = _local_batch(seed, packing, tp_group, cp_group)
        s, b = labels.size(1), labels.size(0)
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(s, b, 16, generator=gen).to(torch.bfloat16)
        if sequence_parallel:
            hidden = hidden.chunk(tp)[dist.get_rank(tp_group)]
        weight = torch.randn(PADDED_VOCAB_SIZE // tp, 16, generator=gen).to(torch.bfloat16)
        mask = (torch.rand(b, s, generator=gen) > 0.3).float()
        cfg = dm.NumericalLossConfig(
            loss="del", alpha=0.5, vocab=SPLIT_VOCAB, ignore_index=IGNORE, **TOKEN_FORM
        )
        layout = dm.VocabParallelLayout(
            tp_group=tp_group,
            cp_group=cp_group,
            cu_seqlens=cu_seqlens,
            cp_balancing=balancing,
            sequence_parallel=sequence_parallel,
        )
        how = dict(weight_gradient=route, chunk_tokens=7)
        how.update(loss_mask=mask if masked else None)
        what = f"linear {route} mask={masked} sp={sequence_parallel} {packing}"
        _counted(what, _linear_step, hidden, weight, labels, cfg, layout, mask, **how)


def check_linear_loss_steps(seed: int) -> None:
    """numerical_linear_loss at TP 2 x CP 2, with and without sequence parallelism: the
    "backward" route (with and without the loss mask) and the "forward" route with it (what
    --del-logits-free runs in fp32 and at small h: the upstream gradient's proportionality to
    the mask checked on the device) and without it."""
    cases = [("backward", False, False), ("backward", True, True), ("forward", False, True)]
    cases += [("forward", True, False), ("forward", True, True)]
    _linear_steps(seed, cases)


LOSS_CHECKS = ["check_lm_loss_steps", "check_linear_loss_steps"]


# Files the hook checks count apart: the Megatron glue (the "digit" reduction's step accounting
# may make one host sync a step there: the copy of the step's two counts to an NCCL group's
# device when the batches are on the host) and the logits-free kernel.
OTHERS_FILES = ("del_megatron/megatron/", "del_megatron/kernels/linear.py")


def _from_others(event) -> bool:
    return event.where.startswith(OTHERS_FILES)


def _schedule(forward_step, data, model) -> None:
    """One training step of 2 micro-batches of 2 rows through Megatron's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=2,
        seq_length=SEQ,
        micro_batch_size=2,
    )


def _refused_by_this_core() -> bool:
    """True, after checking that register(logits_free=True) is refused, naming the version it
    needs, on a core whose GPTModel has no output_processor (megatron-core < 0.18)."""
    from del_megatron.megatron.logits_free import core_supports

    if core_supports():
        return False
    try:
        dmm.register(logits_free=True)
    except ValueError as exc:
        assert "megatron-core >= 0.18" in str(exc), exc
        return True
    dmm.unregister()
    raise AssertionError("logits_free was accepted by a core without output_processor")


def check_hook_step(reduction: str, logits_free: bool, out_path: str) -> None:
    """Two steps of Megatron's schedule (2 micro-batches of 2 rows, TP 2) through the hook
    (materialised or logits-free) and the loss_func wrapper ("digit": with the step
    accounting); the second one counted. Rank 0 writes the events to out_path as JSON:
    "loss_path" (del_megatron outside OTHERS_FILES), "others" (OTHERS_FILES) and "megatron"
    (the rest: Megatron-Core's own code, not counted by the tests)."""
    from megatron.core import parallel_state as ps

    if logits_free and _refused_by_this_core():
        _write_events(out_path, [])
        return
    model = build_gpt(dist.get_world_size())
    cfg = dm.NumericalLossConfig(
        loss="del",
        alpha=0.5,
        vocab=GPT_VOCAB,
        reduction=reduction,
        digit_share=token_share(reduction),
    )

    def forward_step(data_iterator, model):
        tokens, labels, positions = next(data_iterator)
        mask = torch.ones_like(labels, dtype=torch.float)
        # loss_mask, as pretrain_gpt.py passes it (logits-free: the forward route uses it)
        output = model(tokens, positions, None, labels=labels, loss_mask=mask)
        return output, partial(dmm.numerical_loss_func, mask)

    def step(seed: int, syncs=None):
        tokens, labels, positions = number_batch(4, seed)
        batches = [(tokens[i : i + 2], labels[i : i + 2], positions[i : i + 2]) for i in (0, 2)]
        # share_group as Megatron-LM's (lm.step_accounting): every micro-batch broadcasts the
        # counts from tensor-parallel rank 0 (here every rank reads the same data)
        tp_group = ps.get_tensor_model_parallel_group()
        accounting = dmm.DigitAccounting(
            GPT_VOCAB,
            2,
            group=ps.get_data_parallel_group(),
            labels_and_mask=lambda batch: (batch[1], None),
            share_group=tp_group,
            share_src=dist.get_global_rank(tp_group, 0),
        )
        data = accounting.wrap(iter(batches)) if reduction == "digit" else iter(batches)
        with accounting if reduction == "digit" else _Nothing(), syncs or _Nothing():
            _schedule(forward_step, data, model)
        model.zero_grad()

    dmm.register(cfg, logits_free=logits_free)
    try:
        step(1)
        syncs = HostSyncs()
        step(2, syncs)
    finally:
        dmm.unregister()
    _write_events(out_path, syncs.events)


def _write_events(out_path: str, events) -> None:
    """Rank 0 writes the events by where they come from (check_hook_step)."""
    if dist.get_rank() != 0:
        return
    ours = [e for e in events if e.where.startswith("del_megatron/") and not _from_others(e)]
    others = [e for e in events if _from_others(e)]
    rest = [e for e in events if e not in ours and e not in others]
    found = {"loss_path": ours, "others": others, "megatron": rest}
    with open(out_path, "w") as fh:
        json.dump({k: [str(e) for e in v] for k, v in found.items()}, fh)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
