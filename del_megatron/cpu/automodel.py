"""NeMo AutoModel's LLM recipe without CUDA: the CPU runtime's part for AutoModel 0.7.0.

The recipe calls three CUDA functions whatever the device (train_ft.py's setup and
log_train_metrics reset CUDA's peak-memory counter; _transformers/auto_model.py and train_ft.py
place the model on `torch.device("cuda", torch.cuda.current_device())`). On a machine without
CUDA, `install()` gives those two modules a `torch` in which CUDA's current device is the CPU
and the counter reset does nothing; nothing else changes, and with CUDA present it does
nothing. The rest of a run (gloo, FSDP2, DTensor tensor parallelism, checkpoints) is
AutoModel's own.

    torchrun --nproc-per-node 2 -m del_megatron.cpu.automodel CONFIG.yaml [--a.b=value ...]

runs AutoModel's command line (nemo_automodel.cli.app) with the mapping installed; set
`dist_env.backend: gloo` in the YAML.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, List, Optional

import torch

MODULES = ("nemo_automodel._transformers.auto_model", "nemo_automodel.recipes.llm.train_ft")


class _CpuCuda(types.ModuleType):
    """torch.cuda, but its current device is the CPU and its peak-memory reset a no-op."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def reset_peak_memory_stats(*_: Any, **__: Any) -> None:
        return None


class _CpuTorch(types.ModuleType):
    """torch, with _CpuCuda as cuda and a "cuda" device made on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def device(kind: Any, *args: Any, **kwargs: Any) -> torch.device:
        if isinstance(kind, str) and kind.startswith("cuda"):
            return torch.device("cpu")
        if isinstance(kind, torch.device):
            return torch.device("cpu") if kind.type == "cuda" else kind
        return torch.device(kind, *args, **kwargs)


def install() -> None:
    """Map the recipe's CUDA calls to the CPU (a no-op where CUDA is available)."""
    if torch.cuda.is_available():
        return
    for name in MODULES:
        importlib.import_module(name).torch = _CpuTorch()


def main(argv: Optional[List[str]] = None) -> Any:
    """AutoModel's command line (`automodel CONFIG.yaml ...`) with install() first."""
    install()
    from nemo_automodel.cli.app import main as automodel_main

    sys.argv = ["automodel", *(sys.argv[1:] if argv is None else argv)]
    return automodel_main()


if __name__ == "__main__":
    sys.exit(main())
