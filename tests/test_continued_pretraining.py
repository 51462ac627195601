"""docker/examples/*.sh choose where the weights come from: a checkpoint in CHECKPOINT_DIR is
resumed, else PRETRAINED_CHECKPOINT (converted weights) is loaded through Megatron-LM's
--pretrained-checkpoint, else FROM_SCRATCH=1 must say that random weights are meant; an empty
folder alone is refused before the launcher starts. The launcher here records its arguments."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "docker/examples").glob("*.sh"))
MODELS = [e for e in EXAMPLES if e.name != "common.sh"]


def run_example(script: Path, tmp_path: Path, **env: str):
    """Runs the example with a launcher that writes its arguments to a file; returns
    (exit code, stderr, the arguments or None when the launcher never ran)."""
    args_file = tmp_path / "args"
    args_file.unlink(missing_ok=True)
    launcher = tmp_path / "launcher"
    launcher.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {args_file}\n')
    launcher.chmod(0o755)
    full_env = {
        "PATH": os.environ["PATH"],
        "DATA_PATH": str(tmp_path / "data"),
        "TOKENIZER_MODEL": str(tmp_path / "tokenizer"),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(script), str(launcher)], env=full_env, capture_output=True, text=True
    )
    args = args_file.read_text().splitlines() if args_file.exists() else None
    return proc.returncode, proc.stderr, args


def checkpoint(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("0")
    return str(folder)


def flag_values(args, flag):
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_every_model_example_is_covered():
    assert {m.name for m in MODELS} == {
        "llama2-7b.sh",
        "llama3.1-8b.sh",
        "mistral-7b.sh",
        "nemotron-h-8b.sh",
        "qwen2.5-7b.sh",
    }


@pytest.mark.parametrize("script", MODELS, ids=lambda p: p.stem)
def test_an_empty_checkpoint_folder_is_refused(script, tmp_path):
    (tmp_path / "ckpt").mkdir()
    code, err, args = run_example(script, tmp_path, CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    assert code != 0 and args is None
    assert "holds no checkpoint" in err and "PRETRAINED_CHECKPOINT" in err
    assert "FROM_SCRATCH=1" in err


@pytest.mark.parametrize("script", MODELS, ids=lambda p: p.stem)
def test_converted_weights_start_the_run(script, tmp_path):
    pretrained = checkpoint(tmp_path / "converted")
    ckpt = str(tmp_path / "ckpt")
    code, err, args = run_example(
        script, tmp_path, CHECKPOINT_DIR=ckpt, PRETRAINED_CHECKPOINT=pretrained
    )
    assert code == 0, err
    assert flag_values(args, "--pretrained-checkpoint") == [pretrained]
    assert flag_values(args, "--load") == [ckpt] and flag_values(args, "--save") == [ckpt]
    assert "--finetune" not in args  # Megatron-LM sets it itself for the pretrained folder only


def test_a_saved_checkpoint_is_resumed_not_restarted(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    pretrained = checkpoint(tmp_path / "converted")
    code, err, args = run_example(
        MODELS[0], tmp_path, CHECKPOINT_DIR=ckpt, PRETRAINED_CHECKPOINT=pretrained
    )
    assert code == 0, err
    assert flag_values(args, "--load") == [ckpt]
    assert "--pretrained-checkpoint" not in args


def test_a_pretrained_folder_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "hf_model").mkdir()
    code, err, args = run_example(
        MODELS[0],
        tmp_path,
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        PRETRAINED_CHECKPOINT=str(tmp_path / "hf_model"),
    )
    assert code != 0 and args is None
    assert "holds no Megatron checkpoint" in err and "convert" in err


def test_from_scratch_is_said_out_loud(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    code, err, args = run_example(MODELS[0], tmp_path, CHECKPOINT_DIR=ckpt, FROM_SCRATCH="1")
    assert code == 0, err
    assert flag_values(args, "--load") == [ckpt]
    assert "--pretrained-checkpoint" not in args


@pytest.mark.parametrize("script", MODELS, ids=lambda p: p.stem)
def test_the_control_arm_is_the_same_command_line_but_one_flag(script, tmp_path):
    """NUMERICAL_LOSS=ce gives an A/B's control arm: every argument the DEL arm gets, but the
    value of --numerical-loss (the weight flags stay: the control arm says they are unused)."""
    env = dict(CHECKPOINT_DIR=checkpoint(tmp_path / "ckpt"), TENSORBOARD_DIR="/tb")
    _, _, numerical = run_example(script, tmp_path, **env)
    code, err, control = run_example(script, tmp_path, NUMERICAL_LOSS="ce", **env)
    assert code == 0, err
    assert flag_values(numerical, "--numerical-loss") == ["del"]
    assert flag_values(control, "--numerical-loss") == ["ce"]
    differ = [(a, b) for a, b in zip(numerical, control, strict=True) if a != b]
    assert differ == [("del", "ce")]
    assert flag_values(control, "--tensorboard-dir") == ["/tb"]
