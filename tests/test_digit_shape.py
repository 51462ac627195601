"""The digit distributions' shape metrics (del_megatron.tools.demo.digit_shape) against plain-Python
sums over hand-built distributions, and the per-problem sums through the demo's scorer."""

import math

import pytest
import torch

from del_megatron.tools.demo import digit_shape

# Two problems: the first with two digit targets, the second with one.
PROBS = [
    [0.05, 0.05, 0.1, 0.6, 0.1, 0.02, 0.02, 0.02, 0.02, 0.02],  # target 3, top 3 (0.6)
    [0.1] * 10,  # target 9, top 0 (0.1: ties go to the first digit)
    [0.3, 0.5, 0.2, 0, 0, 0, 0, 0, 0, 0],  # target 0, top 1 (0.5)
]
TARGETS = [3, 9, 0]
ROWS = [0, 0, 1]


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def _by_hand():
    """The metrics over all three targets, summed in plain Python."""
    n = len(PROBS)
    entropy = sum(-sum(p * _log(p) for p in probs if p > 0) for probs in PROBS) / n
    target = sum(probs[g] for probs, g in zip(PROBS, TARGETS, strict=True)) / n
    distance = (
        sum(
            sum(abs(k - g) * p for k, p in enumerate(probs))
            for probs, g in zip(PROBS, TARGETS, strict=True)
        )
        / n
    )
    # bins of width 0.1: 0.6 -> bin 6 (right), 0.1 -> bin 1 (wrong), 0.5 -> bin 5 (wrong)
    ece = (abs(1 - 0.6) + abs(0 - 0.1) + abs(0 - 0.5)) / n
    profile = []
    for d in range(10):
        mass = count = 0.0
        for probs, g in zip(PROBS, TARGETS, strict=True):
            for k, p in enumerate(probs):
                if abs(k - g) == d:
                    mass, count = mass + p, count + 1
        profile.append(mass / count if count else 0.0)
    return entropy, target, distance, ece, profile


def _sums():
    log_p = torch.tensor(PROBS, dtype=torch.float64).log()
    return digit_shape.sums(log_p, torch.tensor(TARGETS), torch.tensor(ROWS), rows=2)


def test_shape_metrics_match_plain_sums():
    summary = digit_shape.summarize(digit_shape.problem_rows(_sums()))
    entropy, target, distance, ece, profile = _by_hand()
    assert summary["digit_entropy"] == pytest.approx(entropy, abs=1e-12)
    assert summary["target_probability"] == pytest.approx(target, abs=1e-12)
    assert summary["expected_distance"] == pytest.approx(distance, abs=1e-12)
    assert summary["calibration_error"] == pytest.approx(ece, abs=1e-12)
    assert summary["distance_profile"] == pytest.approx(profile, abs=1e-12)
    bins = summary["calibration_bins"]
    assert [b[0] for b in bins] == [0, 1, 0, 0, 0, 1, 1, 0, 0, 0]
    assert bins[6][1:] == pytest.approx([0.6, 1.0]) and bins[5][1:] == pytest.approx([0.5, 0.0])


def test_a_subset_of_problems_is_the_sum_of_its_rows():
    rows = digit_shape.problem_rows(_sums())
    assert [r["count"] for r in rows] == [2.0, 1.0]
    first = digit_shape.summarize(rows[:1])
    assert first["target_probability"] == pytest.approx((0.6 + 0.1) / 2)
    assert first["expected_distance"] == pytest.approx(
        (sum(abs(k - 3) * p for k, p in enumerate(PROBS[0])) + 4.5) / 2
    )
    assert math.isnan(first["standard_errors"]["digit_entropy"])  # one problem: no spread
    assert digit_shape.summarize(rows)["standard_errors"]["target_probability"] > 0


def test_the_scorer_reads_the_ten_digit_logits_at_digit_targets_only():
    import del_megatron as dm
    from del_megatron.tools.demo.evaluate import digit_distributions

    vocab = dm.DigitVocab(range(10, 20), decimal_point_ids=[20])
    # row 0: '7' then '.' (not a digit target) then unscored; row 1: '0'
    labels = torch.tensor([[17, 20, -100], [10, -100, -100]])
    logits = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(0))
    hits, numbers, shape = digit_distributions(logits, labels, vocab)
    assert numbers.tolist() == [1, 1] and shape["count"].tolist() == [1.0, 1.0]
    digit_logits = logits[..., 10:20].double()
    p7 = torch.softmax(digit_logits[0, 0], -1)
    p0 = torch.softmax(digit_logits[1, 0], -1)
    assert shape["target_probability"].tolist() == pytest.approx([float(p7[7]), float(p0[0])])
    entropy = [float(-(p * p.log()).sum()) for p in (p7, p0)]
    assert shape["entropy"].tolist() == pytest.approx(entropy)
    distance = float((torch.arange(10) - 7).abs().double() @ p7)
    assert float(shape["expected_distance"][0]) == pytest.approx(distance)
