"""What the stages share: device, sizes, results, Megatron's parallel state, the HBM peak."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from .results import Results
from .sizes import Sizes

# HBM peak bytes/s by device name (the first name part that matches), where the device
# properties do not give the memory clock.
HBM_PEAK = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100": 3.35e12, "H800": 3.35e12}
HBM_PEAK.update({"GH200": 4.0e12, "B200": 8.0e12, "B100": 8.0e12, "A100": 2.0e12})


class Context:
    """What the stages share: device, sizes, results, the world-1 process group with Megatron's
    parallel state, and the numbers the environment stage found (HBM peak, TF32 override)."""

    def __init__(self, device: torch.device, sizes: Sizes, results: Results, out: Path):
        self.device, self.sizes, self.results, self.out = device, sizes, results, out
        self.cuda = device.type == "cuda"
        self.hbm_peak = hbm_peak(torch.cuda.get_device_properties(device)) if self.cuda else None
        self.tf32_forced = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
        self.group = None

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def hbm_peak(props) -> Optional[float]:
    """Peak HBM bytes/s: from the memory clock and bus width where torch reports them (double
    data rate), else by device name."""
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8
    for name, peak in HBM_PEAK.items():
        if name in props.name:
            return peak
    return None


def init_megatron(ctx: Context) -> None:
    """A process group of one rank and Megatron's parallel state at TP 1 (Megatron's CE reads
    its group there)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from del_megatron.cpu.ports import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if ctx.cuda else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    ctx.group = parallel_state.get_tensor_model_parallel_group()
