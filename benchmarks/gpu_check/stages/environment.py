"""The environment stage: GPU, torch, TE, NCCL, TF32, CUDA_DEVICE_MAX_CONNECTIONS, HBM peak."""

from __future__ import annotations

import os
import platform
from typing import Dict, Optional

import torch

from ..context import Context


def stage_environment(ctx: Context) -> None:
    """One row of figures with no pass mark: versions, the device and its settings."""
    info: Dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_override_env": {
            k: os.environ[k]
            for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")
            if k in os.environ
        },
        "torch_compile_disable": os.environ.get("TORCH_COMPILE_DISABLE"),
    }
    for name in ("megatron.core", "transformer_engine", "del_megatron"):
        info[name] = _version_of(name)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        info.update(capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        nccl = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        info["gpus"] = torch.cuda.device_count()
        info["hbm_peak_tb_s"] = None if ctx.hbm_peak is None else round(ctx.hbm_peak / 1e12, 2)
    else:
        info.update(cpu=platform.processor() or platform.machine(), cpus=os.cpu_count())
    ctx.results.add("environment", "environment", None, **info)


def _version_of(module: str) -> Optional[str]:
    try:
        imported = __import__(module, fromlist=["__version__"])
    except Exception:  # not installed, or broken: reported as absent
        return None
    return str(getattr(imported, "__version__", "?"))
