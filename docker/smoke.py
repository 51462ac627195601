"""Smoke test of the image (its last build step; tests/image/run.sh runs it again in a container).

Run from the working directory users run in: everything imports from the installed packages (not
from a source checkout that the working directory would put first on the import path), the
compiled dataset helpers load, the CPU runtime's site folder exists, and DEL runs forward and
backward on a small tensor.
"""

import os
import sysconfig
from pathlib import Path

import megatron.core
import torch
from megatron.core.datasets import helpers_cpp  # noqa: F401  (compiled; Megatron's datasets need it)

import del_megatron as dm
import del_megatron.megatron  # noqa: F401  (the Megatron glue imports)


def installed(module) -> bool:
    path = Path(module.__file__).resolve()
    roots = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    return any(root in path.parents for root in roots)


for module in (megatron.core, dm):
    assert installed(module), (
        f"{module.__name__} imported from {module.__file__}, not site-packages"
    )

site = Path(dm.__file__).parent / "cpu" / "site" / "sitecustomize.py"
assert site.is_file(), f"the CPU runtime's {site} is not installed"

vocab = dm.DigitVocab(range(10), [10])
labels = torch.tensor([[1, 10, 5, 3]])
logits = torch.randn(4, 1, 32, requires_grad=True)
cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=vocab)
loss = dm.numerical_lm_loss(labels, logits, cfg)
loss.sum().backward()
assert torch.isfinite(loss).all() and logits.grad is not None
print(
    f"del-megatron OK in {os.getcwd()} as uid {os.getuid()}: torch {torch.__version__}, "
    f"megatron-core {megatron.core.__version__}, loss {[round(x, 4) for x in loss[0].tolist()]}"
)
