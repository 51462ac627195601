"""`digit entropy` beside `digit acc`, the MTP heads' own entries, and `digit tokens` under
context parallelism: the loss function's report against fp64 references computed by hand."""

import math

import pytest
import torch

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.loss import LossParts, loss_parts
from del_megatron.megatron import registration as reg
from del_megatron.megatron import telemetry

from . import telemetry_workers

# ids 0..9 digits, 10 '.', vocab 16
VOCAB = dm.DigitVocab(range(10), [10])


def entropy64(z) -> float:
    """Entropy in nats of softmax(z), in Python floats."""
    top = max(z)
    weights = [math.exp(v - top) for v in z]
    total = sum(weights)
    return -sum(w / total * math.log(w / total) for w in weights if w > 0)


def report_for(mask: torch.Tensor, parts: LossParts, cfg) -> dict:
    output = parts.token_loss(cfg.token_weight)
    dmm.register(cfg)
    try:
        reg.record(output, parts, cfg)
        return dmm.numerical_loss_func(mask, output)[2]
    finally:
        dmm.unregister()


def test_digit_entropy_is_the_mean_entropy_of_the_ten_digit_logits_over_digit_targets():
    """One digit a token: labels '4', '7', 'x', '2', '9' with the last masked. The entropy of
    the softmax over the ten digit columns of each unmasked digit target, summed in fp64; the
    count is `digit acc`'s (the same targets)."""
    labels = torch.tensor([[4, 7, 12, 2, 9]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 1, 16, generator=gen, dtype=torch.float64) * 3  # [s, b, V]
    logits[1, 0, :10] = 0.0  # a uniform row: entropy ln 10
    logits[3, 0, 2] = 30.0  # a near-certain row: entropy ~0
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=VOCAB)
    report = report_for(mask, loss_parts(labels, logits, cfg), cfg)
    rows = [logits[pos, 0, :10].tolist() for pos in (0, 1, 3)]  # the unmasked digit targets
    want = sum(entropy64(z) for z in rows)
    assert entropy64(rows[1]) == pytest.approx(math.log(10))
    assert report["digit entropy"][1].item() == report["digit acc"][1].item() == 3.0
    assert report["digit entropy"][0].item() == pytest.approx(want, rel=1e-6)
    assert list(report).index("digit entropy") == list(report).index("digit acc") + 1
    # p(target) and the expected distance under the same softmax, in fp64 by hand
    probs = [softmax64(z) for z in rows]
    targets = (4, 7, 2)
    want_p = sum(p[t] for p, t in zip(probs, targets, strict=True))
    want_d = sum(
        sum(p[d] * abs(d - t) for d in range(10)) for p, t in zip(probs, targets, strict=True)
    )
    assert probs[1][7] == pytest.approx(0.1) and sum(abs(d - 7) for d in range(10)) / 10 == 3.1
    assert report["digit target prob"].tolist() == pytest.approx([want_p, 3.0], rel=1e-6)
    assert report["digit distance"].tolist() == pytest.approx([want_d, 3.0], rel=1e-6)


def softmax64(z) -> list:
    top = max(z)
    weights = [math.exp(v - top) for v in z]
    return [w / sum(weights) for w in weights]


def test_the_control_arm_reports_the_same_entries_but_the_term_and_evaluation_no_step_ones():
    """loss "ce" (an A/B's control arm): every entry a DEL report has but `del term` and
    `del weight`, with the same values where they share a name; under no_grad (evaluation)
    neither report has `digit tokens` or the weight."""
    labels = torch.tensor([[4, 7, 12, 2, 9]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    logits = torch.randn(5, 1, 16, generator=torch.Generator().manual_seed(3))
    reports = {}
    for loss in ("ce", "del"):
        cfg = dm.NumericalLossConfig(loss=loss, alpha=0.1, vocab=VOCAB)
        reports[loss] = report_for(mask, loss_parts(labels, logits, cfg), cfg)
    ce, numerical = reports["ce"], reports["del"]
    assert set(numerical) - set(ce) == {"del term", "del weight"}
    for key in set(ce) - {"lm loss"}:
        assert ce[key].tolist() == numerical[key].tolist(), key
    assert ce["lm loss"][0].item() == pytest.approx(ce["ce loss"][0].item())
    with torch.no_grad():
        cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=VOCAB)
        evaluated = report_for(mask, loss_parts(labels, logits, cfg), cfg)
    assert set(numerical) - set(evaluated) == {"del weight", "digit tokens"}


def test_chunked_digit_entropy_counts_held_slots_only():
    """A chunking vocab's [b, s, 3, 10] slot logits: a 3-digit label holds 3 slots, a 2-digit one
    2, a 1-digit one 1, a non-digit none. Slots that hold no digit carry inf and NaN, which
    must reach neither the sum nor the count; a masked 3-digit label counts nothing."""
    gen = torch.Generator().manual_seed(9)
    slot_logits = torch.randn(1, 5, 3, 10, generator=gen, dtype=torch.float64) * 2
    digit_count = torch.tensor([[3, 2, 1, 0, 3]])
    for pos, count in enumerate(digit_count[0].tolist()):
        slot_logits[0, pos, count:, 0] = float("inf")
        slot_logits[0, pos, count:, 1] = float("nan")
    digit = torch.randint(0, 10, (1, 5, 3), generator=gen) * (
        torch.arange(3) < digit_count.unsqueeze(-1)
    )
    zeros = torch.zeros(1, 5)
    parts = LossParts(
        ce=zeros,
        term=zeros,
        is_digit=digit_count > 0,
        digit_logits=slot_logits.float(),
        digit=digit,
        n_tokens=torch.tensor(5),
        n_digits=torch.tensor(9),
        digit_count=digit_count,
    )
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    held = [(pos, j) for pos in range(4) for j in range(int(digit_count[0, pos]))]
    want = sum(entropy64(slot_logits[0, pos, j].tolist()) for pos, j in held)
    right = sum(
        float(slot_logits[0, pos, j].argmax().item() == digit[0, pos, j].item()) for pos, j in held
    )
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=VOCAB)
    report = telemetry.report_entries(mask, reg.Record(zeros, parts, cfg))
    assert len(held) == 6
    assert report["digit entropy"][1].item() == report["digit acc"][1].item() == 6.0
    assert report["digit entropy"][0].item() == pytest.approx(want, rel=1e-6)
    assert report["digit acc"][0].item() == right
    assert report["digit tokens"].tolist() == [6.0, 1.0]


def test_digit_tokens_counts_one_micro_batch_over_its_context_parallel_ranks():
    """Each CP rank counts 1 / cp_size micro-batches: Megatron-LM's sum over the CP ranks of a
    micro-batch gives its digit targets per micro-batch."""
    labels = torch.tensor([[4, 7, 12, 2]])
    logits = torch.zeros(4, 1, 16)
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=VOCAB)
    parts = loss_parts(labels, logits, cfg)
    mask = torch.ones(1, 4)
    rec = reg.Record(parts.token_loss(cfg.token_weight), parts, cfg, cp_size=4)
    assert telemetry.report_entries(mask, rec)["digit tokens"].tolist() == [3.0, 0.25]


@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_mtp_heads_report_their_own_digit_acc_and_entropy(gloo, mtp_layers):
    gloo(1, tensor_model_parallel_size=1).run(
        telemetry_workers.check_mtp_heads_report_their_own_digit_entries, mtp_layers
    )


def test_digit_entries_sum_over_context_parallel_ranks_to_the_micro_batch(gloo):
    workers = gloo(2, tensor_model_parallel_size=1, context_parallel_size=2)
    workers.run(telemetry_workers.check_digit_entries_under_context_parallel, 1)
