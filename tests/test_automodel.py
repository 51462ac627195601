"""NeMo AutoModel 0.7.0's own LLM recipe with the numerical loss, on CPU (the automodel stage:
its pinned environment, examples/setup_env.sh automodel; DEL_TEST_AUTOMODEL=1).

Each run is `torchrun -m del_megatron.cpu.automodel CONFIG.yaml`: AutoModel's command line with
its CUDA-only calls mapped to the CPU. The model is a tiny Llama saved as a local Hugging Face
checkpoint and loaded by the recipe, under FSDP2 with an fp32 mixed-precision policy; the data a
fixed number-rich dataset (tests/automodel_data.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import yaml

from del_megatron.cpu.ports import free_port
from del_megatron.digits.vocab import DigitVocab
from del_megatron.reference import reference_lm_loss

from .automodel_data import DIGIT_IDS, VOCAB, DigitRows

ROOT = Path(__file__).resolve().parent.parent
ALPHA = 0.3
RECIPE = "del_megatron.automodel.recipe.NumericalLossRecipe"
STOCK = "nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction"
LOSS = {
    "_target_": "del_megatron.automodel.loss.NumericalLoss",
    "numerical_loss": "del",
    "alpha": ALPHA,
    "digit_ids": DIGIT_IDS,
    "decimal_point_ids": [13],
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama (vocab 128, hidden 64) saved with save_pretrained, weights fixed by seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def config(model: Path, out: Path, **over: Any) -> Dict[str, Any]:
    """The recipe's YAML as a dict: 3 steps of global batch 4 in micro-batches of 2; `over`
    replaces top-level blocks or, as "block.key", one key of a block."""
    cfg: Dict[str, Any] = {
        "recipe": RECIPE,
        "seed": 1234,
        "step_scheduler": {
            "global_batch_size": 4,
            "local_batch_size": 2,
            "max_steps": 3,
            "num_epochs": 1,
            "val_every_steps": 1000,
            "ckpt_every_steps": 1000,
        },
        "dist_env": {"backend": "gloo", "timeout_minutes": 2},
        "model": {
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
            "pretrained_model_name_or_path": str(model),
        },
        "distributed": {
            "strategy": "fsdp2",
            "tp_size": 1,
            "cp_size": 1,
            "dp_size": None,
            "sequence_parallel": False,
            "mp_policy": {
                "_target_": "torch.distributed.fsdp.MixedPrecisionPolicy",
                "param_dtype": "float32",
                "reduce_dtype": "float32",
                "output_dtype": "float32",
            },
        },
        "loss_fn": dict(LOSS),
        "dataset": {
            "_target_": "tests.automodel_data.DigitRows",
            "num_samples": 64,
            "tokenizer": None,
        },
        "dataloader": {
            "_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
            "collate_fn": "nemo_automodel.components.datasets.utils.default_collater",
            "shuffle": False,
        },
        "optimizer": {"_target_": "torch.optim.Adam", "lr": 1.0e-3, "weight_decay": 0},
        "checkpoint": {"enabled": False, "checkpoint_dir": str(out)},
    }
    for key, value in over.items():
        block, _, name = key.partition(".")
        if name:
            cfg[block][name] = value
        else:
            cfg[block] = value
    return cfg


class Run:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess) -> None:
        self.out, self.returncode = out, proc.returncode
        self.output = proc.stdout + proc.stderr
        log = out / "training.jsonl"
        self.steps: List[Dict[str, Any]] = (
            [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        )


def torchrun(nproc: int, *module_and_args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """torchrun --nproc-per-node=`nproc` -m MODULE ARGS from the checkout, one thread a rank."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command += [f"--master-port={free_port()}", "-m", *module_and_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run(cfg: Dict[str, Any], out: Path, nproc: int = 1, module: str = "del_megatron.cpu.automodel"):
    """torchrun -m `module` CONFIG.yaml; a launcher of tests/automodel_data.py is named as
    "tests.automodel_data swap" or "... grads"."""
    out.mkdir(parents=True, exist_ok=True)
    cfg["checkpoint"]["checkpoint_dir"] = str(out)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Run(out, torchrun(nproc, *module.split(), str(path)))


def ok(result: Run) -> Run:
    assert result.returncode == 0 and result.steps, result.output[-6000:]
    return result


def test_the_loss_is_the_fp64_oracle_on_the_recipes_first_step(tiny_llama, tmp_path):
    """Step 1's loss (before any update) against the tiny Llama in fp64 on the same four rows:
    mean CE + alpha x the term's mean over the step's digit targets."""
    from transformers import LlamaForCausalLM

    result = ok(run(config(tiny_llama, tmp_path), tmp_path))
    model = LlamaForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float64)
    rows = DigitRows(num_samples=64)
    items = [rows[i] for i in range(4)]
    inputs = torch.tensor([item["input_ids"] for item in items])
    labels = torch.tensor([item["labels"] for item in items])
    with torch.no_grad():
        logits = model(input_ids=inputs).logits  # [b, s, V] fp64
    vocab = DigitVocab(DIGIT_IDS, [13])
    ce, term = reference_lm_loss(labels, logits.transpose(0, 1), vocab, "del", ALPHA)
    digits = float(result.steps[0]["digit tokens"])
    expected = float(ce.sum()) / labels.numel() + ALPHA * float(term.sum()) / digits
    got = result.steps[0]["loss"]
    print(f"step 1 loss {got!r}, fp64 oracle {expected!r}, rel err {abs(got / expected - 1):.2e}")
    assert got == pytest.approx(expected, rel=2e-6)
    assert result.steps[0]["ce loss"] == pytest.approx(float(ce.sum()) / labels.numel(), rel=2e-6)


def gradient_norms(result: Run) -> Dict[str, float]:
    lines = [line.split() for line in result.output.splitlines() if line.startswith("GRAD ")]
    return {name: float(norm) for _, name, norm in lines}


# AutoModel's default fp32 RMSNorm drops its input's gradient at TP > 1 (the recipe refuses it):
# the tensor-parallel runs take torch's RMSNorm, TP 1 alike.
TORCH_RMS_NORM = {
    "model.backend": {
        "_target_": "nemo_automodel.components.models.common.BackendConfig",
        "rms_norm": "torch",
    }
}


def test_tensor_parallel_2_trains_what_tensor_parallel_1_trains(tiny_llama, tmp_path):
    """DEL at alpha 0.3, TP 2 (the logits a DTensor sharded on the vocabulary, the loss computed
    on each rank's shard) against TP 1: at every step the same loss, grad norm and entries, and
    at step 1 the same gradient of every parameter (the output layer, whose gradient comes from
    the loss on each rank's vocab shard, and the vocab-parallel input embedding included)."""
    grads = "tests.automodel_data grads"
    one = ok(
        run(config(tiny_llama, tmp_path / "1", **TORCH_RMS_NORM), tmp_path / "1", module=grads)
    )
    cfg = config(tiny_llama, tmp_path / "2", **TORCH_RMS_NORM, **{"distributed.tp_size": 2})
    two = ok(run(cfg, tmp_path / "2", nproc=2, module=grads))
    assert len(one.steps) == len(two.steps) == 3
    for a, b in zip(one.steps, two.steps, strict=True):
        print(f"step {a['step'] + 1}: loss TP 1 {a['loss']!r}, TP 2 {b['loss']!r}", end="; ")
        print(f"grad norm TP 1 {a['grad_norm']!r}, TP 2 {b['grad_norm']!r}")
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        for key in ("loss", "ce loss", "del term", "digit acc", "digit entropy", "digit tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key
    norms_1, norms_2 = gradient_norms(one), gradient_norms(two)
    assert set(norms_1) == set(norms_2) and len(norms_1) > 10
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(norms_1)
    for name, norm in norms_1.items():
        print(f"{name}: TP 1 {norm!r}, TP 2 {norms_2[name]!r}")
        assert norms_2[name] == pytest.approx(norm, rel=1e-6), name


def test_automodels_fp32_rms_norm_passes_no_gradient_to_an_all_reduced_input():
    """Why the recipe refuses Float32RMSNorm at TP > 1: AutoModel 0.7.0's compiled fp32 RMSNorm
    returns no gradient for an input that is the output of a functional all-reduce (the first
    decoder layer's input at TP > 1), where torch's nn.RMSNorm returns the plain input's."""
    proc = torchrun(2, "tests.automodel_data", "rms_norm", timeout=300)
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("RMSNORM ")]
    grads = {(name, kind): value for _, name, kind, value in lines}
    print("\n".join(" ".join(line[1:]) for line in lines) or proc.stderr[-3000:])
    assert proc.returncode == 0 and len(grads) == 4
    plain = float(grads["nn.RMSNorm", "plain"])
    assert float(grads["nn.RMSNorm", "all-reduced"]) == pytest.approx(plain, rel=1e-6)
    assert float(grads["Float32RMSNorm", "plain"]) == pytest.approx(plain, rel=1e-5)
    assert grads["Float32RMSNorm", "all-reduced"] == "None"


def test_alpha_0_and_the_control_arm_train_what_masked_cross_entropy_trains(tiny_llama, tmp_path):
    """DEL at alpha 0 and numerical_loss ce (an A/B's control arm) against AutoModel's own
    recipe and MaskedCrossEntropy: the same loss and grad norm at every step; the control arm
    reports the digit entries without a term."""
    masked = {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"}
    cfg = config(tiny_llama, tmp_path / "stock", recipe=STOCK, loss_fn=masked)
    stock = ok(run(cfg, tmp_path / "stock"))
    for name, loss_fn in (
        ("alpha 0", dict(LOSS, alpha=0.0)),
        ("ce", dict(LOSS, numerical_loss="ce")),
    ):
        out = tmp_path / name.replace(" ", "")
        ours = ok(run(config(tiny_llama, out, loss_fn=loss_fn), out))
        for a, b in zip(ours.steps, stock.steps, strict=True):
            print(f"{name} step {a['step'] + 1}: loss {a['loss']!r} / {b['loss']!r}", end=", ")
            print(f"grad norm {a['grad_norm']!r} / {b['grad_norm']!r}")
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert {"ce loss", "digit acc", "digit entropy", "digit tokens"} <= set(ours.steps[0])
        assert ("del term" in ours.steps[0]) == (name != "ce")
    assert "ce loss" not in stock.steps[0]


def test_under_accumulation_4_and_data_parallel_2_the_weight_on_the_mean_term_is_alpha(
    tiny_llama, tmp_path
):
    """Global batch 16 in micro-batches of 2 over 2 data-parallel ranks: 4 micro-batches a rank.
    The logged loss minus its CE, over the term's mean over the step's digit targets, is the
    weight the step put on that mean: alpha, not GA x DP x alpha."""
    cfg = config(tiny_llama, tmp_path, **{"step_scheduler.global_batch_size": 16})
    result = ok(run(cfg, tmp_path, nproc=2))
    for step in result.steps:
        weight = (step["loss"] - step["ce loss"]) / step["del term"]
        print(f"step {step['step']}: digit tokens {step['digit tokens']:.0f}, weight {weight!r}")
        assert weight == pytest.approx(ALPHA, rel=1e-4)
        assert step["num_label_tokens"] == 16 * 32


def test_a_continued_run_writes_a_hugging_face_folder_transformers_loads(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = config(
        tiny_llama,
        tmp_path,
        checkpoint={"enabled": True, "save_consolidated": True, "model_save_format": "safetensors"},
    )
    result = ok(run(cfg, tmp_path))
    (folder,) = sorted(tmp_path.glob("epoch_*_step_*/model/consolidated"))[-1:]
    trained = AutoModelForCausalLM.from_pretrained(folder)
    start = AutoModelForCausalLM.from_pretrained(tiny_llama)
    moved = [
        name
        for name, p in trained.named_parameters()
        if not torch.equal(p, start.state_dict()[name])
    ]
    assert trained.config.vocab_size == VOCAB and len(moved) == len(list(start.parameters()))
    rows = DigitRows(num_samples=4)
    assert torch.isfinite(trained(input_ids=torch.tensor([rows[0]["input_ids"]])).logits).all()
    assert len(result.steps) == 3


@pytest.mark.parametrize(
    "over, nproc, module, line",
    [
        (
            {"distributed.cp_size": 2},
            2,
            None,
            "context parallelism gives the loss each rank's chunks",
        ),
        (
            {},
            1,
            "tests.automodel_data swap",
            "the recipe's loss is MaskedCrossEntropy, not del_megatron's",
        ),
        ({"distributed.pp_size": 2}, 2, None, "pipeline parallelism hands the loss no"),
        (
            {"distributed.tp_size": 2},
            2,
            None,
            "compiled fp32 RMSNorm (model.layers.0.input_layernorm and 4 more",
        ),
    ],
    ids=["context-parallel", "loss-swapped-for-masked-ce", "pipeline-parallel", "fp32-rms-norm-tp"],
)
def test_refusals_are_one_line_before_step_1(tiny_llama, tmp_path, over, nproc, module, line):
    result = run(
        config(tiny_llama, tmp_path, **over),
        tmp_path,
        nproc=nproc,
        module=module or "del_megatron.cpu.automodel",
    )
    refused = [text for text in result.output.splitlines() if "del_megatron: refused:" in text]
    print(refused[0] if refused else result.output[-3000:])
    assert result.returncode != 0 and len(refused) == 1 and line in refused[0]
    assert "Traceback" not in result.output.split(refused[0])[0][-2000:]
    assert not result.steps  # stopped before step 1


class _Yaml:
    """What _check_the_config reads of AutoModel's RecipeConfig: get(dotted key), dataloader."""

    def __init__(self, values: Dict[str, Any], dataloader: Any = None) -> None:
        self.values, self.dataloader = values, dataloader

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


@pytest.mark.parametrize(
    "values, dataloader, line",
    [
        ({"packed_sequence.packed_sequence_size": 64}, None, "packed .THD. batches reach"),
        ({}, types.SimpleNamespace(emits_thd=True, packing=None), "packed .THD. batches reach"),
        ({"domain_mixture": {"weights": [1.0]}}, None, "a domain mixture weighs each token"),
    ],
    ids=["packed-sequence-size", "thd-collater", "domain-mixture"],
)
def test_what_the_yaml_decides_is_refused_before_automodel_builds_anything(
    values, dataloader, line
):
    from del_megatron.automodel.recipe import NumericalLossRecipe

    recipe = types.SimpleNamespace(cfg=_Yaml(values, dataloader))
    with pytest.raises(ValueError, match=line):
        NumericalLossRecipe._check_the_config(recipe)
    NumericalLossRecipe._check_the_config(types.SimpleNamespace(cfg=_Yaml({})))  # a plain run
