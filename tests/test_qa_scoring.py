"""compare-qa's pieces that need no model: which answer digits are copied or computed (on
hand-written GSM8K-style solutions), the final answer, the fine-tuning folder, the tables'
paired differences and the run record."""

import json
import math

import pytest

from del_megatron.qa import report
from del_megatron.qa.answers import COMPUTED, COPIED, OTHER, digit_classes, final_answer
from del_megatron.qa.data import Problem, read_problems, write_finetuning_root

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
        ("24", COMPUTED),  # <<48/2=24>>
        ("24", OTHER),  # the result restated after the annotation
        ("48", COPIED),
        ("24", OTHER),  # "So 48+24 ="
        ("48", COPIED),
        ("24", OTHER),
        ("72", COMPUTED),  # <<48+24=72>>
        ("72", OTHER),
        ("72", COMPUTED),  # #### 72
    ]


def test_numbers_match_by_value_and_a_result_is_computed_even_when_in_the_question():
    question = "A bike costs $1,200.50 and a helmet $30. She has 30 dollars."
    answer = "1200.5 - 30 = <<1200.5-30=1170.5>>1170.5\n#### 30"
    runs = classes_by_number(question, answer)
    # "1200.5" is the question's "1,200.50"; the decimal point is not a digit
    assert runs[:3] == [("1200", COPIED), ("5", COPIED), ("30", COPIED)]
    assert ("1170", COMPUTED) in runs and runs[-1] == ("30", COMPUTED)


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
    text = report.differences(summary, report.METRICS[:1])
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
    from del_megatron.qa.finetune import Schedule
    from del_megatron.qa.sweep import CLAIM, Sweep

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

    from del_megatron.qa.finetune import Schedule
    from del_megatron.qa.sweep import Sweep

    sweep = Sweep(str(tmp_path), "model", "train", "test", Schedule(1, 1, 1, 1e-5, 0, 8), 1, 1)
    log = tmp_path / "seed-1" / "del" / "train.log"
    log.parent.mkdir(parents=True)
    command = [sys.executable, "-c", "print('the worker says why'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"^train in .*seed-1/del failed \(exit 3\): see .*"):
        sweep._run(command, str(log))
    assert "the worker says why" in log.read_text()
