"""Megatron-Bridge (0.6) on a machine without CUDA: conversions on a CPU node, and Bridge's own
`pretrain()` / `finetune()` on CPU and gloo (smoke runs of examples/bridge_pretrain_del.py
--cpu, the tests). No Bridge file is edited, and nothing here acts where CUDA is available.

- `without_transformer_engine()`: the one stand-in. Transformer Engine cannot be installed
  without CUDA, and `import megatron.bridge` runs `megatron/bridge/peft/lora_layers.py`, whose
  first line is `import transformer_engine.pytorch as te` (LoRA's fused TE branches). That one
  module runs unmodified with `transformer_engine` resolved to an inert placeholder in its own
  namespace: nothing enters sys.modules, so Megatron-Core still sees no Transformer Engine
  (HAVE_TE False) and every other module imports as on a CPU install. A placeholder raises
  when called (LoRA's TE paths), and isinstance against one is False.
- `activate()`: del_megatron.cpu.training's runtime for Megatron's training code (device="cuda"
  and .cuda() map to CPU, torch.cuda's runtime calls get CPU answers, the CPU RNG tracker),
  plus three answers Bridge's own initialisation (megatron/bridge/training/initialize.py)
  needs, given once that module has been executed:
  - `initialize_megatron(cfg)` asserts CUDA unless allow_no_cuda, which `setup()` never passes;
  - `_set_random_seed` seeds the model-parallel RNG tracker only if torch.cuda.device_count()
    > 0: here the CPU tracker gets the seed Bridge computes (+ 100 x pipeline rank, + 10 x
    data-parallel rank with data_parallel_random_init) and Megatron's tensor/expert offsets;
  - `set_jit_fusion_options` warms fused kernels up on "cuda": nothing to do on CPU.
- `init_single_process()` and `cpu_provider()`: one gloo rank for a conversion, and a model
  provider set for CPU (Megatron-Core's local layers).
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, List

import torch

NEEDS_TRANSFORMER_ENGINE = ("megatron.bridge.peft.lora_layers",)
INITIALIZE_MODULE = "megatron.bridge.training.initialize"
# Modules that bind initialize's functions by name at their import (`from ... import ...`).
BINDS_INITIALIZE = ("megatron.bridge.training.setup",)

_activated: List[bool] = []


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
    """Let `megatron.bridge` import where Transformer Engine is not installed (see above);
    nothing where it is. Call it before `import megatron.bridge`."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _rank(group: Any) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def _patch_initialize(initialize: types.ModuleType) -> None:
    """Bridge's initialize module, once executed: the three CPU answers (see above)."""
    from .training import _model_parallel_seed

    initialize_megatron = initialize.initialize_megatron
    set_random_seed = initialize._set_random_seed

    def initialize_megatron_without_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    def set_random_seed_on_cpu(seed, data_parallel_random_init=False, *args, pg_collection, **kw):
        set_random_seed(seed, data_parallel_random_init, *args, pg_collection=pg_collection, **kw)
        seed += 100 * _rank(pg_collection.pp)
        if data_parallel_random_init:
            seed += 10 * _rank(pg_collection.dp)
        ranks = {
            "tp_rank": _rank(pg_collection.tp),
            "ep_rank": _rank(getattr(pg_collection, "ep", None)),
            "etp_rank": _rank(getattr(pg_collection, "expt_tp", None)),
        }
        _model_parallel_seed(seed, **ranks)

    def no_jit_warm_up(*args, **kwargs) -> None:
        return None

    initialize.initialize_megatron = initialize_megatron_without_cuda
    initialize._set_random_seed = set_random_seed_on_cpu
    initialize.set_jit_fusion_options = no_jit_warm_up
    for name in BINDS_INITIALIZE:  # imported before activate(): rebind their names too
        module = sys.modules.get(name)
        if module is not None:
            module.initialize_megatron = initialize_megatron_without_cuda
            module.set_jit_fusion_options = no_jit_warm_up


def activate() -> None:
    """Run Megatron-Bridge in this process on CPU (see above). Idempotent; nothing when CUDA is
    available. Call it before `import megatron.bridge` (the Transformer Engine placeholder);
    Bridge's initialisation is patched whenever it is imported."""
    if _activated or torch.cuda.is_available():
        return
    _activated.append(True)
    without_transformer_engine()
    from . import core, training

    training.activate()
    core.install()
    if INITIALIZE_MODULE in sys.modules:
        _patch_initialize(sys.modules[INITIALIZE_MODULE])
    else:
        sys.meta_path.insert(0, training._AfterImport({INITIALIZE_MODULE: _patch_initialize}))


def init_single_process(seed: int = 1234) -> None:
    """One gloo rank with Megatron-Core's model-parallel state (TP = PP = 1) and the CPU RNG
    tracker seeded, for a conversion (AutoBridge would start NCCL itself)."""
    import torch.distributed as dist

    from del_megatron.cpu.ports import free_port

    from . import core

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    core.seed(seed)


def cpu_provider(provider: Any) -> Any:
    """A Bridge model provider set for CPU: Megatron-Core's local layers (no Transformer Engine),
    local attention, no fused kernels (Llama's providers ask for TE's fused RoPE and Apex's
    fused bias-activation), fp32 weights made on the CPU. Returns the provider."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.transformer_layer_spec = local_layer_spec
    provider.transformer_impl = "local"
    provider.attention_backend = "local"
    provider.use_cpu_initialization = True
    provider.params_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    provider.apply_rope_fusion = False
    provider.bias_activation_fusion = provider.masked_softmax_fusion = False
    provider.gradient_accumulation_fusion = False
    return provider


def cpu_config(cfg: Any) -> Any:
    """A Bridge ConfigContainer set for CPU: its provider by `cpu_provider`, no dropout, fp32,
    gloo, the plain (not distributed) optimizer, no overlap, no TensorBoard. Returns `cfg`."""
    cpu_provider(cfg.model)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    cfg.mixed_precision = None
    cfg.dist.distributed_backend = "gloo"
    cfg.ddp.use_distributed_optimizer = cfg.optimizer.use_distributed_optimizer = False
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    cfg.optimizer.bf16 = False
    cfg.logger.tensorboard_dir = None
    return cfg


def import_hf(hf_model: str, megatron_path: str) -> None:
    """AutoBridge.import_ckpt's steps on CPU, in this (single gloo) process: the Hugging Face
    model's weights into a Megatron checkpoint of Megatron-Core's local layers."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_model)
    provider = cpu_provider(bridge.to_megatron_provider(load_weights=True))
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    bridge.save_megatron_model(model, megatron_path, hf_tokenizer_path=hf_model)


def export_hf(hf_model: str, megatron_path: str, hf_path: str) -> None:
    """AutoBridge.export_ckpt's steps on CPU: the latest checkpoint of `megatron_path` as a
    Hugging Face model of `hf_model`'s architecture and tokenizer, written to `hf_path`."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_model)
    model = bridge.load_megatron_model(megatron_path, wrap_with_ddp=False)
    bridge.save_hf_pretrained(model, hf_path, show_progress=False)
