"""The cuda_graph stage: one capture of a forward + backward, replayed against the eager step."""

from __future__ import annotations

import torch

import del_megatron as dm

from ..context import Context
from ..fixtures import make_labels, make_logits, rel_error, rel_error_on_device
from ..sizes import ALPHA, VOCAB


def stage_cuda_graph(ctx: Context) -> None:
    """One capture of numerical_lm_loss forward + backward (the compiled kernel) into a CUDA
    graph, replayed once and compared with the eager step."""
    if not ctx.cuda:
        ctx.results.add("cuda_graph", "capture forward + backward", None, skipped="needs CUDA")
        return
    tokens, vocab = 4096, ctx.sizes.speed_cases[0][1]
    cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)
    labels = make_labels(tokens, vocab, ctx.device, seed=3)
    logits = make_logits(tokens, vocab, torch.bfloat16, ctx.device, seed=3).requires_grad_(True)

    def step():
        loss = dm.numerical_lm_loss(labels, logits, cfg)
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        return loss, grad

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            want = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            got = step()
        graph.replay()
        torch.cuda.synchronize()
        error = max(rel_error(got[0], want[0]), rel_error_on_device(got[1], want[1]))
        ctx.results.add(
            "cuda_graph", "capture forward + backward", error < 1e-6, replay_error=error
        )
    except Exception as exc:  # the capture's failure is the finding
        ctx.results.add(
            "cuda_graph",
            "capture forward + backward",
            False,
            error=f"{type(exc).__name__}: {exc}"[:500],
        )
