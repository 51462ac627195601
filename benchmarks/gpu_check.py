"""Correctness of every kernel on a CUDA device against the CPU float64 reference.

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json

Checks numerical_lm_loss (kernels "auto" = compiled, "recompute", "softmax"; bf16 and fp32;
every loss) and numerical_linear_loss against del_megatron.reference on the CPU, values and
logits gradients, and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import del_megatron as dm  # noqa: E402
from del_megatron.loss import LOSSES  # noqa: E402
from del_megatron.reference import reference_lm_loss  # noqa: E402
from tests.cases import IGNORE, PADDED_VOCAB_SIZE, SPLIT_VOCAB, number_rich_labels  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def _reference(labels, logits, loss, alpha):
    leaf = logits.detach().cpu().double().requires_grad_(True)
    ce, term = reference_lm_loss(labels.cpu(), leaf, SPLIT_VOCAB, loss=loss, ignore_index=IGNORE)
    total = ce + alpha * term
    (grad,) = torch.autograd.grad(total.sum(), leaf)
    return total.detach(), grad


def _error(actual, expected) -> float:
    scale = expected.abs().max().clamp(min=1e-12)
    return ((actual.double().cpu() - expected).abs().max() / scale).item()


def check_kernels(device, results):
    labels = number_rich_labels(4, 257, 0).to(device)
    gen = torch.Generator().manual_seed(0)
    full = 3 * torch.randn(257, 4, PADDED_VOCAB_SIZE, generator=gen)
    for kernel in ("auto", "recompute", "softmax"):
        for dtype in (torch.float32, torch.bfloat16):
            for loss in LOSSES:
                logits = full.to(dtype).to(device).requires_grad_(True)
                cfg = dm.NumericalLossConfig(
                    loss=loss, alpha=0.7, vocab=SPLIT_VOCAB, ignore_index=IGNORE
                )
                total = dm.numerical_lm_loss(labels, logits, cfg, kernel=kernel)
                total.sum().backward()
                ref_total, ref_grad = _reference(labels, logits.detach().float(), loss, 0.7)
                row = {
                    "check": "numerical_lm_loss",
                    "kernel": kernel,
                    "dtype": str(dtype),
                    "loss": loss,
                    "value_error": _error(total.detach(), ref_total),
                    "grad_error": _error(logits.grad, ref_grad),
                }
                row["ok"] = max(row["value_error"], row["grad_error"]) < TOLERANCE[dtype]
                results.append(row)


def check_linear(device, results):
    """numerical_linear_loss on both weight-gradient routes, with and without a loss mask (with
    one, the gradients are formed in forward, as --del-logits-free runs), against the fp64
    reference on the CPU."""
    labels = number_rich_labels(4, 129, 1).to(device)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(129, 4, 32, generator=gen)
    weight = torch.randn(PADDED_VOCAB_SIZE, 32, generator=gen) / 4
    mask = (torch.rand(4, 129, generator=gen) > 0.25).float()
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.7, vocab=SPLIT_VOCAB, ignore_index=IGNORE)
    cases = itertools.product((torch.float32, torch.bfloat16), ("forward", "backward"), (0, 1))
    for dtype, route, masked in cases:
        h = hidden.to(device, dtype, copy=True).requires_grad_(True)
        w = weight.to(device, dtype, copy=True).requires_grad_(True)
        loss_mask = mask.to(device) if masked else None
        total = dm.numerical_linear_loss(
            h, w, labels, cfg, chunk_tokens=100, loss_mask=loss_mask, weight_gradient=route
        )
        (total * mask.to(device)).sum().backward()
        h64 = hidden.to(dtype).double().requires_grad_(True)
        w64 = weight.to(dtype).double().requires_grad_(True)
        ce, term = reference_lm_loss(labels.cpu(), h64 @ w64.t(), SPLIT_VOCAB, ignore_index=IGNORE)
        ((ce + 0.7 * term) * mask).sum().backward()
        row = {
            "check": "numerical_linear_loss",
            "dtype": str(dtype),
            "weight_gradient": route,
            "loss_mask": bool(masked),
            "value_error": _error(total.detach(), (ce + 0.7 * term).detach()),
            "grad_error": max(_error(h.grad, h64.grad), _error(w.grad, w64.grad)),
        }
        row["ok"] = max(row["value_error"], row["grad_error"]) < 3 * TOLERANCE[dtype]
        results.append(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/gpu_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = []
    check_kernels(device, results)
    check_linear(device, results)
    for row in results:
        print(json.dumps(row))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed; wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
