"""A map-style dataset of number-rich token rows for NeMo AutoModel's recipe in
tests/test_automodel.py (named by `_target_` in its YAML); two launchers over
del_megatron.cpu.automodel: one makes the recipe think the model's forward takes no
logits_to_keep (the case where AutoModel swaps a custom loss for MaskedCrossEntropy), one prints
each parameter's whole gradient norm at the first step; and one that prints the gradient
AutoModel's fp32 RMSNorm passes to an all-reduced input."""

from __future__ import annotations

import sys
from typing import Dict, List

import torch

DIGIT_IDS = list(range(3, 13))  # '0'..'9'; 13 is '.'
VOCAB = 128


class DigitRows(torch.utils.data.Dataset):
    """num_samples rows of seq_len + 1 tokens drawn from ids 0..23 (about 40 % digits, so
    numbers of several digits), fixed by seed: input_ids the first seq_len, labels the last."""

    def __init__(self, num_samples: int = 64, seq_len: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, 24, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        row = self.rows[index]
        return {"input_ids": row[:-1].tolist(), "labels": row[1:].tolist()}


def main_without_logits_to_keep() -> None:
    """del_megatron.cpu.automodel's main, with AutoModel told that no model takes logits_to_keep."""
    import nemo_automodel.recipes.llm.train_ft as train_ft

    from del_megatron.cpu.automodel import main

    train_ft._supports_logits_to_keep = lambda model: False
    sys.exit(main())


def main_printing_gradient_norms() -> None:
    """del_megatron.cpu.automodel's main; at the first step rank 0 prints `GRAD name norm` for
    every parameter (its whole gradient, gathered from its DTensor shards)."""
    import nemo_automodel.recipes.llm.train_ft as train_ft
    from torch.distributed.tensor import DTensor

    from del_megatron.cpu.automodel import main

    clip, steps = train_ft.scale_grads_and_clip_grad_norm, []

    def printing(max_grad_norm, model_parts, **kwargs):
        if not steps:
            for name, param in model_parts[0].named_parameters():
                grad = param.grad
                whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
                if torch.distributed.get_rank() == 0:
                    print(f"GRAD {name} {float(whole.double().norm())!r}", flush=True)
        steps.append(1)
        return clip(max_grad_norm, model_parts, **kwargs)

    train_ft.scale_grads_and_clip_grad_norm = printing
    sys.exit(main())


def main_rms_norm_input_gradients() -> None:
    """Under torchrun (2 processes, gloo): rank 0 prints `RMSNORM <norm> <input> <grad norm or
    None>`, the gradient that reaches an RMSNorm's input [2, 4, 8], for AutoModel's
    Float32RMSNorm and torch's nn.RMSNorm, the input a plain tensor (2x) or the all-reduce of x
    over the 2 ranks (an AsyncCollectiveTensor, as a TP embedding's output)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from nemo_automodel.components.models.common.utils import Float32RMSNorm

    dist.init_process_group("gloo")
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    norms = {
        "Float32RMSNorm": Float32RMSNorm(8, dtype=torch.float32),
        "nn.RMSNorm": torch.nn.RMSNorm(8, eps=1e-5),
    }
    for name, norm in norms.items():
        for kind in ("plain", "all-reduced"):
            y = x * 2 if kind == "plain" else funcol.all_reduce(x, "sum", dist.group.WORLD)
            y.requires_grad_()
            (grad,) = torch.autograd.grad(norm(y).sum(), y, allow_unused=True)
            if dist.get_rank() == 0:
                print(f"RMSNORM {name} {kind} {None if grad is None else float(grad.norm())!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    {
        "swap": main_without_logits_to_keep,
        "grads": main_printing_gradient_norms,
        "rms_norm": main_rms_norm_input_gradients,
    }[sys.argv.pop(1)]()
