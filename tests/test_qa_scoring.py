"""compare-qa's pieces that need no model: which answer digits are computed, restated, copied
or other (on hand-labelled GSM8K solutions), the final answer, the fine-tuning folder, the tables'
paired differences and the run record."""

import json
import math

import pytest

from del_megatron.tools.qa import analysis, report
from del_megatron.tools.qa.answers import (
    COMPUTED,
    COPIED,
    OTHER,
    RESTATED,
    digit_classes,
    final_answer,
)
from del_megatron.tools.qa.data import Problem, read_problems, write_finetuning_root

QUESTION = "Natalia sold clips to 48 of her friends in April, and then half as many in May."
ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72 in all.\n#### 72"
)


def classes_by_number(question: str, answer: str) -> list:
    """(digits, class) per run of digits in the answer."""
    classes = digit_classes(question, answer)
    runs, current, cls = [], "", None
    for ch, c in zip(answer, classes, strict=True):
        if c is None:
            if current:
                runs.append((current, cls))
            current = ""
            continue
        assert cls is None or not current or c == cls  # one class a number
        current, cls = current + ch, c
    if current:
        runs.append((current, cls))
    return runs


def test_digits_copied_from_the_question_and_computed_in_annotations():
    assert classes_by_number(QUESTION, ANSWER) == [
        ("48", COPIED),
        ("2", OTHER),  # "48/2 ="
        ("48", COPIED),
        ("2", OTHER),
        ("24", COMPUTED),  # <<48/2=24>>: 24 is new
        ("24", RESTATED),  # the result written again after the annotation
        ("48", COPIED),
        ("24", OTHER),  # "So 48+24 =": an earlier result used again, outside annotations
        ("48", COPIED),
        ("24", OTHER),
        ("72", COMPUTED),  # <<48+24=72>>
        ("72", RESTATED),
        ("72", RESTATED),  # #### 72
    ]


# GSM8K test problems (0-based lines of test.jsonl), shortened; the cases docs/results.md names.
LEMONS = (  # 12: the computed 10.5 is written before the annotation that restates it
    "Each year it will grow 7 lemons, which he can sell for $1.5 each. It costs $3 a year",
    "He makes $10.5 selling lemons each year because 7 x 1.5 = <<7*1.5=10.5>>10.5\n"
    "He earns $7.5 each year from the lemon tree because 10.5 - 3 = <<10.5-3=7.5>>7.5\n"
    "#### 13",
)
JEWELRY = (  # 15: an annotation with nothing to compute
    "jewelry worth $5,000 at a profit of 2.5%",
    "$5000*(2.5/100) = $<<5000*(2.5/100)=125>>125\n"
    "since $125 > $96, he will choose jewelry, making $<<125=125>>125\n#### 125",
)
BOOK = (  # 24: a result computed outside any annotation
    "Kyle bought last year's best-selling book for $19.50. This is with a 25% discount.",
    "Dividing both sides by .75, we get X = $26.\n#### 26",
)
TOYS = (  # 52: a result whose value is the question's ("remove 15 pounds")
    "He needs to remove 15 pounds from it. His comic books weigh 1/4 pound each",
    "30 x .25 = <<30*.25=7.5>>7.5\nHe needs to remove 15 toys because 7.5 / .5 = <<15=15>>15\n"
    "#### 15",
)
TEMPERATURES = (  # 490: negative results, restated after ">>" with their minus sign
    "The highest temperature ever recorded in Southlandia is -48 degrees Fahrenheit. The "
    "highest temperature ever recorded in Northlandia is 21 degrees Fahrenheit. The highest "
    "temperature recorded in Midlandia is -3 degrees Fahrenheit. What is the average highest "
    "temperature of these 3 countries?",
    "-48 + 21 + (-3) = <<-48+21+(-3)=-30>>-30\n-30/3 = <<-30/3=-10>>-10 degrees\nThe average "
    "highest temperature recorded in Southlandia, Northlandia, and Midlandia is -10 degrees "
    "Fahrenheit.\n#### -10",
)


@pytest.mark.parametrize(
    "problem, expected",
    [
        (
            LEMONS,
            [("10", OTHER), ("5", OTHER), ("7", COPIED), ("1", COPIED), ("5", COPIED)]
            + [("7", COPIED), ("1", COPIED), ("5", COPIED)]
            + [("10", RESTATED), ("5", RESTATED), ("10", RESTATED), ("5", RESTATED)]
            + [("7", OTHER), ("5", OTHER), ("10", OTHER), ("5", OTHER), ("3", COPIED)]
            + [("10", OTHER), ("5", OTHER), ("3", COPIED)]
            + [("7", RESTATED), ("5", RESTATED), ("7", RESTATED), ("5", RESTATED)]
            + [("13", RESTATED)],
        ),
        (
            JEWELRY,
            [("5000", COPIED), ("2", COPIED), ("5", COPIED), ("100", OTHER)]
            + [("5000", COPIED), ("2", COPIED), ("5", COPIED), ("100", OTHER)]
            + [("125", COMPUTED), ("125", RESTATED), ("125", OTHER), ("96", OTHER)]
            + [("125", OTHER), ("125", RESTATED), ("125", RESTATED), ("125", RESTATED)],
        ),
        (BOOK, [("75", OTHER), ("26", OTHER), ("26", RESTATED)]),
        (
            TOYS,
            [("30", OTHER), ("25", OTHER), ("30", OTHER), ("25", OTHER)]
            + [("7", COMPUTED), ("5", COMPUTED), ("7", RESTATED), ("5", RESTATED)]
            + [("15", COPIED), ("7", OTHER), ("5", OTHER), ("5", OTHER)]
            + [("15", COPIED), ("15", RESTATED), ("15", RESTATED), ("15", RESTATED)],
        ),
        (
            TEMPERATURES,
            [("48", COPIED), ("21", COPIED), ("3", COPIED)]
            + [("48", COPIED), ("21", COPIED), ("3", COPIED), ("30", COMPUTED)]
            + [("30", RESTATED), ("30", OTHER), ("3", COPIED)]
            + [("30", OTHER), ("3", COPIED), ("10", COMPUTED), ("10", RESTATED)]
            + [("10", OTHER), ("10", RESTATED)],
        ),
    ],
    ids=["lemons-12", "jewelry-15", "book-24", "toys-52", "temperatures-490"],
)
def test_hand_labelled_gsm8k_solutions(problem, expected):
    assert classes_by_number(*problem) == expected


def test_numbers_match_by_value_and_a_new_result_is_computed():
    question = "A bike costs $1,200.50 and a helmet $30. She has 30 dollars, 0.5 of it saved."
    answer = "1200.5 - 30 = <<1200.5-30=1170.5>>1170.5 and <<.50*2=1>>1 and <<2*3=30>>30\n#### 30"
    runs = classes_by_number(question, answer)
    # "1200.5" is the question's "1,200.50"; the decimal point is not a digit
    assert runs[:3] == [("1200", COPIED), ("5", COPIED), ("30", COPIED)]
    assert runs[6:8] == [("1170", COMPUTED), ("5", COMPUTED)]
    assert runs[10] == ("50", COPIED)  # ".50" is the question's "0.5"
    assert runs[12:14] == [("1", COMPUTED), ("1", RESTATED)]
    # a result whose value is in the question is restated, never copied or computed
    assert runs[-3:] == [("30", RESTATED), ("30", RESTATED), ("30", RESTATED)]


def test_final_answer():
    assert final_answer(ANSWER) == "72"
    assert final_answer("so\n#### 1,234.50 dollars") == "1234.5"
    assert final_answer("#### -3") == "-3"
    assert final_answer("#### 007") == "7"
    assert final_answer("no final line") is None
    # a generation is read up to its first final line
    assert final_answer("#### 5\nQuestion: ...\n#### 6") == "5"


def test_problems_read_and_written_in_bridges_layout(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"q": f"What is {i}+1?", "a": f"#### {i + 1}"} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    problems = read_problems(str(path), "q", "a")
    assert problems[2] == Problem("What is 2+1?", "#### 3")
    assert problems[2].text == "Question: What is 2+1?\nAnswer: #### 3"
    root = str(tmp_path / "root")
    write_finetuning_root(root, problems, problems[:2], seed=1)
    lines = [json.loads(x) for x in open(f"{root}/training.jsonl")]
    assert sorted(x["output"] for x in lines) == sorted(p.answer for p in problems)
    by_answer = {p.answer: p for p in problems}
    assert all(x == {"input": by_answer[x["output"]].prompt, "output": x["output"]} for x in lines)
    other = str(tmp_path / "other")
    write_finetuning_root(other, problems, problems[:2], seed=2)
    assert open(f"{other}/training.jsonl").read() != open(f"{root}/training.jsonl").read()
    with pytest.raises(ValueError, match=r"qa.jsonl:1 has no text field 'question'"):
        read_problems(str(path))


def test_paired_differences_against_ce():
    scores = {
        "base": {0: {"digit_acc_all": 0.70}},
        "ce": {1: {"digit_acc_all": 0.80}, 2: {"digit_acc_all": 0.82}, 3: {"digit_acc_all": 0.81}},
        "del": {1: {"digit_acc_all": 0.81}, 2: {"digit_acc_all": 0.84}, 3: {"digit_acc_all": 0.81}},
    }
    summary = report.summarize(scores, [1, 2, 3])
    assert summary["base"]["digit_acc_all"]["mean"] == 0.70
    assert "difference" not in summary["base"]["digit_acc_all"]
    diff = summary["del"]["digit_acc_all"]["difference"]
    # differences 0.01, 0.02, 0.00: mean 0.01, sd 0.01, t(0.975, 2) = 4.3027
    assert diff["mean"] == pytest.approx(0.01)
    assert diff["high"] - diff["mean"] == pytest.approx(4.302653 * 0.01 / math.sqrt(3), rel=1e-5)
    text = report.differences(summary, [m for m in report.METRICS if m[0] == "digit_acc_all"])
    assert "| del | +0.0100 [-0.0148, +0.0348] |" in text


def test_training_record_counts_a_resumed_iteration_once(tmp_path):
    rows = [
        {"iteration": 1, "ce loss": 2.0, "seconds": 30.0, "peak_gib": 3.0},
        {"iteration": 2, "ce loss": 1.0, "seconds": 10.0, "peak_gib": 5.0},
        {"iteration": 2, "ce loss": 1.5, "seconds": 40.0, "peak_gib": 2.0},  # after a resume
        {"iteration": 3, "ce loss": 0.5, "seconds": 20.0, "peak_gib": 2.5},
    ]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = report.training_record(str(tmp_path))
    assert record["final_train_ce"] == pytest.approx((2.0 + 1.5 + 0.5) / 3)
    assert record["seconds_per_iteration"] == pytest.approx((40.0 + 20.0) / 2)
    assert record["peak_gib"] == 3.0  # the iterations kept: 1, the resumed 2, 3


def test_two_sweeps_share_runs_by_claims(tmp_path):
    from del_megatron.tools.qa.finetune import Schedule
    from del_megatron.tools.qa.sweep import CLAIM, Sweep

    sweep = Sweep(str(tmp_path), "model", "train", "test", Schedule(1, 1, 1, 1e-5, 0, 8), 1, 1)
    folder = str(tmp_path / "seed-1" / "ce")
    assert sweep._claim(folder)
    assert not sweep._claim(folder)  # held by a live process (this one)
    (tmp_path / "seed-1" / "ce" / CLAIM).write_text("999999999")  # a sweep that stopped
    assert sweep._claim(folder)
    sweep._release(folder)
    assert not (tmp_path / "seed-1" / "ce" / CLAIM).exists()


def test_accuracy_difference_with_problems_as_units():
    def rows(*pairs):
        return {"problems": [{"all_correct": c, "all_count": n} for c, n in pairs]}

    results = {"ce": {1: rows((3, 4), (1, 2))}, "del": {1: rows((4, 4), (1, 2))}}
    paired = report.problem_paired(results, "del", [1])
    # per problem: differences 1 and 0 over 4 and 2 targets; the ratio estimator's residuals
    # 1 - 4/6 and 0 - 2/6, so se = sqrt((1/9 + 1/9) / (2 x 1)) / 3 = 1/9
    assert paired["mean"] == pytest.approx(1 / 6)
    assert paired["se"] == pytest.approx(1 / 9)
    assert paired["low"] == pytest.approx(1 / 6 - 1.96 / 9)


def test_a_failed_stage_names_its_log(tmp_path):
    import sys

    from del_megatron.tools.qa.finetune import Schedule
    from del_megatron.tools.qa.sweep import Sweep

    sweep = Sweep(str(tmp_path), "model", "train", "test", Schedule(1, 1, 1, 1e-5, 0, 8), 1, 1)
    log = tmp_path / "seed-1" / "del" / "train.log"
    log.parent.mkdir(parents=True)
    command = [sys.executable, "-c", "print('the worker says why'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"^train in .*seed-1/del failed \(exit 3\): see .*"):
        sweep._run(command, str(log))
    assert "the worker says why" in log.read_text()


def _counts(rng, problems: int, p_correct: float) -> dict:
    """problem_counts' layout for one run: per class [[count, correct]] per problem."""
    out = {}
    for name in analysis.COUNTED:
        rows = []
        for _ in range(problems):
            count = rng.randint(0, 6)
            rows.append([count, sum(rng.random() < p_correct for _ in range(count))])
        out[name] = rows
    return out


def test_bootstrap_is_the_crossed_resample_computed_plainly():
    import random

    import torch

    rng = random.Random(3)
    arm = [_counts(rng, 7, 0.8) for _ in range(3)]
    base = [
        {k: [[c, min(c, max(0, k_ - 1))] for c, k_ in v] for k, v in run.items()} for run in arm
    ]
    draws, seed = 50, 11
    got = analysis.bootstrap_difference(arm, base, "computed", draws=draws, seed=seed)
    # the same draws, in the same order, summed with loops: seeds first, then problems
    generator = torch.Generator().manual_seed(seed)
    seed_picks = torch.randint(3, (draws, 3), generator=generator).tolist()
    problem_picks = torch.randint(7, (draws, 7), generator=generator).tolist()
    replicates = []
    for seeds, problems in zip(seed_picks, problem_picks, strict=True):
        num = den = 0
        for s in seeds:
            for p in problems:
                (count, ours), (_, theirs) = arm[s]["computed"][p], base[s]["computed"][p]
                num, den = num + ours - theirs, den + count
        replicates.append(num / max(den, 1))
    low, high = torch.quantile(
        torch.tensor(replicates, dtype=torch.float64),
        torch.tensor([0.025, 0.975], dtype=torch.float64),
    ).tolist()
    assert (got["low"], got["high"]) == pytest.approx((low, high), abs=1e-12)
    total = sum(c for run in arm for c, _ in run["computed"])
    diff = sum(
        a[1] - b[1]
        for r, q in zip(arm, base, strict=True)
        for a, b in zip(r["computed"], q["computed"], strict=True)
    )
    assert got["mean"] == pytest.approx(diff / total)
    same = analysis.bootstrap_difference(arm, arm, "computed", draws=draws)
    assert (same["mean"], same["low"], same["high"]) == (0.0, 0.0, 0.0)


def test_declared_comparisons_meet_ce_and_each_control():
    arms = ["base", "ce", "digit_ce@0.1", "digit_ce@0.38", "del", "del@0.3"]
    assert report.contrasts(arms) == [
        ("digit_ce@0.1", "ce"),
        ("digit_ce@0.38", "ce"),
        ("del", "ce"),
        ("del@0.3", "ce"),
        ("del", "digit_ce@0.1"),
        ("del@0.3", "digit_ce@0.1"),
        ("del", "digit_ce@0.38"),
        ("del@0.3", "digit_ce@0.38"),
    ]


def test_published_results_keep_every_problems_counts(tmp_path):
    import random

    rng = random.Random(5)

    def score(p_correct):
        counts = _counts(rng, 9, p_correct)
        rows = [
            {
                f"{n}_{k}": counts[n][i][j]
                for n in counts
                for j, k in enumerate(("count", "correct"))
            }
            for i in range(9)
        ]
        acc = {
            f"digit_acc_{n}": sum(c for _, c in v) / max(sum(c for c, _ in v), 1)
            for n, v in counts.items()
        }
        return {**acc, "problems": rows, "distance_profile": [0.5] * 10, "calibration_bins": []}

    results = {
        "base": {0: score(0.5)},
        "ce": {s: score(0.7) for s in (1, 2)},
        "digit_ce@0.38": {s: score(0.75) for s in (1, 2)},
        "del": {s: score(0.8) for s in (1, 2)},
    }
    text = report.write(str(tmp_path), results, [1, 2])
    published = json.load(open(tmp_path / "results.json"))
    counts = json.load(open(tmp_path / report.PROBLEM_COUNTS))
    for arm, runs in results.items():
        for s, run in runs.items():
            kept = counts[arm][str(s)]["computed"]
            assert kept == [[r["computed_count"], r["computed_correct"]] for r in run["problems"]]
    assert set(published["comparisons"]) == {
        "digit_ce@0.38 vs ce",
        "del vs ce",
        "del vs digit_ce@0.38",
    }
    row = published["comparisons"]["del vs digit_ce@0.38"]["computed"]
    assert row["bootstrap_family"]["confidence"] == pytest.approx(1 - 0.05 / 3)
    assert row["seeds"]["mean"] == pytest.approx(
        sum(
            results["del"][s]["digit_acc_computed"]
            - results["digit_ce@0.38"][s]["digit_acc_computed"]
            for s in (1, 2)
        )
        / 2
    )
    assert "98.3% bootstrap (3 comparisons)" in text


def test_matched_weight_norms_are_the_terms_logit_gradients():
    """matched-weight's norms: digit_ce's is CE's gradient at the digit targets, softmax -
    onehot over the whole vocabulary, summed there by hand; DEL's the reference term's
    gradient (fp64 autograd)."""
    import torch

    import del_megatron as dm
    from del_megatron.reference import reference_lm_loss
    from del_megatron.tools.qa.matched_weight import _term_gradient_norm

    vocab = dm.DigitVocab(range(3, 13), [13])
    gen = torch.Generator().manual_seed(2)
    labels = torch.tensor([[-100, 3, 5, 13, 7, 20, 12], [4, 4, 30, -100, 9, 8, 1]])
    logits = torch.randn(7, 2, 32, generator=gen, dtype=torch.float64) * 2
    digit = (labels >= 3) & (labels <= 12)
    grad = torch.softmax(logits, -1).transpose(0, 1).clone()  # [b, s, V]
    grad.scatter_add_(-1, labels.clamp(min=0).unsqueeze(-1), -torch.ones(2, 7, 1).double())
    want_ce = float(grad[digit].norm())
    cfg = dict(vocab=vocab, ignore_index=-100)
    got_ce = _term_gradient_norm(labels, logits, dm.NumericalLossConfig(loss="digit_ce", **cfg))
    assert got_ce == pytest.approx(want_ce, rel=1e-10)
    z = logits.clone().requires_grad_(True)
    _, term = reference_lm_loss(labels, z, vocab, "del")
    (want_del,) = torch.autograd.grad(term.sum(), z)
    got_del = _term_gradient_norm(labels, logits, dm.NumericalLossConfig(loss="del", **cfg))
    assert got_del == pytest.approx(float(want_del.norm()), rel=1e-10)
    assert got_del > 0 and got_ce > 0
