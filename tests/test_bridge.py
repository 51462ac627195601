"""Megatron-Bridge 0.6.2 with DEL, against Bridge's real code on CPU (Python 3.12 environment,
tests/requirements-bridge.txt): the recipe flow (AutoBridge -> provider instance ->
enable_numerical_loss with the recipe tokenizer's digit ids), the real GPTModelProvider and
gpt_step.forward_step on a tiny Qwen2-class model, the step-wide digit reduction, and the real
run_config.yaml save -> load_model_config round trip. Values are compared with
del_megatron.reference on the same model's logits. One worker process runs the checks
(tests/bridge_workers.py: Bridge's import alone takes a minute on 2 cores)."""

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


def test_recipe_example_dry_run_enables_the_loss(tmp_path):
    """examples/bridge_pretrain_del.py --tiny --dry-run, as README gives it: a recipe
    ConfigContainer, enable_numerical_loss reads the digit ids from the recipe's tokenizer."""
    from .bridge_workers import digit_tokenizer_dir

    command = [sys.executable, "-W", "ignore", "examples/bridge_pretrain_del.py", "--tiny"]
    command += ["--tokenizer", digit_tokenizer_dir(str(tmp_path)), "--dry-run", "--loss", "dist2"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DEL: "))
    assert line == (
        "DEL: dist2, alpha 0.01, token reduction, digit ids [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "
        "decimal points [12]; provider megatron.bridge.models.gpt_provider.GPTModelProvider"
    )
