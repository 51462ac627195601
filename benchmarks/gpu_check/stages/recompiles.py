"""The recompiles stage: the graphs Dynamo adds for the compiled kernel over several N."""

from __future__ import annotations

import torch

import del_megatron as dm

from ..context import Context
from ..fixtures import make_labels, make_logits
from ..sizes import ALPHA, VOCAB


def stage_recompiles(ctx: Context) -> None:
    """Graphs Dynamo holds after compiled-kernel calls (bf16) at several N, with and without
    grad: a call may add graphs only where it is the first of its grad mode (a guard) or has
    N = 1 (which Dynamo specialises); other N reuse the dynamic-shape graphs."""
    from torch._dynamo.utils import counters

    vocab = ctx.sizes.speed_cases[0][1]
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    sizes = ctx.sizes.recompile_tokens
    calls = [(n, True) for n in sizes] + [(n, False) for n in sizes if n != 1][:2]
    seen, before = [], counters["stats"]["unique_graphs"]
    for tokens, grad in calls:
        labels = make_labels(tokens, vocab, ctx.device, seed=tokens)
        logits = make_logits(tokens, vocab, torch.bfloat16, ctx.device).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss = dm.numerical_lm_loss(labels, logits, cfg, kernel="compiled")
            if grad:
                torch.autograd.grad(loss.sum(), logits)
        now = counters["stats"]["unique_graphs"]
        seen.append({"tokens": tokens, "grad": grad, "new_graphs": now - before})
        before = now
    modes = set()
    unexpected = []
    for call in seen:
        first_of_mode = call["grad"] not in modes
        modes.add(call["grad"])
        if call["new_graphs"] and not first_of_mode and call["tokens"] != 1:
            unexpected.append(call)
    ctx.results.add(
        "recompiles",
        "compiled kernel over several N",
        not unexpected,
        calls=seen,
        new_graphs_per_call=[c["new_graphs"] for c in seen],
        unexpected=unexpected,
    )
