"""Megatron on a CUDA-less machine (CPU tensors, gloo), kept apart from the loss.

- `core`: what Megatron-Core models need (tests, the demo): `install()`, `seed()`,
  `sync_sequence_parallel_grads()`.
- `bridge` and `automodel`: Megatron-Bridge's and NeMo AutoModel's runtimes on CPU (compare-qa,
  their tests); `rendezvous`: torchrun's rendezvous on loopback; `ports`: a free port for it;
  `quick_exit`: a quicker end for a CPU job's processes.
- `training`: what Megatron-LM's own `pretrain()` loop needs on top (the e2e tests, `DEL_CPU=1`
  in Docker). It is switched on per process by `site/sitecustomize.py` when
  `DEL_MEGATRON_CPU=1` and `python -m del_megatron.cpu --site-dir` is on PYTHONPATH, so the
  processes Megatron spawns get it too.

Registering a loss never imports this package; nothing here runs when CUDA is available.
"""

from .core import CpuRNGStatesTracker, install, seed, sync_sequence_parallel_grads

__all__ = ["CpuRNGStatesTracker", "install", "seed", "sync_sequence_parallel_grads"]
