"""compare-qa's whole path on a tiny random Llama written as GGUF (tests/gguf_models.py), in the
Bridge environment: `del-megatron gguf-to-hf` de-quantizes it (held against the gguf package's
own de-quantization), `del-megatron compare-qa` imports it through Megatron-Bridge, trains it
with DEL in Bridge's finetune() for two iterations, exports and scores it beside the base model;
the scorer's digit targets and accuracy are held against a count and an unbatched recomputation
here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from del_megatron.tools.qa.answers import COMPUTED, COPIED, RESTATED, digit_classes
from del_megatron.tools.qa.data import SEPARATOR, read_problems

from .gguf_models import write_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHA = 0.5
TRAIN = [
    ("Ann has 3 apples and buys 4 more. How many now?", "3+4 = <<3+4=7>>7 apples.\n#### 7"),
    ("Bo reads 12 pages a day for 2 days. Pages?", "12*2 = <<12*2=24>>24 pages.\n#### 24"),
    ("Cy had 50 cents and spent 15. Left?", "50-15 = <<50-15=35>>35 cents.\n#### 35"),
    ("Di runs 6 km a day for 5 days. Total?", "6*5 = <<6*5=30>>30 km.\n#### 30"),
]
TEST = [
    ("Eve has 8 pens and gives away 3. Left?", "8-3 = <<8-3=5>>5 pens.\n#### 5"),
    ("Fay buys 2 bags of 16 nuts. Nuts?", "2*16 = <<2*16=32>>32 nuts.\n#### 32"),
    ("Gus saves 125 dollars a month for 3 months.", "125*3 = <<125*3=375>>375.\n#### 375"),
]


def cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "del_megatron.tools.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for q, a in rows:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qa")
    _, stored = write_tiny_llama(str(folder / "tiny.gguf"))
    hf = str(folder / "hf")
    cli("gguf-to-hf", str(folder / "tiny.gguf"), "--out", hf, cwd=ROOT)
    train, test = (
        write_jsonl(folder / "train.jsonl", TRAIN),
        write_jsonl(folder / "test.jsonl", TEST),
    )
    out = str(folder / "sweep")
    flags = ["--hf-model", hf, "--train", train, "--test", test, "--out", out]
    flags += ["--losses", f"del@{ALPHA:g}", "--seeds", "1", "--iters", "2"]
    flags += ["--global-batch", "2", "--micro-batch", "1", "--lr", "1e-3", "--warmup", "0"]
    flags += ["--seq-length", "128", "--problems", "3", "--greedy", "2"]
    first = cli("compare-qa", *flags, cwd=ROOT)
    again = cli("compare-qa", *flags, cwd=ROOT)  # everything done: nothing runs again
    return {"hf": hf, "stored": stored, "out": out, "test": test, "first": first, "again": again}


def test_gguf_is_dequantized_as_the_gguf_package_reads_it(swept):
    import torch
    from safetensors.torch import load_file

    weights = load_file(os.path.join(swept["hf"], "model.safetensors"))
    stored = swept["stored"]
    pairs = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.layers.1.mlp.down_proj.weight": "blk.1.ffn_down.weight",
        "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.norm.weight": "output_norm.weight",
    }
    for ours, theirs in pairs.items():
        np.testing.assert_array_equal(weights[ours].to(torch.float32).numpy(), stored[theirs])


def test_trained_with_del_in_bridges_finetune(swept):
    run = os.path.join(swept["out"], "seed-1", f"del@{ALPHA:g}")
    rows = [json.loads(line) for line in open(os.path.join(run, "train", "history.jsonl"))]
    assert len(rows) == 2
    for row in rows:
        assert row["del weight"] == pytest.approx(ALPHA)
        assert row["del term"] > 0 and row["digit tokens"] > 0
        assert row["lm loss"] > row["ce loss"]  # the term is in the loss trained
        assert 0.1 < row["peak_gib"] < 64 and row["seconds"] > 0
    assert "held by another sweep" not in swept["first"].stdout
    assert swept["again"].stdout.count("[") >= 2 and "converting" not in swept["again"].stdout


def test_scores_count_every_answer_digit_and_match_an_unbatched_recomputation(swept):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = read_problems(swept["test"])
    classes = [c for p in problems for c in digit_classes(p.question, p.answer) if c]
    results = json.load(open(os.path.join(swept["out"], "results.json")))["per_seed"]
    run = results[f"del@{ALPHA:g}"]["1"]
    # every digit of an answer is a token of its own here, and a digit target
    assert run["digit_targets_all"] == len(classes) == 36
    # each answer's annotation result is new (computed); the number after >> and the #### N
    # restate it
    assert run["digit_targets_computed"] == classes.count(COMPUTED) == 6
    assert run["digit_targets_restated"] == classes.count(RESTATED) == 12
    assert run["digit_targets_copied"] == classes.count(COPIED) == 18
    assert results["base"]["0"]["digit_targets_all"] == 36

    hf = os.path.join(swept["out"], "seed-1", f"del@{ALPHA:g}", "hf")
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    correct = total = not_digit = 0
    mass = 0.0
    for p in problems:
        ids = tokenizer(p.text, add_special_tokens=False)["input_ids"]
        start = len(tokenizer(p.prompt + SEPARATOR, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        for t in range(start, len(ids)):
            if ids[t] in digits:
                total += 1
                correct += int(logits[t - 1].argmax()) == ids[t]
                not_digit += int(logits[t - 1].argmax()) not in digits
                mass += float(torch.softmax(logits[t - 1].double(), -1)[digits].sum())
    assert total == 36
    assert run["digit_acc_all"] == pytest.approx(correct / total)
    assert run["top_not_digit"] == pytest.approx(not_digit / total)
    assert run["digit_mass"] == pytest.approx(mass / total, rel=1e-5)
    assert run["final_answer_n"] == 2
    text = open(os.path.join(swept["out"], "results.md")).read()
    assert "| base |" in text and f"| del@{ALPHA:g} |" in text
