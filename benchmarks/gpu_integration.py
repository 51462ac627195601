"""Megatron-LM training through del_megatron's drop-in, with the output layer's weight gradient
of iteration 1 saved (gpu_check.py's integration stage).

    torchrun --nproc-per-node 1 benchmarks/gpu_integration.py OUT.pt \
        examples/pretrain_gpt_del.py <pretrain_gpt.py flags>

After the first train_step returns, rank 0 saves output_layer.weight's main_grad (the
gradient buffer Megatron's DDP and optimizer use; .grad where there is none) as fp32 on the
CPU to OUT.pt. Run from a Megatron-LM checkout (or with MEGATRON_LM_DIR set), as the drop-in.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys

import torch


def _output_weight(model):
    """output_layer.weight of the first model chunk (DDP and Float16Module wrapped)."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    for name, param in chunk.named_parameters():
        if name.endswith("output_layer.weight") and "mtp" not in name:
            return param
    raise RuntimeError("no output_layer.weight in the model (tied embeddings?)")


def install(out_path: str) -> None:
    """Wrap megatron.training.training.train_step to save the gradient after its first call."""
    from megatron.training import training

    original = training.train_step
    signature = inspect.signature(original)
    saved = []

    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        if not saved:
            saved.append(True)
            model = signature.bind(*args, **kwargs).arguments["model"]
            weight = _output_weight(model)
            grad = getattr(weight, "main_grad", None)
            grad = weight.grad if grad is None else grad
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank == 0:
                torch.save(grad.detach().float().cpu(), out_path)
        return result

    training.train_step = train_step


def main() -> None:
    out_path, script = sys.argv[1], sys.argv[2]
    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, os.environ.get("MEGATRON_LM_DIR", os.getcwd()))
    install(out_path)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
