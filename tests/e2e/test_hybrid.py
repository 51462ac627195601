"""Megatron-LM's hybrid scripts, pretrain_hybrid.py (HybridModel) and pretrain_mamba.py
(MambaModel at core_v0.16.1; from core_v0.18.0 a wrapper that runs pretrain_hybrid.py), through
their drop-ins (`-m del_megatron.megatron.pretrain_hybrid_del` / `pretrain_mamba_del`: entry.py,
the mechanism pretrain_gpt_del shares) on every tree of this environment, TP 2 on gloo.

The model is attention (`*`) and MLP (`-`) layers of Megatron-Core's local modules, from the
test fixture fixtures/del_hybrid_spec.py given by `--spec` (Megatron-LM's own hybrid specs are
Transformer Engine only; the fixture also stands in for the stack's final TENorm). From
core_v0.18.0 the pattern ends in an MTP depth (`/*-`). Mamba layers (`M`) need mamba_ssm's GPU
kernels and are not built here (docs/megatron-lm.md).

Every tree: the DEL arm trains, lm loss = ce + w x term at iteration 1, every entry finite, the
MTP head's digit entries; on the trees but the newest, its first MLP is a MoE layer, with
sequence parallelism. The environment's newest tag (core_v0.16.1's pretrain_mamba.py,
core_v0.19.0's pretrain_hybrid.py) also runs the stock script and the control arm (equal at
every step), a resume from iteration 5 (through pretrain_mamba_del from core_v0.18.0: the
wrapper's route trains the same model), and the refusal of --del-logits-free, naming the model
class, before any model exists. What the hybrid and GPT drop-ins share
(flags, forgotten-flag and tokenizer refusals, the digit reduction's accounting, resume
announcements) is tested on GPT (test_pretrain_gpt.py, test_ab_arms.py, test_heads.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from del_megatron.megatron.refusals import EXIT_CODE

from .conftest import Trainer
from .megatron_lm import (
    DIGIT_IDS,
    MOCK_DATA,
    TINY_GPT,
    cpu_environment,
    heads_for_this_environment,
    is_finite,
    tags_for_this_environment,
)
from .test_ab_arms import run_refused
from .test_pretrain_gpt import PRINTED, TELEMETRY, TP2, assert_resumed_repeats

FIXTURES = Path(__file__).with_name("fixtures")
TREES = tags_for_this_environment() + heads_for_this_environment()
NEWEST = tags_for_this_environment()[-1]
ALPHA = 0.3
IDS = ["--del-digit-token-ids", *DIGIT_IDS]
ARMS = {
    "stock": [],
    "ce": ["--numerical-loss", "ce", *IDS],
    "del": ["--numerical-loss", "del", "--del-alpha", str(ALPHA), *IDS],
}
MTP_ENTRIES = ("mtp_1 digit acc", "mtp_1 digit entropy", "mtp_1 digit tokens", "mtp_1 loss")
# the tiny GPT's training flags, its layer count given by the pattern instead
_TRAINING = [
    f for i, f in enumerate(TINY_GPT) if "--num-layers" not in TINY_GPT[max(i - 1, 0) : i + 1]
]


def is_hybrid(tree: Path) -> bool:
    """Whether the tree has pretrain_hybrid.py (core_v0.18.0 on), else MambaModel's script."""
    return (tree / "pretrain_hybrid.py").is_file()


def builds_mtp(tree: Path) -> bool:
    """Whether the tree's HybridModel builds an MTP depth without Transformer Engine: not on
    main (2026-08-22), whose MultiTokenPredictionLayer asks isinstance() of Transformer
    Engine's inference linear classes, None without it (upstream; stock fails the same way)."""
    mtp = tree / "megatron" / "core" / "transformer" / "multi_token_prediction.py"
    return is_hybrid(tree) and "is_inference_column_parallel_linear(" not in mtp.read_text()


def model_flags(tree: Path, moe: bool = False) -> list:
    """The tiny model: attention and MLP layers twice (the first MLP a MoE of 4 experts, top 2,
    with sequence parallelism, which Megatron-LM asks of MoE under TP, where `moe`), and an MTP
    depth where HybridModel builds one; no position embedding (as Nemotron-H), the fixture's
    spec."""
    spec = ["--spec", "del_hybrid_spec", "hybrid_stack_spec", "--position-embedding-type", "none"]
    layers = "*E*-" if moe else "*-*-"
    if moe:
        spec += ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
        spec += ["--sequence-parallel"]
    if builds_mtp(tree):
        pattern = ["--hybrid-layer-pattern", f"{layers}/*-", "--mtp-num-layers", "1"]
    elif is_hybrid(tree):
        pattern = ["--hybrid-layer-pattern", layers]
    else:
        pattern = ["--num-layers", "4", "--hybrid-override-pattern", layers]
    return _TRAINING + MOCK_DATA + TP2 + spec + pattern


@pytest.fixture(scope="session")
def hybrid(trainers):
    """hybrid(tree, script) -> a Trainer launching `script` (a drop-in module, or "stock":
    Megatron-LM's own script by path) from the tree the GPT drop-in tests use."""
    made = {}

    def get(tag: str, script: str) -> Trainer:
        if (tag, script) not in made:
            gpt = trainers(tag, "drop-in")
            own = "pretrain_hybrid" if is_hybrid(gpt.tree) else "pretrain_mamba"
            if script == "stock":
                launch = [str(gpt.tree / f"{own}.py")]
            else:
                launch = ["-m", f"del_megatron.megatron.{script or own}_del"]
            workdir = gpt.workdir / f"hybrid-{script or own}"
            workdir.mkdir(exist_ok=True)
            env = cpu_environment(FIXTURES)
            made[(tag, script)] = Trainer("drop-in", gpt.tree, launch, workdir, env)
        return made[(tag, script)]

    return get


def arm(hybrid, tag: str, name: str):
    """The `name` arm at `tag` through the tree's own script's drop-in (stock: the script
    itself); at the newest tag the DEL arm saves a torch checkpoint at 5 and 10."""
    trainer = hybrid(tag, "stock" if name == "stock" else "")
    saving = []
    if name == "del" and tag == NEWEST:
        saving = ["--save", str(trainer.path("ckpt")), "--save-interval", "5"]
        saving += ["--ckpt-format", "torch"]
    moe = tag != NEWEST  # the other trees' one run: MoE and SP too
    run = trainer.run(name, model_flags(trainer.tree, moe) + ARMS[name] + saving)
    assert run.returncode == 0 and sorted(run.iterations) == list(range(1, 11)), run.log[-3000:]
    return run


@pytest.mark.parametrize("tag", TREES)
def test_the_del_arm_trains_as_ce_plus_weight_times_term(hybrid, tag):
    run = arm(hybrid, tag, "del")
    tree = hybrid(tag, "").tree
    model = "HybridModel" if is_hybrid(tree) else "MambaModel"
    assert f"del_megatron: {model}'s loss is del" in run.log
    startup = f"del_megatron: del (alpha {ALPHA:g} on the mean term over digit targets, digit "
    assert startup in run.log
    first = run.iterations[1]
    assert first["del weight"] == pytest.approx(ALPHA, rel=PRINTED)
    expected = first["ce loss"] + first["del weight"] * first["del term"]
    assert first["lm loss"] == pytest.approx(expected, rel=PRINTED)
    assert first["del term"] > 0 and first["lm loss"] > first["ce loss"]
    entries = TELEMETRY + (MTP_ENTRIES if builds_mtp(tree) else ())
    for step in run.iterations.values():
        assert all(key in step and is_finite(step[key]) for key in entries), step


@pytest.mark.parametrize("tag", [NEWEST])
def test_the_control_arm_trains_the_stock_scripts_loss(hybrid, tag):
    stock, control = arm(hybrid, tag, "stock"), arm(hybrid, tag, "ce")
    for step, entries in stock.iterations.items():
        assert control.iterations[step]["lm loss"] == pytest.approx(
            entries["lm loss"], rel=PRINTED
        ), step
        assert control.iterations[step]["ce loss"] == control.iterations[step]["lm loss"]
        if "mtp_1 loss" in entries:
            assert control.iterations[step]["mtp_1 loss"] == pytest.approx(
                entries["mtp_1 loss"], rel=PRINTED
            )
    assert "digit acc" in control.iterations[1] and "del term" not in control.iterations[1]
    # the DEL arm starts from the same weights on the same batch: its CE is stock's loss
    first = arm(hybrid, tag, "del").iterations[1]
    assert first["ce loss"] == pytest.approx(stock.iterations[1]["lm loss"], rel=PRINTED)


@pytest.mark.parametrize("tag", [NEWEST])
def test_a_resume_through_pretrain_mamba_repeats_iterations_6_to_10(hybrid, tag):
    """Resumed through pretrain_mamba_del: from core_v0.18.0 it follows pretrain_mamba.py to
    pretrain_hybrid.py, so the resume of pretrain_hybrid_del's run repeats it."""
    whole = arm(hybrid, tag, "del")
    trainer = hybrid(tag, "pretrain_mamba")
    load = ["--load", str(hybrid(tag, "").path("ckpt")), "--ckpt-step", "5"]
    load += ["--ckpt-format", "torch"]
    resumed = trainer.run("del-resumed", model_flags(trainer.tree) + ARMS["del"] + load)
    keys = ("lm loss", "ce loss", "del term", "grad norm")
    assert_resumed_repeats(
        whole, resumed, keys + (("mtp_1 loss",) if "mtp_1 loss" in whole.iterations[6] else ())
    )


@pytest.mark.parametrize("tag", [NEWEST])
def test_logits_free_on_the_hybrid_models_is_one_line_before_any_model(hybrid, tag):
    trainer = hybrid(tag, "")
    model = "HybridModel" if is_hybrid(trainer.tree) else "MambaModel"
    flags = model_flags(trainer.tree) + ARMS["del"] + ["--del-logits-free"]
    returncode, launcher, stdout, stderr = run_refused(trainer, "logits-free", flags)
    assert returncode != 0 and f"exitcode: {EXIT_CODE}" in launcher, launcher[-3000:]
    lines = stderr[0].splitlines()
    refusals = [line for line in lines if line.startswith("del_megatron: refused:")]
    assert refusals == [
        f"del_megatron: refused: {model}.forward takes no output_processor, so it cannot run "
        "the loss logits-free (GPTModel on megatron-core >= 0.18 can); turn del_logits_free / "
        "--del-logits-free off"
    ], stderr[0][-3000:]
    assert not any("iteration        1/" in text for text in stdout.values())
    for rank, text in stderr.items():
        assert "Traceback" not in text, (rank, text[-3000:])
