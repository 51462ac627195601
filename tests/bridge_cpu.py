"""Megatron-Bridge 0.6.2 on a machine without CUDA (test and CPU-smoke support; nothing here
runs where CUDA is available).

`without_transformer_engine()`: the one stand-in. Transformer Engine cannot be installed without
CUDA, and importing `megatron.bridge` at all runs `megatron/bridge/peft/lora_layers.py`, whose
first line is `import transformer_engine.pytorch as te` (LoRA's fused TE branches). That one
module runs unmodified with `transformer_engine` resolved to an inert placeholder in its
namespace only: nothing enters sys.modules, so Megatron-Core still sees no Transformer Engine
(HAVE_TE False) and every other module imports as it would on a CPU install. Every placeholder
raises when called (LoRA's TE paths), and isinstance against one is False.

`activate()`: Bridge's own training loop (`pretrain()`, `finetune()`) on CPU and gloo, on top of
del_megatron's CPU runtime for Megatron's training code (del_megatron.cpu.training: device="cuda"
and .cuda() map to CPU, torch.cuda's runtime calls get CPU answers, the CPU RNG tracker). Bridge
has its own initialisation (megatron/bridge/training/initialize.py), which needs three more
answers, given here without editing a Bridge file:
- `setup()` calls `initialize_megatron(cfg)` without allow_no_cuda, which asserts CUDA;
- `_set_random_seed` seeds the model-parallel RNG tracker only if torch.cuda.device_count() > 0:
  here the CPU tracker gets Megatron's seeds (the seed + 100 x pipeline rank, then Megatron's
  tensor/expert offsets);
- `set_jit_fusion_options` warms fused kernels up on "cuda".
NVIDIA Resiliency Extension is the real package (tests/requirements-nvrx.txt): Bridge imports
its in-process restart and straggler modules, and its only compiled module (CUPTI) is imported
only when straggler detection is on.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import sys

NEEDS_TRANSFORMER_ENGINE = ("megatron.bridge.peft.lora_layers",)


class _Absent(type):
    """A Transformer Engine name: attributes are more placeholders, calls raise."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"Transformer Engine is not installed ({cls.__name__} was called)")


_TE = _Absent("transformer_engine", (), {})


def _import_with_te_placeholder(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] == "transformer_engine":
        return _TE
    return builtins.__import__(name, globals, locals, fromlist, level)


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        module.__builtins__ = {**vars(builtins), "__import__": _import_with_te_placeholder}
        exec(self.real.get_code(module.__name__), vars(module))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in NEEDS_TRANSFORMER_ENGINE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def without_transformer_engine() -> None:
    """Let `megatron.bridge` import on a machine without Transformer Engine (see above)."""
    try:
        import transformer_engine  # noqa: F401

        return  # the real one
    except ImportError:
        pass
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def activate() -> None:
    """Run Bridge's pretrain()/finetune() in this process on CPU (see above). Idempotent; call it
    before Bridge's training modules are imported."""
    import torch

    if torch.cuda.is_available() or _activated:
        return
    _activated.append(True)
    without_transformer_engine()
    from del_megatron.cpu import core, training

    training.activate()
    core.install()
    from megatron.bridge.training import initialize, setup

    initialize_megatron = initialize.initialize_megatron

    def initialize_megatron_without_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    set_random_seed = initialize._set_random_seed

    def set_random_seed_on_cpu(seed, *args, pg_collection, **kwargs):
        set_random_seed(seed, *args, pg_collection=pg_collection, **kwargs)
        rank = torch.distributed.get_rank()
        pipeline_rank = torch.distributed.get_group_rank(pg_collection.pp, rank)
        training._model_parallel_seed(seed + 100 * pipeline_rank)

    setup.initialize_megatron = initialize_megatron_without_cuda
    setup.set_jit_fusion_options = lambda *args, **kwargs: None
    initialize._set_random_seed = set_random_seed_on_cpu


_activated: list = []


def init_single_process(seed: int = 1234) -> None:
    """One gloo rank with Megatron-Core's model-parallel state (TP = PP = 1) and the CPU RNG
    tracker seeded, for the conversions (AutoBridge would start NCCL itself)."""
    import os

    import torch.distributed as dist

    from del_megatron import cpu
    from del_megatron.ports import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    cpu.seed(seed)


def on_cpu(provider):
    """A Bridge model provider set for CPU: Megatron-Core's local layers (no Transformer Engine),
    local attention, fp32 weights made on the CPU. Returns the provider."""
    import torch
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.transformer_layer_spec = local_layer_spec
    provider.transformer_impl = "local"
    provider.attention_backend = "local"
    provider.use_cpu_initialization = True
    provider.params_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    return provider
