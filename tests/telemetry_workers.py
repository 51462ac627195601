"""Bodies of the telemetry tests on a real GPTModel (tests/test_digit_telemetry.py); each runs on
every rank of a gloo group. References are computed here from the model's own logits in fp64,
without del_megatron: the ten digit columns, the labels and the loss mask shifted by hand."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

import del_megatron as dm
from benchmarks.host_syncs import HostSyncs
from del_megatron import megatron as dmm

from .gpt_helpers import GPT_VOCAB, batch_on_this_cp_rank, build_gpt, number_batch

CFG = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=GPT_VOCAB)
DIGIT_IDS = list(GPT_VOCAB.digit_ids)


def reference(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """Digit targets, correct argmaxes and summed entropy (nats) over the ten digit columns of
    full-vocab `logits` [b, s, V], in fp64 Python arithmetic, where `labels` [b, s] is a digit id
    and `mask` [b, s] is 1."""
    n = correct = entropy = 0.0
    for row in range(labels.size(0)):
        for pos in range(labels.size(1)):
            label = int(labels[row, pos])
            if label not in DIGIT_IDS or float(mask[row, pos]) == 0.0:
                continue
            z = [float(logits[row, pos, i]) for i in DIGIT_IDS]
            top = max(z)
            total = sum(math.exp(v - top) for v in z)
            p = [math.exp(v - top) / total for v in z]
            n += 1.0
            correct += float(max(range(10), key=lambda k: z[k]) == DIGIT_IDS.index(label))
            entropy -= sum(q * math.log(q) for q in p if q > 0)
    return {"n": n, "correct": correct, "entropy": entropy}


def shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [b, s] moved `by` positions to the left, zeros shifted in: MTP depth `by`'s targets."""
    out = torch.zeros_like(x)
    out[:, : x.size(1) - by] = x[:, by:]
    return out


def digit_targets(labels: torch.Tensor, mask: torch.Tensor) -> float:
    """How many positions of `labels` [b, s] hold a digit id where `mask` is not 0."""
    pairs = zip(labels.flatten().tolist(), mask.flatten().tolist(), strict=True)
    return float(sum(1 for label, kept in pairs if label in DIGIT_IDS and kept))


def _forward_with_logits(model, args, labels, mask) -> Tuple[dict, List[torch.Tensor]]:
    """The loss function's report for one forward with labels and loss mask, and every logits
    tensor the output layer formed in it ([b, s, V], in call order: MTP heads, then main)."""
    formed: List[torch.Tensor] = []
    model.eval()  # as evaluation runs: Megatron's MTP loss tracker (sized per model) stays out
    handle = model.output_layer.register_forward_hook(
        lambda module, inputs, out: formed.append(out[0].detach().transpose(0, 1).double())
    )
    dmm.register(CFG)
    try:
        with torch.no_grad():
            output = model(*args, labels=labels, loss_mask=mask)
        report = dmm.numerical_loss_func(mask, output)[2]
    finally:
        dmm.unregister()
        handle.remove()
    return report, formed


def _assert_entry(report: dict, name: str, total: float, count: float) -> None:
    got = report[name].tolist()
    assert got[1] == count, (name, got, count)
    assert math.isclose(got[0], total, rel_tol=2e-6, abs_tol=1e-5), (name, got, total)


def check_mtp_heads_report_their_own_digit_entries(mtp_layers: int) -> None:
    """With `mtp_layers` MTP heads, the loss function's report carries `mtp_k digit acc` and
    `mtp_k digit entropy` for each depth k, equal to the fp64 reference over head k's own logits
    at its targets: labels and loss mask shifted k to the left (Megatron's roll). The main
    head's `digit acc` / `digit entropy` are over the main logits, unshifted. A second forward
    makes no host sync in del_megatron's code (benchmarks/host_syncs.py)."""
    tokens, labels, positions = number_batch(2, seed=7)
    mask = torch.ones(labels.shape)
    mask[0, ::2] = 0.0  # every other position: each depth's targets under another half
    mask[1, -5:] = 0.0
    model = build_gpt(1, mtp_layers=mtp_layers)
    report, formed = _forward_with_logits(model, (tokens, positions, None), labels, mask)
    assert len(formed) == mtp_layers + 1
    heads = [(f"mtp_{k} ", formed[k - 1], k) for k in range(1, mtp_layers + 1)]
    for prefix, logits, depth in heads + [("", formed[-1], 0)]:
        want = reference(logits, shifted(labels, depth), shifted(mask, depth))
        assert want["n"] >= 5, (prefix, want)  # teeth: each head has digit targets
        _assert_entry(report, prefix + "digit acc", want["correct"], want["n"])
        _assert_entry(report, prefix + "digit entropy", want["entropy"], want["n"])
    names = {name for name in report if name.startswith("mtp_")}
    assert names == {
        f"mtp_{k} digit {w}" for k in range(1, mtp_layers + 1) for w in ("acc", "entropy")
    }
    # the MTP heads' telemetry reads nothing on the host (the forward above was the first)
    with HostSyncs() as syncs:
        _forward_with_logits(model, (tokens, positions, None), labels, mask)
    ours = [str(e) for e in syncs.events if e.where.startswith("del_megatron/")]
    assert not ours, "\n".join(ours)


def check_digit_entries_under_context_parallel(mtp_layers: int) -> None:
    """At CP 2 each rank reports its chunks of the micro-batch; summed over the CP group, as
    Megatron-LM sums report entries over DP x CP: `digit tokens` is the whole micro-batch's
    digit targets (its count one micro-batch, not one per CP rank), `digit acc` / `digit
    entropy` count every digit target of the micro-batch once, and an MTP head's count is that
    of the labels and mask shifted by its depth over the whole sequence (its mask is rolled
    across the CP split, as Megatron rolls it)."""
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group()
    tokens, labels, positions = number_batch(2, seed=11)
    mask = torch.ones(labels.shape)
    mask[0, 10:14] = 0.0
    whole = {"tokens": tokens, "labels": labels, "position_ids": positions, "loss_mask": mask}
    local = batch_on_this_cp_rank(whole, cp_group)
    # Megatron's RoPE slices its table for CP with pinned memory (CUDA): learned positions here.
    model = build_gpt(1, mtp_layers=mtp_layers, position_embedding_type="learned_absolute")
    args = (local["tokens"], local["position_ids"], None)
    report, formed = _forward_with_logits(model, args, local["labels"], local["loss_mask"])
    summed = {name: pair.clone() for name, pair in report.items()}
    for pair in summed.values():
        dist.all_reduce(pair, group=cp_group)
    whole_digits = digit_targets(labels, mask)
    assert whole_digits >= 10
    tokens_entry = summed["digit tokens"].tolist()
    assert tokens_entry[0] == whole_digits, tokens_entry
    assert abs(tokens_entry[1] - 1.0) < 1e-6, tokens_entry  # one micro-batch, whatever the CP
    assert summed["digit acc"][1].item() == whole_digits
    assert summed["digit entropy"][1].item() == whole_digits
    # this rank's own entries against the fp64 reference over its own logits and chunks
    own = reference(formed[-1], local["labels"], local["loss_mask"])
    _assert_entry(report, "digit entropy", own["entropy"], own["n"])
    for depth in range(1, (mtp_layers or 0) + 1):
        count = digit_targets(shifted(labels, depth), shifted(mask, depth))
        for what in ("acc", "entropy"):
            got = summed[f"mtp_{depth} digit {what}"][1].item()
            assert got == count, (depth, what, got, count)
