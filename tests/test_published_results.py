"""The published GSM8K control sweep (docs/results/gsm8k_smollm2_control*.json, written by
`del-megatron compare-qa`): its per-run accuracies are its problem counts' sums, its declared
intervals recompute from those counts, and docs/results.md's tables are these files' numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from del_megatron.tools.demo.stats import paired_difference
from del_megatron.tools.qa import analysis, report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "docs" / "results" / "gsm8k_smollm2_control.json").read_text())
COUNTS = json.loads((ROOT / "docs" / "results" / "gsm8k_smollm2_control_problems.json").read_text())
ACCURACY = tuple(m for m in report.METRICS if m[0].startswith("digit_acc_"))
SHAPE_KEYS = ("top_not_digit", "digit_mass", "digit_entropy", "target_probability")
SHAPE_KEYS += ("expected_distance", "calibration_error")
SHAPE = tuple(m for m in report.METRICS if m[0] in SHAPE_KEYS)
TRAIN_CE = tuple(m for m in report.TRAINING if m[0] == "final_train_ce")


def test_each_runs_accuracy_is_the_sum_of_its_problem_counts():
    assert set(COUNTS) == set(RESULTS["per_seed"])
    for arm, runs in COUNTS.items():
        assert set(runs) == set(RESULTS["per_seed"][arm])
        for seed, classes in runs.items():
            scored = RESULTS["per_seed"][arm][seed]
            for name, rows in classes.items():
                assert len(rows) == 500, (arm, seed, name)
                count, correct = sum(r[0] for r in rows), sum(r[1] for r in rows)
                assert scored[f"digit_targets_{name}"] == count, (arm, seed, name)
                assert scored[f"digit_acc_{name}"] == pytest.approx(correct / count, abs=1e-12)


def test_the_declared_intervals_recompute_from_the_problem_counts():
    seeds = [str(s) for s in RESULTS["seeds_compared"]]
    comparisons = RESULTS["comparisons"]
    assert len(comparisons) == 11  # every arm against ce, every DEL arm against each control
    for title, classes in comparisons.items():
        arm, against = title.split(" vs ")
        ours, theirs = [COUNTS[arm][s] for s in seeds], [COUNTS[against][s] for s in seeds]
        row = classes[report.PRIMARY_CLASS]
        want = paired_difference(
            [RESULTS["per_seed"][arm][s][report.PRIMARY] for s in seeds],
            [RESULTS["per_seed"][against][s][report.PRIMARY] for s in seeds],
        ).as_dict()
        assert row["seeds"] == pytest.approx(want, abs=1e-12), title
        for key, confidence in (("bootstrap", 0.95), ("bootstrap_family", 1 - 0.05 / 11)):
            got = analysis.bootstrap_difference(ours, theirs, "computed", confidence=confidence)
            assert got == pytest.approx(row[key], abs=1e-9), (title, key)


def test_the_docs_tables_are_the_published_numbers():
    text = (ROOT / "docs" / "results.md").read_text()
    summary, comparisons = RESULTS["summary"], RESULTS["comparisons"]
    tables = {
        "primary": report.primary_table(comparisons, len(comparisons)),
        "accuracy": report.table(summary, ACCURACY),
        "accuracy vs ce": report.differences(summary, ACCURACY + TRAIN_CE),
        "shape": report.table(summary, SHAPE),
        "shape vs ce": report.differences(summary, SHAPE),
        "classes": report.classes_table(comparisons),
        "shape vs the controls": report.against_controls(RESULTS["per_seed"], SHAPE),
    }
    for name, table in tables.items():
        assert table in text, name


def test_the_readme_quotes_the_published_primary_metric():
    """README's "Does it help?": DEL 0.1 and digit_ce 0.38 against ce, DEL 0.1 against
    digit_ce 0.38 and DEL 1.28 against ce, each as its mean [95% over seeds]."""
    text = " ".join((ROOT / "README.md").read_text().split())
    for title in ("del vs ce", "digit_ce@0.38 vs ce", "del vs digit_ce@0.38", "del@1.28 vs ce"):
        row = RESULTS["comparisons"][title][report.PRIMARY_CLASS]["seeds"]
        quoted = f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"
        assert quoted in text, (title, quoted)


def _leaves(tree, prefix=()) -> dict:
    """{path: value} of a nested dict's leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _leaves(sub, prefix + (key,)).items()}


def test_the_published_runs_read_back_give_the_published_report(tmp_path):
    """compare-qa --published: the control sweep's files read back as runs (per-problem rows
    rebuilt from the counts) and reported again give its summary and comparisons, every
    interval equal."""
    from del_megatron.tools.qa import published

    path = ROOT / "docs" / "results" / "gsm8k_smollm2_control.json"
    runs = published.load(str(path))
    assert {arm: sorted(r) for arm, r in runs.items()} == {
        arm: sorted(int(s) for s in r) for arm, r in RESULTS["per_seed"].items()
    }
    report.write(str(tmp_path), runs, RESULTS["seeds_compared"])
    again = json.loads((tmp_path / "results.json").read_text())
    for key in ("comparisons", "summary"):
        got, want = _leaves(again[key]), _leaves(RESULTS[key])
        assert got.keys() == want.keys(), key
        assert got == pytest.approx(want, abs=1e-12, nan_ok=True), key
    written = json.loads((tmp_path / "problem_counts.json").read_text())
    assert written == COUNTS
