"""Megatron-Core on CPU (gloo): the model-level shim, for tests, the demo and CI.

Megatron-Core assumes CUDA in a few places that a CPU run reaches: `torch.cuda.current_device()`
(RoPE, attention scratch buffers), the model-parallel RNG tracker (CUDA generator states), the
default causal mask and the pipeline schedules' token counters (built on "cuda"), and the torch
LayerNorm wrapper, which refuses sequence parallelism. install() patches exactly these, and
only when CUDA is absent.
"""

from __future__ import annotations

import contextlib
import types

import torch

_installed = {"done": False}
MODEL_PARALLEL_RNG = "model-parallel-rng"


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker API on CPU generator states."""

    def __init__(self) -> None:
        self.states_: dict = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} / seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _torch_norm_allowing_sequence_parallel(cls, config, hidden_size, eps=1e-5, **_unused):
    norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    norm = norm_cls(hidden_size, eps=eps)
    if config.sequence_parallel:
        # Megatron all-reduces the grads of such params over TP (finalize_model_grads).
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


class _TorchOnCpu(types.ModuleType):
    """`torch` for modules that allocate with device="cuda" literally (the pipeline schedules)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install() -> None:
    """Patch Megatron-Core for CPU. Idempotent; does nothing when CUDA is available."""
    if _installed["done"] or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import torch_norm, utils

    torch.cuda.current_device = lambda: "cpu"
    tracker = CpuRNGStatesTracker()
    tp_random._CUDA_RNG_STATE_TRACKER = tracker
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_random.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    utils.get_default_causal_mask = causal_mask
    if hasattr(fused_softmax, "get_default_causal_mask"):
        fused_softmax.get_default_causal_mask = causal_mask
    torch_norm.WrappedTorchNorm.__new__ = _torch_norm_allowing_sequence_parallel
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu("torch")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _installed["done"] = True


def seed(value: int) -> None:
    """Megatron's model_parallel_cuda_manual_seed, on CPU: the default generator gets `value`
    (identical weights at every TP size with use_cpu_initialization) and the model-parallel
    tracker a TP-rank-dependent seed, as Megatron does."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    install()
    torch.manual_seed(value)
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, value + 2718 + parallel_state.get_tensor_model_parallel_rank())


def sync_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """All-reduce over TP the grads of params marked sequence_parallel (Megatron's
    finalize_model_grads does this; a plain torch optimizer loop must too)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=group)
