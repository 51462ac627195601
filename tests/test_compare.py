"""`del-megatron compare`: the statistics against hand-computed cases, the sweep's order and
resume with a stand-in trainer (the command itself at toy size, with real torchrun runs:
tests/e2e/test_demo_runs.py)."""

import json
import math
import os
import re

import pytest

from del_megatron.digits.slots import DEFAULT_SLOT_LOGITS
from del_megatron.tools.demo import compare, stats
from del_megatron.tools.demo.compare import Arm, parse_arm
from del_megatron.tools.demo.config import differing_settings


@pytest.mark.parametrize("df, quantile", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (30, 2.0423)])
def test_t_quantiles_match_the_tables(df, quantile):
    assert stats.t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-4)


def test_mean_interval_by_hand():
    # mean 0.3, sd sqrt(0.02) = 0.141421, half width t(0.975, 1) * sd / sqrt(2) = 12.7062 * 0.1
    got = stats.mean_interval([0.2, 0.4])
    assert (got.mean, got.n) == (pytest.approx(0.3), 2)
    assert (got.low, got.high) == (
        pytest.approx(0.3 - 1.270620, abs=1e-6),
        pytest.approx(1.570620, abs=1e-6),
    )
    one = stats.mean_interval([0.25])
    assert one.mean == 0.25 and math.isnan(one.low) and math.isnan(one.high)


def test_paired_difference_by_hand():
    # differences 0.1, 0.2, 0.0: mean 0.1, sd 0.1, half width 4.302653 * 0.1 / sqrt(3) = 0.248414
    got = stats.paired_difference([0.5, 0.7, 0.6], [0.4, 0.5, 0.6])
    assert got.mean == pytest.approx(0.1)
    assert (got.low, got.high) == (
        pytest.approx(-0.148414, abs=1e-6),
        pytest.approx(0.348414, abs=1e-6),
    )
    with pytest.raises(ValueError, match="paired with"):
        stats.paired_difference([1.0], [1.0, 2.0])


def test_standard_errors_by_hand():
    # 0, 1, 1, 0: sd 0.577350, / sqrt(4)
    assert stats.standard_error([0, 1, 1, 0]) == pytest.approx(0.288675, abs=1e-6)
    # digits right / digits per problem: 2/2, 0/2, 1/1, 1/3 -> ratio 4/8 = 0.5; residuals
    # 1, -1, 0.5, -0.5: sqrt(2.5 / (4 * 3)) / (8 / 4) = 0.228218
    got = stats.ratio_standard_error([2, 0, 1, 1], [2, 2, 1, 3])
    assert got == pytest.approx(0.228218, abs=1e-6)


@pytest.mark.parametrize(
    "text, arm, name",
    [
        ("ce", Arm("ce", 0.0), "ce"),
        ("del", Arm("del", 0.1), "del"),
        ("ntl_was", Arm("ntl_was", 0.3), "ntl_was"),
        ("del@0.01", Arm("del", 0.01), "del@0.01"),
        ("dist2@0.1", Arm("dist2", 0.1), "dist2"),
        ("digit_ce", Arm("digit_ce", 0.1), "digit_ce"),
        ("digit_ce@0.38", Arm("digit_ce", 0.38), "digit_ce@0.38"),
        ("del:length", Arm("del", 0.1, "length"), "del:length"),
        ("del:any@0.03", Arm("del", 0.03, "any"), "del:any@0.03"),
    ],
)
def test_arms_take_their_paper_weight_unless_given(text, arm, name):
    assert parse_arm(text) == arm and arm.name == name


@pytest.mark.parametrize(
    "text, match",
    [
        ("mse", "unknown loss"),
        ("ce@0.1", "no weight"),
        ("del@x", "number"),
        ("del@-1", "finite number >= 0"),
        ("del@nan", "finite number >= 0"),
        ("del@inf", "finite number >= 0"),
        ("del:short", "slot rule after ':'"),
        ("ce:length", "no slot logits"),
        ("del_single:any@0.1", "no slot logits"),
    ],
)
def test_bad_arms_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_arm(text)


SETTINGS = {"steps": 500, "micro_batch": 16, "eval_problems": 0, "save_interval": 100}
SETTINGS.update(curve_points=10, curve_problems=200)


def _finished_run(path, seed, loss, weight=None, **changed):
    """A metrics.json as the train worker writes it, with values that depend on seed and loss."""
    os.makedirs(path, exist_ok=True)
    bonus = 0.1 if loss != "ce" else 0.0
    weight = compare.PAPER_WEIGHTS[loss] if weight is None else weight
    config = {**SETTINGS, "loss": loss, "alpha": weight, "seed": seed, "out_dir": path}
    config = {**config, "reduction": "digit", "slot_logits": DEFAULT_SLOT_LOGITS, **changed}
    run = {
        "config": config,
        "finished": True,
        "history": [{"step": 1, "ce": 1.0 - bonus}],
        "digit_accuracy": 0.3 + bonus + seed / 1000,
        "exact_accuracy": 0.05 + bonus / 2,
        "mean_abs_log10_error": 0.2 - bonus + seed / 1000,
        "length_accuracy": 0.8 + bonus,
        "digit_entropy": 1.0 - seed / 100,
        "target_probability": 0.4 + bonus,
        "expected_distance": 1.5 - bonus,
        "calibration_error": 0.05,
        "distance_profile": [0.4 + bonus] + [0.06] * 9,
        "calibration_bins": [[10, 0.05 + k / 10, 0.05 + k / 10] for k in range(10)],
        "standard_errors": {"digit_accuracy": 0.01, "exact_accuracy": 0.02},
    }
    with open(os.path.join(path, "metrics.json"), "w") as fh:
        json.dump(run, fh)
    return 0


def test_sweep_order_resume_and_summary(tmp_path):
    arms, seeds, calls = [parse_arm("ce"), parse_arm("del")], [11, 22], []

    def train(arm, seed, path):
        calls.append((seed, arm.name))
        return _finished_run(path, seed, arm.loss)

    results = compare.sweep(str(tmp_path), arms, seeds, train, SETTINGS, log=lambda _: None)
    assert calls == [(11, "ce"), (11, "del"), (22, "ce"), (22, "del")]
    again = compare.sweep(str(tmp_path), arms, seeds, train, SETTINGS, log=lambda _: None)
    assert again == results
    assert len(calls) == 4  # nothing trained again
    summary = compare.summarize(results, seeds)
    digit = summary["del"]["digit_accuracy"]
    assert digit["per_seed"] == pytest.approx([0.411, 0.422])
    assert digit["mean"] == pytest.approx(0.4165)
    assert digit["difference"]["mean"] == pytest.approx(0.1)
    assert digit["difference"]["low"] == pytest.approx(0.1)  # the same difference in both seeds
    assert digit["standard_errors"] == [0.01, 0.01]
    assert "difference" not in summary["ce"]["digit_accuracy"]
    md = compare.table(summary)
    # Every row has the header's cells: no unescaped '|' (as in "mean |log10 error|") splits one.
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in md.splitlines()]
    assert len(set(cells)) == 1 and "mean \\|log10 error\\|" in md, md
    assert "| del | 0.417 [0.347, 0.486] | +0.100 [+0.100, +0.100] better |" in md
    log_error = compare._difference_cell(summary["del"]["mean_abs_log10_error"], "{:.4f}", False)
    assert log_error.endswith("better")  # lower is better for the error


def test_a_failed_run_stops_the_sweep_with_how_to_continue(tmp_path):
    arms = [parse_arm("ce"), parse_arm("del")]
    with pytest.raises(RuntimeError, match="seed 11, ce failed .exit 3.; rerun"):
        compare.sweep(str(tmp_path), arms, [11], lambda *a: 3, SETTINGS, log=lambda _: None)


@pytest.mark.parametrize(
    "arm, changed, named",
    [
        ("ce", {"steps": 1000}, "steps 1000 -> 500"),
        ("ce", {"eval_problems": 64}, "eval_problems 64 -> 0"),  # scored on other problems
        ("ce", {"curve_points": 4}, "curve_points 4 -> 10"),  # its curve at other steps
        ("del@0.05", {}, "alpha 0.1 -> 0.05"),
        ("del", {"reduction": "token"}, "reduction 'token' -> 'digit'"),  # alpha's old unit
    ],
)
def test_a_run_made_with_other_settings_is_not_reused(tmp_path, arm, changed, named):
    """A folder from an earlier sweep with other settings must not mix into this one's table."""
    arm = parse_arm(arm)
    path = compare.run_dir(str(tmp_path), 11, arm)
    _finished_run(path, 11, arm.loss, **changed)  # del at its paper weight, 0.1

    def train(*args):
        raise AssertionError("a run with other settings was trained over")

    with pytest.raises(RuntimeError, match=f"{named}.*another --out"):
        compare.sweep(str(tmp_path), [arm], [11], train, SETTINGS, log=lambda _: None)


def test_a_run_from_before_the_weight_unit_was_recorded_is_not_reused(tmp_path):
    """A run whose config has no `reduction` trained alpha x digit share on the mean term."""
    path = compare.run_dir(str(tmp_path), 11, parse_arm("del"))
    _finished_run(path, 11, "del")
    with open(os.path.join(path, "metrics.json")) as fh:
        run = json.load(fh)
    del run["config"]["reduction"]
    with open(os.path.join(path, "metrics.json"), "w") as fh:
        json.dump(run, fh)
    with pytest.raises(RuntimeError, match="reduction 'token' -> 'digit'.*another --out"):
        compare.sweep(str(tmp_path), [parse_arm("del")], [11], None, SETTINGS, log=print)


def test_a_run_with_another_slot_rule_is_not_reused(tmp_path):
    arm = parse_arm("del:length")
    _finished_run(compare.run_dir(str(tmp_path), 11, arm), 11, "del", slot_logits="any")
    with pytest.raises(RuntimeError, match="slot_logits 'any' -> 'length'.*another --out"):
        compare.sweep(str(tmp_path), [arm], [11], None, SETTINGS, log=lambda _: None)


def test_a_finished_run_without_the_end_metrics_is_scored_again_not_retrained(tmp_path):
    arm = parse_arm("del")
    path = compare.run_dir(str(tmp_path), 11, arm)
    _finished_run(path, 11, "del")
    with open(os.path.join(path, "metrics.json")) as fh:
        run = json.load(fh)
    for key in ("length_accuracy", "digit_entropy"):
        del run[key]
    with open(os.path.join(path, "metrics.json"), "w") as fh:
        json.dump(run, fh)
    calls, logged = [], []

    def rescore(arm, seed, out_dir):
        calls.append((seed, arm.name))
        return _finished_run(out_dir, seed, arm.loss)

    results = compare.sweep(str(tmp_path), [arm], [11], rescore, SETTINGS, log=logged.append)
    assert calls == [(11, "del")] and "scoring its end" in logged[0]
    assert results["del"][11]["length_accuracy"] == pytest.approx(0.9)

    def fails(arm, seed, out_dir):
        return 1

    with open(os.path.join(path, "metrics.json"), "w") as fh:
        json.dump(run, fh)  # the end metrics still missing
    with pytest.raises(RuntimeError, match="could not be scored .exit 1.; rerun"):
        compare.sweep(str(tmp_path), [arm], [11], fails, SETTINGS, log=lambda _: None)


def test_arms_are_also_paired_against_del_single(tmp_path):
    arms = [parse_arm("ce"), parse_arm("del_single"), parse_arm("del:length")]
    seeds = [11, 22]

    def train(arm, seed, path):
        return _finished_run(path, seed, arm.loss, slot_logits=arm.rule)

    results = compare.sweep(str(tmp_path), arms, seeds, train, SETTINGS, log=lambda _: None)
    # del_single and del:length score alike here (the stand-in's bonus is the loss's): 0 apart
    results["del:length"][22]["digit_accuracy"] += 0.02
    summary = compare.summarize(results, seeds, references=["del_single"])
    vs = summary["del:length"]["digit_accuracy"]["difference_vs_del_single"]
    # differences 0 and 0.02: mean 0.01, half width 12.7062 * 0.014142 / sqrt(2) = 0.127062
    assert vs["mean"] == pytest.approx(0.01) and vs["high"] == pytest.approx(0.137062, abs=1e-6)
    assert "difference_vs_del_single" not in summary["del_single"]["digit_accuracy"]
    md = compare.table_against(summary, "del_single")
    assert "| del:length | +0.010 [-0.117, +0.137] |" in md and "| del_single |" not in md
    for by_seed in results.values():
        for run in by_seed.values():
            run["curve"] = _with_curve(0.0, 0.0)["curve"]
    paths = compare.write_report(str(tmp_path), arms, seeds, results)
    with open(paths["json"]) as fh:
        record = json.load(fh)
    assert record["arms"]["del:length"]["slot_logits"] == "length"
    assert record["summary"]["ce"]["digit_entropy"]["n"] == 2
    with open(paths["md"]) as fh:
        assert "Paired against del_single" in fh.read()


def test_a_run_that_differs_only_in_how_it_was_driven_is_reused(tmp_path):
    path = compare.run_dir(str(tmp_path), 11, parse_arm("ce"))
    _finished_run(path, 11, "ce", save_interval=7, stop_after=0, resume=True)
    results = compare.sweep(
        str(tmp_path), [parse_arm("ce")], [11], None, SETTINGS, log=lambda _: None
    )
    assert results["ce"][11]["digit_accuracy"] == pytest.approx(0.311)


def test_differing_settings_names_each_change_and_skips_what_the_run_lacks():
    saved = {"steps": 1000, "lr": 0.002, "seed": 1, "out_dir": "a", "eval_problems": 0}
    wanted = {"steps": 500, "lr": 0.002, "seed": 2, "out_dir": "b", "hidden": 64}
    wanted["eval_problems"] = 9
    assert differing_settings(saved, wanted) == ["steps 1000 -> 500", "seed 1 -> 2"]


def _with_curve(seed_value, loss_bonus, steps=(100, 200)):
    """Run metrics with a learning curve: digit accuracy 0.1 * step / 100 + the bonus."""
    point = {"exact_accuracy": 0.0, "mean_abs_log10_error": 0.5, "train_ce": 1.0}
    return {
        "curve": [
            {"step": s, **point, "digit_accuracy": s / 1000 + seed_value + loss_bonus}
            for s in steps
        ]
    }


def test_curves_are_summarized_over_seeds_by_hand():
    results = {
        "ce": {1: _with_curve(0.0, 0.0), 2: _with_curve(0.02, 0.0)},
        # seed 2 of del scored one point more: only the steps every run has are summarized
        "del": {1: _with_curve(0.0, 0.01), 2: _with_curve(0.02, 0.03, steps=(100, 200, 300))},
    }
    curves = compare.summarize_curves(results, [1, 2])
    ce, dl = curves["ce"]["digit_accuracy"], curves["del"]["digit_accuracy"]
    assert ce["steps"] == [100, 200] and dl["steps"] == [100, 200]
    # ce at step 100: 0.1 and 0.12: mean 0.11, half width 12.7062 * 0.014142 / sqrt(2) = 0.127062
    assert ce["mean"] == pytest.approx([0.11, 0.21])
    assert ce["low"][0] == pytest.approx(0.11 - 0.127062, abs=1e-6)
    assert "difference" not in ce
    # del - ce, paired: 0.01 and 0.03: mean 0.02, half width 12.7062 * 0.014142 / sqrt(2)
    assert dl["difference"]["mean"] == pytest.approx([0.02, 0.02])
    assert dl["difference"]["high"][1] == pytest.approx(0.02 + 0.127062, abs=1e-6)


def test_final_train_ce_is_the_mean_of_the_last_twentieth():
    from del_megatron.tools.demo.report import final_train_ce

    history = [{"step": i + 1, "ce": float(i)} for i in range(100)]  # the last 5: 95..99
    assert final_train_ce(history) == pytest.approx(97.0)
    assert final_train_ce(history[:10]) == 9.0  # at least one step
    assert math.isnan(final_train_ce([]))


def test_a_seed_s_base_is_trained_once_before_its_arms_and_checked_when_reused(tmp_path):
    from del_megatron.tools.demo import continued

    calls = []

    def train_base(seed, path):
        calls.append(("base", seed))
        _finished_run(path, seed, "ce")
        run = json.load(open(os.path.join(path, "metrics.json")))
        run["base_ce"] = 1.0 + seed / 100
        json.dump(run, open(os.path.join(path, "metrics.json"), "w"))
        return 0

    def train(arm, seed, path):
        calls.append((arm.name, seed))
        _finished_run(path, seed, arm.loss)
        run = json.load(open(os.path.join(path, "metrics.json")))
        run["base_ce"] = 1.5 if arm.loss == "ce" else 1.25
        json.dump(run, open(os.path.join(path, "metrics.json"), "w"))
        return 0

    bases = {}

    def before_seed(seed):
        bases[seed] = continued.ensure_base(str(tmp_path), seed, train_base, SETTINGS, print)

    arms = [parse_arm("ce"), parse_arm("del")]
    results = compare.sweep(
        str(tmp_path), arms, [11, 22], train, SETTINGS, lambda _: None, before_seed
    )
    assert calls == [("base", 11), ("ce", 11), ("del", 11), ("base", 22), ("ce", 22), ("del", 22)]
    continued.add_base_change(results, bases)
    assert results["del"][22]["base_ce_change"] == pytest.approx(1.25 - 1.22)
    summary = compare.summarize(results, [11, 22])
    assert summary["del"]["base_ce"]["difference"]["mean"] == pytest.approx(-0.25)
    compare.sweep(str(tmp_path), arms, [11, 22], train, SETTINGS, lambda _: None, before_seed)
    assert len(calls) == 6  # nothing trained again
    with pytest.raises(RuntimeError, match="other settings \\(steps 500 -> 9"):
        continued.ensure_base(str(tmp_path), 11, train_base, {**SETTINGS, "steps": 9})
