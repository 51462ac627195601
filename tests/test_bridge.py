"""Megatron-Bridge 0.6.2 with DEL, against Bridge's real code on CPU (Python 3.12 environment,
tests/requirements-bridge.txt):

- the recipe flow (AutoBridge -> provider instance -> enable_numerical_loss with the recipe
  tokenizer's digit ids), the real GPTModelProvider and gpt_step.forward_step on a tiny
  Qwen2-class model, the step-wide digit reduction, and the real run_config.yaml save ->
  load_model_config round trip; values compared with del_megatron.reference on the same
  model's logits (one worker process, tests/bridge_workers/: Bridge's import alone takes a
  minute on 2 cores);
- continued pretraining as docs/continued-pretraining.md gives it: a Hugging Face model ->
  examples/bridge_convert.py import -> examples/bridge_pretrain_del.py (Bridge's finetune(),
  TP 2) -> export -> transformers; Bridge's pretrain() with the digit reduction at DP 2, resumed
  from a checkpoint (tests/bridge_loops.py); and Megatron-LM's pretrain_gpt.py from the same
  converted weights with the Docker examples' flags, exported back the same way.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHA = 0.5


def run_check(name: str, tmp_path) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "tests.bridge_workers", name, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    return run_check("bridge", tmp_path_factory.mktemp("bridge"))


def test_digit_ids_come_from_the_recipe_tokenizer(bridge):
    assert bridge["digit_ids"] == bridge["tokenizer_digit_ids"] == list(range(2, 12))
    assert bridge["point_ids"] == [12]
    assert bridge["provider_class"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"


def test_forward_step_token_reduction_matches_reference(bridge):
    r = bridge["token"]
    report = r["report"]
    assert r["num_tokens"] == r["ref_tokens"] == 29
    assert report["ce loss"][0] == pytest.approx(r["ref_ce_sum"], rel=1e-5)
    assert report["ce loss"][1] == pytest.approx(r["ref_tokens"])
    assert report["del term"][0] == pytest.approx(r["ref_term_sum"], rel=1e-5)
    assert report["del term"][1] == pytest.approx(r["ref_digits"])
    expected = r["ref_ce_sum"] + ALPHA * r["ref_term_sum"]
    assert r["loss_sum"] == pytest.approx(expected, rel=1e-5)
    assert report["lm loss"][0] == pytest.approx(expected, rel=1e-5)
    assert report["digit share"] == pytest.approx([r["ref_digits"], r["ref_tokens"]])
    assert 0 <= report["digit acc"][0] <= report["digit acc"][1]


def test_forward_step_logits_free_matches_the_materialised_step(bridge):
    r, token = bridge["logits_free"], bridge["token"]
    assert r["config_field"] is True and r["logits_formed"] == 0
    assert r["loss_sum"] == pytest.approx(token["loss_sum"], rel=1e-5)
    for key, value in token["report"].items():
        assert r["report"][key] == pytest.approx(value, rel=1e-5), key


def test_forward_step_digit_reduction_over_the_step(bridge):
    r = bridge["digit"]
    assert r["step_loss"] == pytest.approx(r["ref_step_loss"], rel=1e-5)


def test_the_digit_ce_control_trains_its_step_loss_and_reports_its_term(bridge):
    """digit_ce: mean CE + alpha x the mean CE over the step's digit targets, in Bridge's step."""
    r = bridge["digit_ce"]
    assert r["step_loss"] == pytest.approx(r["ref_step_loss"], rel=1e-5)
    assert r["step_loss"] != pytest.approx(bridge["digit"]["step_loss"], rel=1e-3)
    assert {"digit_ce term", "digit_ce weight"} <= set(r["report_keys"])


def test_stacked_forward_steps_count_each_step_once(bridge):
    """make_forward_step over numerical_forward_step, or over a user's forward step calling it:
    the digit-reduced step loss is the single wrapper's (the stacked loss function used to stop
    with a TypeError at the first micro-batch)."""
    want = bridge["digit"]["step_loss"]
    assert set(bridge["stacked"]) == {"ours wrapped again", "inside a user's, wrapped"}
    for name, got in bridge["stacked"].items():
        assert got == pytest.approx(want, rel=1e-6), name


def test_forward_step_refuses_a_model_without_the_loss(bridge):
    message = bridge["refused_without_registration"]
    assert message is not None and "enable_numerical_loss" in message


def test_run_config_round_trip_keeps_the_provider_class_and_no_del_setting(bridge):
    r = bridge["run_config"]
    assert r["model_target"] == bridge["provider_class"]
    assert r["loaded_class"] == bridge["provider_class"]
    assert r["del_keys"] == [] and r["del_in_text"] == []
    assert not r["loaded_has_del"]
    assert r["hidden_size"] == 64 and r["mlm_args"]


def test_checkpoint_loads_and_exports_to_hf_like_a_ce_run(bridge):
    r = bridge["export"]
    assert "error" not in r, r.get("error")
    assert r["weights_equal"]
    assert not r["loaded_config_has_del"]
    assert r["hf_del_keys"] == [] and r["hf_architectures"] == ["Qwen2ForCausalLM"]
    assert r["hf_embedding_equal"]


def test_model_config_path_works_or_refuses_loudly(bridge):
    r = bridge["model_config"]
    assert not r["outer_reaches_model"]
    assert r["outer_refused"] is not None and "ModelConfig.transformer" in r["outer_refused"]
    assert r["loss_sum"] == pytest.approx(r["ref_loss_sum"], rel=1e-5)


@pytest.mark.parametrize(
    "switch", ["ddp.use_megatron_fsdp", "dist.use_megatron_fsdp", "dist.use_torch_fsdp2"]
)
def test_logits_free_refuses_fsdp_on_a_recipe_config_container(bridge, switch):
    """A real ConfigContainer with one of Bridge's FSDP switches: enable_numerical_loss(...,
    logits_free=True) refuses it, naming the switch and the way out, before it changes the
    provider (the logits-free loss never calls the output layer, where FSDP gathers its
    weight); the same container without FSDP is accepted."""
    r = bridge["fsdp"][switch]
    flag = "--" + switch.split(".")[1].replace("_", "-")
    assert r["refused"] is not None and flag in r["refused"], r
    assert "--del-logits-free" in r["refused"]
    assert r["provider_unchanged"]
    accepted = bridge["fsdp"]["None"]
    assert accepted["refused"] is None and accepted["logits_free_after"] is True


def test_a_recipe_with_a_chunking_tokenizer_gets_its_number_tokens(bridge):
    """Llama-3.2's tokenizer.json named in a recipe's TokenizerConfig: Bridge's build_tokenizer
    (a MegatronTokenizer putting <|begin_of_text|> before every text) is recognised as chunking,
    and the provider gets the ids of the file's own vocab."""
    from .test_tokenizers import LLAMA3_TOKENIZER, ids_in_tokenizer_json

    r, expected = bridge["chunking"], ids_in_tokenizer_json(LLAMA3_TOKENIZER)
    assert r["tokenized_12"] == [r["bos"], expected["multi_digit_ids"][12]]
    assert r["chunked"] is True and r["slot_logits"] == "length"
    assert r["provider"] == {
        "del_digit_token_ids": list(expected["digit_ids"]),
        "del_decimal_point_token_ids": list(expected["decimal_point_ids"]),
        "del_multi_digit_token_ids": list(expected["multi_digit_ids"]),
    }


def test_readmes_bridge_block_runs_as_written(bridge):
    """README.md's Bridge lines on a recipe ConfigContainer: DEL at 0.1 with the recipe
    tokenizer's ids, and pretrain() called with the config and our forward step."""
    r = bridge["readme"]
    assert r["pretrain_calls"] == [[True, "numerical_forward_step"]]
    assert (r["loss"], r["alpha"], r["reduction"]) == ("del", 0.1, "digit")
    assert r["digit_ids"] == list(range(2, 12))


def test_recipe_example_dry_run_enables_the_loss(tmp_path):
    """examples/bridge_pretrain_del.py --tiny --dry-run, as README gives it: a recipe
    ConfigContainer, enable_numerical_loss reads the digit ids from the recipe's tokenizer."""
    from .bridge_workers.fixtures import digit_tokenizer_dir

    command = [sys.executable, "-W", "ignore", "examples/bridge_pretrain_del.py", "--tiny"]
    command += ["--tokenizer", digit_tokenizer_dir(str(tmp_path)), "--dry-run", "--loss", "dist2"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DEL: "))
    assert line == (
        "DEL: dist2, alpha 0.1, digit reduction, digit ids [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "
        "decimal points [12]; provider megatron.bridge.models.gpt_provider.GPTModelProvider"
    )


# ---------------------------------------------------------------------------------------------
# Continued pretraining from a Hugging Face model, and Bridge's own training loops
# (docs/continued-pretraining.md gives these commands). tests/hf_workers.py makes the model:
# a tiny Qwen2 model trained a little with transformers, an offline Qwen2 tokenizer, and data
# whose every sample is the same known sequence.

TRAIN_ALPHA = 0.5  # tests/bridge_loops.py ALPHA


def torchrun(*args: str) -> list:
    from del_megatron.cpu.ports import free_port

    launcher = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run"]
    # --tee 3: each rank's output goes through a file of its own, line by line, so that two
    # ranks' lines never run into each other.
    return [
        *launcher, "--nproc-per-node", "2", "--master-port", str(free_port()), "--tee", "3",
        *args,
    ]  # fmt: skip


def hf_worker(step: str, folder, out) -> list:
    return [sys.executable, "-W", "ignore", "-m", "tests.hf_workers", step, str(folder), str(out)]


def run_ok(command: list, timeout: int = 1200) -> str:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def logged_iterations(stdout: str, total: int) -> dict:
    """{iteration: {name: value}} from Bridge's "iteration N/ total | name: value | ..." lines
    (those of the run with `total` iterations)."""
    import re

    # A field is "name: value"; one that is not (another rank's text run into the line) is
    # passed over, never read as a number it does not hold.
    entry = re.compile(r"^\s*([a-z][a-z0-9 _()/-]*?)\s*:\s*([-+0-9.eEnaNifINF]+)\s*$")
    rows = {}
    for line in stdout.splitlines():
        match = re.search(rf"iteration\s+(\d+)/\s*{total} \|(.*)", line)
        if match:
            fields = (entry.match(f) for f in match.group(2).split("|"))
            rows[int(match.group(1))] = {m[1]: float(m[2]) for m in fields if m}
    return rows


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny HF model, its data and bridge_convert.py import of it (tests/hf_workers.py)."""
    folder = tmp_path_factory.mktemp("continued")
    made = folder / "made.json"
    run_ok(hf_worker("prepare", folder, made))
    return {"folder": folder, "made": json.loads(made.read_text())}


@pytest.fixture(scope="module")
def continued(prepared):
    """DEL from the converted weights with Bridge's finetune() (examples/bridge_pretrain_del.py,
    TP 2), and Bridge's pretrain() loops on the same data, in one torchrun
    (tests/bridge_loops.py)."""
    from .bridge_loops import FINETUNE_ITERS

    folder = prepared["folder"]
    loops = folder / "loops.json"
    stdout = run_ok(torchrun("-m", "tests.bridge_loops", str(folder), str(loops)))
    return {
        **prepared,
        "log": logged_iterations(stdout, FINETUNE_ITERS),
        "loops": json.loads(loops.read_text()),
    }


@pytest.fixture(scope="module")
def exported(continued, megatron_lm_route):
    """bridge_convert.py export of the finetune() run's checkpoint and export --megatron-lm of
    the one Megatron-LM's pretrain_gpt.py wrote, each loaded back and checked, in one process."""
    folder = continued["folder"]
    checked = folder / "checked.json"
    checkpoint = str(megatron_lm_route["checkpoint"])
    run_ok(hf_worker("export_and_check", folder, checked) + [checkpoint])
    return json.loads(checked.read_text())


def test_continued_pretraining_starts_from_the_imported_weights(continued):
    """The first step's ce loss is the Hugging Face model's own cross-entropy on that batch
    (through transformers, float64), far from a randomly initialised model's."""
    made, first = continued["made"], continued["log"][1]
    assert first["ce loss"] == pytest.approx(made["hf_ce"], rel=2e-6)
    assert made["random_model_ce"] - made["hf_ce"] > 3


def test_finetune_logs_compose_as_in_megatron_lm(continued):
    """The default digit reduction: lm loss = ce loss + alpha x del term, and the logged weight
    on the mean term is alpha, every iteration."""
    log = continued["log"]
    assert sorted(log) == [1, 2, 3]
    for row in log.values():
        assert row["del weight"] == pytest.approx(TRAIN_ALPHA, rel=2e-6)
        composed = row["ce loss"] + TRAIN_ALPHA * row["del term"]
        assert row["lm loss"] == pytest.approx(composed, rel=2e-6)
        assert 0 < row["digit share"] < 1 and row["del term"] > 0


def test_exported_model_loads_with_the_trained_weights(exported):
    r = exported["bridge"]
    assert r["class"] == "Qwen2ForCausalLM"
    assert all(r["same_as_megatron"].values()), r["same_as_megatron"]
    assert r["changed_by_training"] > 1e-4  # not the original model's weights
    assert r["logits_max_abs_diff"] < 1e-4 * max(1.0, r["logit_scale"])
    assert r["exported_ce"] != pytest.approx(r["original_ce"], rel=1e-3)


def test_pretrain_digit_reduction_logs_and_resumes(continued):
    """Bridge's pretrain(), data-parallel 2, "digit" reduction: lm loss = ce loss + alpha x
    del term; a run resumed from the iteration-2 checkpoint logs the same iterations 3 and 4."""
    loops = continued["loops"]
    uninterrupted = {row.pop("iteration"): row for row in loops["uninterrupted"]}
    resumed = {row.pop("iteration"): row for row in loops["resumed"]}
    assert sorted(uninterrupted) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert {"iter_0000002", "iter_0000004"} <= set(loops["saved"])
    for row in uninterrupted.values():
        composed = row["ce loss"] + TRAIN_ALPHA * row["del term"]
        assert row["lm loss"] == pytest.approx(composed, rel=1e-6)
    for iteration in (3, 4):
        assert resumed[iteration] == uninterrupted[iteration]
    assert uninterrupted[4]["lm loss"] < uninterrupted[1]["lm loss"]


# Megatron-LM's route: its own pretrain_gpt.py (core_v0.19.0 snapshot, with our drop-in) from
# the converted checkpoint, with the flags docker/examples/common.sh chooses, then Bridge's
# export of the checkpoint Megatron-LM wrote.
MEGATRON_LM_TAG = "core_v0.19.0"
TINY_QWEN2 = [  # tests/hf_workers.py's model, in pretrain_gpt.py's flags
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--add-qkv-bias", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "10000",
    "--seq-length", "16", "--max-position-embeddings", "64",
    # the 262 tokens padded to the model's 512 rows at TP 1 (Bridge's export) and TP 2 (training)
    "--make-vocab-size-divisible-by", "256",
]  # fmt: skip
CPU_RUN = [
    "--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
]  # fmt: skip


def start_flags(checkpoint_dir, pretrained) -> list:
    """docker/examples/common.sh's choice of --load/--pretrained-checkpoint."""
    script = 'source docker/examples/common.sh; choose_start "$1"; printf "%s\\n" "${START[@]}"'
    env = {**os.environ, "PRETRAINED_CHECKPOINT": str(pretrained)}
    proc = subprocess.run(
        ["bash", "-c", script, "-", str(checkpoint_dir)], cwd=ROOT, env=env, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode().split()


@pytest.fixture(scope="module")
def megatron_lm_route(prepared, tmp_path_factory):
    """pretrain_gpt.py through the drop-in, started as a module of the installed package from
    the Megatron-LM tree, from the converted weights."""
    from del_megatron.megatron import pretrain_gpt_del

    from .e2e.megatron_lm import cpu_environment, parse_log, prepare_tree
    from .hf_workers import data_prefix, hf_dir, megatron_dir

    folder, base = prepared["folder"], tmp_path_factory.mktemp("megatron-lm")
    # Megatron-LM's dataset helpers: the megatron-core wheel's build, which del_megatron.cpu
    # finds in the base environment this layered one extends
    tree = prepare_tree(MEGATRON_LM_TAG, base / "src", patched=False)
    checkpoint = base / "checkpoints"
    start = start_flags(checkpoint, megatron_dir(str(folder)))
    flags = [*TINY_QWEN2, *CPU_RUN, "--tensor-model-parallel-size", "2"]
    flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir(str(folder))]
    flags += ["--data-path", data_prefix(str(folder)), "--split", "98,1,1"]
    flags += ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"]
    flags += ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"]
    flags += ["--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100"]
    flags += ["--save", str(checkpoint), "--save-interval", "3", *start]
    flags += ["--numerical-loss", "del", "--del-alpha", str(TRAIN_ALPHA)]
    proc = subprocess.run(
        torchrun("-m", pretrain_gpt_del.__name__, *flags),
        cwd=tree,
        env=cpu_environment(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    iterations, _ = parse_log(proc.stdout)
    return {"start": start, "log": iterations, "checkpoint": checkpoint}


def test_megatron_lm_starts_from_the_converted_weights(megatron_lm_route, prepared):
    """pretrain_gpt.py with --pretrained-checkpoint (and an empty --load): the first step's
    ce loss is the Hugging Face model's, and its logged DEL entries compose (the default digit
    reduction: the mean term weighs alpha)."""
    assert "--pretrained-checkpoint" in megatron_lm_route["start"]
    log = megatron_lm_route["log"]
    assert sorted(log) == [1, 2, 3]
    assert log[1]["ce loss"] == pytest.approx(prepared["made"]["hf_ce"], rel=2e-6)
    for row in log.values():
        assert row["del weight"] == pytest.approx(TRAIN_ALPHA, rel=2e-6)
        composed = row["ce loss"] + TRAIN_ALPHA * row["del term"]
        assert row["lm loss"] == pytest.approx(composed, rel=2e-6)


def test_megatron_lm_checkpoint_exports_to_hugging_face(exported):
    r = exported["megatron_lm"]
    assert r["class"] == "Qwen2ForCausalLM"
    assert all(r["same_as_megatron"].values()), r["same_as_megatron"]
    assert r["changed_by_training"] > 1e-4
    assert r["logits_max_abs_diff"] < 1e-4 * max(1.0, r["logit_scale"])
