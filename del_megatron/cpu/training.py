"""Megatron-LM's own `pretrain()` loop on CPU: gloo, CPU tensors, exact resume.

`activate()` runs at start-up of every Python process of a CPU job (see site/sitecustomize.py).
It changes torch at once (device="cuda" -> CPU, torch.cuda runtime calls -> no-ops) and
Megatron-LM when its `megatron.training.training` module has been imported, wherever that
package comes from (a Megatron-LM checkout or a megatron-core >= 0.17 wheel). No Megatron-LM
file is edited. Places that needed help, by what Megatron-LM does there:

- `initialize.py` imports batch_invariant_kernels, which imports triton (absent on CPU builds);
- `initialize_megatron` asserts CUDA unless allow_no_cuda, which `pretrain()` never passes,
  and builds the model-parallel groups and seeds the model-parallel RNG only if
  `torch.cuda.device_count() > 0`;
- `validate_args` reads the GPU architecture when TP > 1, and wants
  CUDA_DEVICE_MAX_CONNECTIONS=1;
- `compile_helpers()` runs `make` on the dataset helpers (the installed megatron-core wheel's
  compiled helpers_cpp is loaded instead); `fused_kernels.load` runs nvcc (core <= 0.16);
- `set_jit_fusion_options` warms up fused kernels on "cuda";
- tensors made on device="cuda", `.cuda()`, `Tensor.type() == "torch.cuda.FloatTensor"` checks
  (clip_grads, optimizer), and torch.cuda RNG/memory/stream calls in timers, checkpointing and
  the rerun state machine;
- after torchrun restarts the workers, a gloo rank can read the killed round's addresses from
  the agent's rendezvous store (rendezvous.py: one key space per restart attempt);
- on CPU the default generator drives dropout, and building the data iterators after a
  checkpoint load draws from it; its state is kept across that call, so a resumed run's
  dropout masks equal the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.util
import os
import site
import sys
import sysconfig
import types
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import core, rendezvous
from .quick_exit import skip_final_collections

ENV_SWITCH = "DEL_MEGATRON_CPU"
TRAINING_MODULE = "megatron.training.training"
JIT_MODULE = "megatron.core.jit"
BATCH_INVARIANT_MODULE = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

_activated: List[bool] = []


def _names_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index names a CUDA device
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except (RuntimeError, ValueError):
            return False
    return False


class CudaOnCpu(TorchFunctionMode):
    """device="cuda" -> CPU for factories and `.to`; `.cuda()` / `.pin_memory()` return the
    tensor; `Tensor.type()` names the CUDA type, which Megatron compares against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if isinstance(result, str) and ".cuda." not in result:
                result = result.replace("torch.", "torch.cuda.", 1)
        return result


class _NoStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> None:
        return None


def _returning(value_factory: Callable[[], object]) -> Callable:
    """A new function object for each torch.cuda name (torch.compile's rules reject one
    function registered under two names)."""

    def stand_in(*args, **kwargs):
        return value_factory()

    return stand_in


def _nothing(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


CUDA_RUNTIME_ON_CPU = {
    **{
        name: _returning(lambda: None)
        for name in (
            "synchronize",
            "empty_cache",
            "set_device",
            "set_stream",
            "manual_seed",
            "manual_seed_all",
            "set_rng_state",
            "reset_peak_memory_stats",
            "reset_max_memory_allocated",
        )
    },
    **{
        name: _returning(lambda: 0)
        for name in (
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
        )
    },
    "memory_stats": _returning(dict),
    "get_rng_state": _returning(lambda: torch.zeros(0, dtype=torch.uint8)),
    "Stream": _NoStream,
    "current_stream": _returning(_NoStream),
    "default_stream": _returning(_NoStream),
    "stream": _returning(contextlib.nullcontext),
}


class _OneCudaDevice(types.ModuleType):
    """`torch.cuda` as megatron/training/initialize.py must see it: one (CPU) device."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchWithOneDevice(types.ModuleType):
    cuda = _OneCudaDevice("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callbacks[name](module)` once the module `name` has been executed (once)."""

    def __init__(self, callbacks: Dict[str, Callable[[types.ModuleType], None]]) -> None:
        self.callbacks = dict(callbacks)

    def find_spec(self, fullname, path, target=None):
        callback = self.callbacks.pop(fullname, None)
        if callback is None:
            return None
        sys.meta_path.remove(self)  # find the module's own spec
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.callbacks:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            callback(module)

        spec.loader.exec_module = exec_module
        return spec


def _stub_batch_invariant_kernels() -> None:
    if importlib.util.find_spec("triton") is not None or BATCH_INVARIANT_MODULE in sys.modules:
        return
    stub = types.ModuleType(BATCH_INVARIANT_MODULE)

    def needs_triton(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton, which this machine lacks")

    stub.enable_batch_invariant_mode = stub.set_batch_invariant_mode = needs_triton
    stub.disable_batch_invariant_mode = _nothing
    stub.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[BATCH_INVARIANT_MODULE] = stub


def _model_parallel_seed(
    seed: int,
    *args,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    **kwargs,
) -> None:
    """tensor_parallel.model_parallel_cuda_manual_seed on the CPU RNG tracker, with Megatron's
    seed offsets (the data-parallel, model-parallel and expert-parallel states). The ranks
    default to parallel_state's, as Megatron's do."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random

    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def _site_dirs() -> List[str]:
    """Where installed packages live, in search order: this environment's site-packages, then
    every sys.path entry (a layered environment adds its base's site-packages there, through a
    .pth file or PYTHONPATH). Each folder once."""
    paths = sysconfig.get_paths()
    found = [paths["purelib"], paths["platlib"], *site.getsitepackages(), *sys.path]
    dirs: List[str] = []
    for folder in found:
        folder = os.path.abspath(folder or os.curdir)
        if folder not in dirs and os.path.isdir(folder):
            dirs.append(folder)
    return dirs


def _load_wheel_helpers() -> None:
    """The dataset index helpers, compiled, from the installed megatron-core wheel (the same
    helpers.cpp as the Megatron-LM release), when the imported `megatron` has none."""
    name = "megatron.core.datasets.helpers_cpp"
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    searched = _site_dirs()
    for site_dir in searched:
        found = glob.glob(os.path.join(site_dir, "megatron", "core", "datasets", "helpers_cpp*"))
        found = [f for f in found if f.endswith(suffix)]
        if found:
            spec = importlib.util.spec_from_file_location(name, found[0])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            return
    raise ImportError(
        f"{name}: no compiled dataset helpers in the imported megatron nor in an installed "
        f"megatron-core wheel (searched {', '.join(searched)}); pip install megatron-core"
    )


def _eager_fusions(jit: types.ModuleType) -> None:
    """Megatron's fused element-wise functions (jit_fuser = torch.compile) run eagerly: on CPU,
    compiling them takes seconds of a C++ build at the first step, for no gain at test sizes.
    Runs before the modules that decorate with jit_fuser are imported."""
    jit.disable_jit_fuser()


def _patch_megatron_lm(training: types.ModuleType) -> None:
    """Megatron-LM's training package, once megatron.training.training has been executed."""
    from megatron.core import tensor_parallel
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.training import arguments, initialize
    from megatron.training import utils as training_utils

    core.install()
    rendezvous.install()

    initialize_megatron = initialize.initialize_megatron

    def initialize_megatron_without_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron_without_cuda
    training.initialize_megatron = initialize_megatron_without_cuda
    initialize.torch = _TorchWithOneDevice("torch")
    tensor_parallel.model_parallel_cuda_manual_seed = _model_parallel_seed
    tp_random.model_parallel_cuda_manual_seed = _model_parallel_seed
    if hasattr(initialize, "model_parallel_cuda_manual_seed"):
        initialize.model_parallel_cuda_manual_seed = _model_parallel_seed

    arguments.get_device_arch_version = training_utils.get_device_arch_version = _zero
    training.set_jit_fusion_options = _nothing

    _load_wheel_helpers()
    dataset_utils.compile_helpers = _nothing
    try:  # core <= 0.16 only
        importlib.import_module("megatron.legacy.fused_kernels").load = _nothing
    except ImportError:
        pass

    build_iterators = training.build_train_valid_test_data_iterators

    def build_iterators_keeping_rng(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build_iterators(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    training.build_train_valid_test_data_iterators = build_iterators_keeping_rng


def activate() -> None:
    """Make this process run Megatron-LM on CPU. Idempotent; nothing when CUDA is available."""
    if _activated or torch.cuda.is_available():
        return
    _activated.append(True)
    skip_final_collections()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _stub_batch_invariant_kernels()
    CudaOnCpu().__enter__()  # thread-local: the main thread, where Megatron-LM trains
    for name, replacement in CUDA_RUNTIME_ON_CPU.items():
        setattr(torch.cuda, name, replacement)
    after_import = {JIT_MODULE: _eager_fusions, TRAINING_MODULE: _patch_megatron_lm}
    for name, callback in list(after_import.items()):
        if name in sys.modules:
            callback(sys.modules[name])
            del after_import[name]
    if after_import:
        sys.meta_path.insert(0, _AfterImport(after_import))


@contextlib.contextmanager
def torch_cuda_on_cpu() -> Iterator[None]:
    """What activate() changes in torch (device="cuda" -> CPU, torch.cuda's runtime calls ->
    no-ops), for the duration of the block only and on this thread: Megatron-Core's optimizers
    and DDP buckets (scalars made on "cuda", streams) in a process that runs other work too
    (the test workers). Nothing when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch.cuda, name) for name in CUDA_RUNTIME_ON_CPU}
    for name, replacement in CUDA_RUNTIME_ON_CPU.items():
        setattr(torch.cuda, name, replacement)
    try:
        with CudaOnCpu():
            yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


def site_dir() -> str:
    """The folder to put on PYTHONPATH (with DEL_MEGATRON_CPU=1) for a CPU job."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def job_environment(base: Dict[str, str]) -> Dict[str, str]:
    """`base` (an environment) with what every process of a CPU job needs: DEL_MEGATRON_CPU=1,
    site_dir() first on PYTHONPATH, one OpenMP thread a process."""
    env = dict(base)
    path = os.pathsep.join(p for p in (site_dir(), env.get("PYTHONPATH")) if p)
    env.update({ENV_SWITCH: "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
    return env
