"""The CPU demo's commands without training runs: prepare, bad input, --help, check (the runs
themselves, under torchrun: tests/e2e/test_demo_runs.py)."""

import json
import subprocess
import sys

import pytest

from del_megatron.cli import main


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
    from del_megatron.demo import data

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
        ("demo --lr -0.1", "argument --lr: must be positive"),
        ("demo --alpha abc", "argument --alpha: 'abc' is not a float"),
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
    if argv[0] == "demo":
        argv += ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


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
        "import sys; from del_megatron.cli import main; main(['demo', '--help']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' "
        "or m.startswith(('del_megatron.demo.train', 'del_megatron.demo.data', "
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
