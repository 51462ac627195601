"""The shape of a model's digit distributions at held-out digit targets, the quantities the DEL
paper argues about (NTL over-sharpens, DIST2 over-flattens): the entropy, the target digit's
probability, the expected distance from the target, the calibration of the top digit, and the
mean probability of a digit by its distance from the target.

Per-target values are summed per problem (`sums`), so that a summary over any first n problems
is a sum of rows (`summarize`)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .stats import ratio_standard_error

DIGITS = 10
BINS = 10  # equal-width confidence bins of the calibration error

# Per problem: sums over its digit targets ([10] for the per-distance and per-bin ones).
SCALARS = ("count", "entropy", "target_probability", "expected_distance")
PER_DISTANCE = ("distance_mass", "distance_digits")
PER_BIN = ("bin_count", "bin_confidence", "bin_correct")


def sums(
    log_probs: torch.Tensor, target: torch.Tensor, row: torch.Tensor, rows: int
) -> Dict[str, torch.Tensor]:
    """Per row, the sums over its digit targets; log_probs [N, 10] (log-softmax over the ten
    digits), target [N] (the target digit), row [N] (each target's row in 0..rows-1).
    Returns SCALARS as [rows] and PER_DISTANCE, PER_BIN as [rows, 10] float64 tensors."""
    log_probs = log_probs.double()
    p = log_probs.exp()
    digits = torch.arange(DIGITS)
    distance = (digits.unsqueeze(0) - target.unsqueeze(1)).abs()  # [N, 10]
    confidence, top = p.max(-1)
    bin_of = (confidence * BINS).long().clamp(max=BINS - 1)
    one_bin = torch.nn.functional.one_hot(bin_of, BINS).double()  # [N, BINS]
    per_target = {
        "count": torch.ones_like(confidence),
        "entropy": -torch.where(p > 0, p * log_probs, 0.0).sum(-1),
        "target_probability": p.gather(1, target.unsqueeze(1)).squeeze(1),
        "expected_distance": (distance * p).sum(-1),
        # a digit's probability into the column of its distance from the target, and the
        # number of digits at each distance (for the per-digit mean)
        "distance_mass": torch.zeros(len(p), DIGITS, dtype=p.dtype).scatter_add(1, distance, p),
        "distance_digits": torch.zeros(len(p), DIGITS, dtype=p.dtype).scatter_add(
            1, distance, torch.ones_like(p)
        ),
        "bin_count": one_bin,
        "bin_confidence": one_bin * confidence.unsqueeze(1),
        "bin_correct": one_bin * (top == target).double().unsqueeze(1),
    }
    out = {}
    for name, values in per_target.items():
        shape = (rows, *values.shape[1:])
        out[name] = torch.zeros(shape, dtype=torch.float64).index_add(0, row, values)
    return out


def summarize(per_problem: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """The shape metrics over problems' sums (dicts of `sums`' keys, as numbers and lists):
    digit_entropy (nats), target_probability, expected_distance (digits), calibration_error
    (expected calibration error of the top digit, BINS equal-width bins), distance_profile
    (mean probability of a digit d = 0..9 away from the target), calibration_bins ([targets,
    mean confidence, accuracy] per bin) and `standard_errors` of the first three (problems as
    the units)."""
    counts = [p["count"] for p in per_problem]
    n = max(sum(counts), 1.0)

    def total(name: str, width: int) -> torch.Tensor:
        values = [p[name] for p in per_problem] or [[0.0] * width]
        return torch.tensor(values, dtype=torch.float64).sum(0)

    bins, confidence = total("bin_count", BINS), total("bin_confidence", BINS)
    correct = total("bin_correct", BINS)
    mass, digits = total("distance_mass", DIGITS), total("distance_digits", DIGITS)
    filled = bins.clamp(min=1.0)
    means = {
        "digit_entropy": "entropy",
        "target_probability": "target_probability",
        "expected_distance": "expected_distance",
    }
    out: Dict[str, object] = {
        key: sum(p[name] for p in per_problem) / n for key, name in means.items()
    }
    out["calibration_error"] = float((correct - confidence).abs().sum()) / n
    out["distance_profile"] = (mass / digits.clamp(min=1.0)).tolist()
    out["calibration_bins"] = [
        [int(b), c, a]
        for b, c, a in zip(
            bins.tolist(), (confidence / filled).tolist(), (correct / filled).tolist(), strict=True
        )
    ]
    out["standard_errors"] = {
        key: ratio_standard_error([p[name] for p in per_problem], counts)
        for key, name in means.items()
    }
    return out


def problem_rows(table: Dict[str, torch.Tensor]) -> List[Dict[str, object]]:
    """`sums`' [rows, ...] tensors as one dict of numbers and lists a row."""
    rows = len(table["count"])
    return [{name: values[i].tolist() for name, values in table.items()} for i in range(rows)]
