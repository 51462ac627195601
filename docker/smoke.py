"""Smoke test of the image: its last build step, and on a GPU host

    docker run --rm --gpus all --entrypoint python del-megatron /opt/del-megatron/docker/smoke.py

Run from the working directory users run in, it checks three things.

1. The installed packages (not a source checkout that the working directory would put first on
   the import path): megatron-core and del-megatron import from site-packages, the compiled
   dataset helpers load, the CPU runtime's site folder exists, and DEL's loss and gradient on CPU
   match the float64 reference.
2. Megatron-LM's training code as pretrain_gpt.py imports it (in a child process, the checkout
   first on the path): megatron.training, and megatron.core.dist_checkpointing.strategies.torch,
   which asserts NVRx >= 0.6.0 whenever NVRx is importable; with NVRx installed, Megatron must
   find its asynchronous checkpointing.
3. With CUDA: transformer_engine.pytorch imports, and a DEL step on the GPU (the default kernel,
   torch.compile'd there) matches the float64 reference, value and gradient.
"""

import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import megatron.core
import torch
from megatron.core.datasets import helpers_cpp  # noqa: F401  (compiled; Megatron's datasets need it)

import del_megatron as dm
import del_megatron.megatron  # noqa: F401  (the Megatron glue imports)
from del_megatron.reference import reference_lm_loss

MEGATRON_LM_DIR = Path(os.environ.get("MEGATRON_LM_DIR", "/opt/Megatron-LM"))
# fp32 logits: the kernels accumulate in fp32, the reference in fp64
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def installed(module) -> bool:
    path = Path(module.__file__).resolve()
    roots = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    return any(root in path.parents for root in roots)


def version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def del_step(device: str) -> list:
    """DEL forward and backward on `device` against the float64 reference; the per-token loss."""
    vocab = dm.DigitVocab(range(10), [10])
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=vocab)
    generator = torch.Generator().manual_seed(0)
    labels = torch.tensor([[1, 10, 5, 3, 7, 12, 0, 9]])
    logits = torch.randn(labels.shape[1], 1, 32, generator=generator) * 4
    reference = logits.double().requires_grad_()
    ce, term = reference_lm_loss(labels, reference, vocab, "del", cfg.alpha)
    # the default digit reduction: the term's mean over the 6 digit targets of 8 tokens
    digits = sum(int(t) in vocab.digit_ids for t in labels.flatten())
    expected = ce + cfg.alpha * term * labels.numel() / digits
    (grad_expected,) = torch.autograd.grad(expected.sum(), reference)
    mine = logits.to(device).requires_grad_()
    loss = dm.numerical_lm_loss(labels.to(device), mine, cfg)
    loss.sum().backward()
    torch.testing.assert_close(loss.double().cpu(), expected.detach(), **TOLERANCE)
    torch.testing.assert_close(mine.grad.double().cpu(), grad_expected, **TOLERANCE)
    return [round(x, 4) for x in loss[0].tolist()]


def check_training_imports() -> str:
    """Stage 2, in a process of its own with Megatron-LM's checkout first on the path."""
    import megatron.training  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as checkpointing

    core = Path(sys.modules["megatron.core"].__file__).resolve()
    assert MEGATRON_LM_DIR.resolve() in core.parents, f"megatron.core from {core}, not the checkout"
    nvrx = version("nvidia-resiliency-ext")
    if nvrx != "none":
        assert checkpointing.HAVE_NVRX, f"NVRx {nvrx} is installed but lacks what Megatron uses"
    return f"megatron.training and dist_checkpointing import (NVRx {nvrx})"


def main() -> None:
    if sys.argv[1:] == ["--training"]:
        print(check_training_imports())
        return
    for module in (megatron.core, dm):
        assert installed(module), (
            f"{module.__name__} imported from {module.__file__}, not site-packages"
        )
    site = Path(dm.__file__).parent / "cpu" / "site" / "sitecustomize.py"
    assert site.is_file(), f"the CPU runtime's {site} is not installed"
    losses = del_step("cpu")
    path = os.pathsep.join(filter(None, [str(MEGATRON_LM_DIR), os.environ.get("PYTHONPATH")]))
    training = subprocess.run(
        [sys.executable, __file__, "--training"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert training.returncode == 0, training.stdout + training.stderr
    print(training.stdout.strip().splitlines()[-1])
    gpu = "no CUDA device"
    if torch.cuda.is_available():
        import transformer_engine.pytorch  # noqa: F401

        del_step("cuda")
        gpu = f"DEL on {torch.cuda.get_device_name()} matches the reference"
    print(
        f"del-megatron OK in {os.getcwd()} as uid {os.getuid()}: torch {torch.__version__}, "
        f"megatron-core {megatron.core.__version__}, "
        f"Transformer Engine {version('transformer_engine')}, "
        f"NVRx {version('nvidia-resiliency-ext')}, {gpu}, loss {losses}"
    )


if __name__ == "__main__":
    main()
