"""The syncs stage: host syncs of one forward + backward of each loss path."""

from __future__ import annotations

import warnings

import torch

import del_megatron as dm
from benchmarks.host_syncs import HostSyncs

from ..context import Context
from ..fixtures import make_labels, make_logits
from ..sizes import ALPHA, TOKEN_DIGIT_SHARE, VOCAB


def _sync_cases(ctx: Context):
    """(name, fn) of one forward + backward each: the materialised kernels, THD, the "digit"
    reduction, and the logits-free path on both routes."""
    tokens, vocab = ctx.sizes.speed_cases[0]
    labels = make_labels(tokens, vocab, ctx.device, seed=9)
    logits = make_logits(tokens, vocab, torch.bfloat16, ctx.device, seed=9)
    cu = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32, device=ctx.device)
    h = ctx.sizes.linear_hidden
    gen = torch.Generator(device=ctx.device).manual_seed(9)
    hidden = torch.randn(tokens, 1, h, generator=gen, device=ctx.device).to(torch.bfloat16)
    weight = (torch.randn(vocab, h, generator=gen, device=ctx.device) / h**0.5).to(torch.bfloat16)
    mask = torch.ones(labels.shape, device=ctx.device)

    def lm(kernel, reduction="token", cu_seqlens=None):
        share = TOKEN_DIGIT_SHARE if reduction == "token" else None
        cfg = dm.NumericalLossConfig(
            loss="del", alpha=ALPHA, vocab=VOCAB, reduction=reduction, digit_share=share
        )

        def run():
            leaf = logits.detach().requires_grad_(True)
            loss = dm.numerical_lm_loss(
                labels, leaf, cfg, dm.VocabParallelLayout(cu_seqlens=cu_seqlens), kernel=kernel
            )
            torch.autograd.grad(loss.sum(), leaf)

        return run

    def linear(route):
        cfg = dm.NumericalLossConfig(loss="del", alpha=ALPHA, vocab=VOCAB)

        def run():
            hh, ww = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            loss = dm.numerical_linear_loss(
                hh, ww, labels, cfg, loss_mask=mask, weight_gradient=route
            )
            torch.autograd.grad((loss * mask).sum(), (hh, ww))

        return run

    return [
        ("numerical_lm_loss auto", lm("auto")),
        ("numerical_lm_loss recompute", lm("recompute")),
        ("numerical_lm_loss auto, digit reduction", lm("auto", "digit")),
        ("numerical_lm_loss auto, THD", lm("auto", cu_seqlens=cu)),
        ("numerical_linear_loss forward route", linear("forward")),
        ("numerical_linear_loss backward route", linear("backward")),
    ]


def stage_syncs(ctx: Context) -> None:
    """One forward + backward of each case after a warm-up: on CUDA the syncs CUDA itself
    reports (torch.cuda.set_sync_debug_mode), on every device the causes HostSyncs finds."""
    for name, run in _sync_cases(ctx):
        run()
        ctx.synchronize()
        cuda_syncs = None
        if ctx.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            cuda_syncs = [
                str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)
            ]
        with HostSyncs() as syncs:
            run()
        count = len(syncs.events) + (len(cuda_syncs) if cuda_syncs else 0)
        ctx.results.add(
            "syncs",
            name,
            count == 0,
            cuda_reported=None if cuda_syncs is None else len(cuda_syncs),
            causes=len(syncs.events),
            where=sorted({str(e) for e in syncs.events}),
            cuda_messages=sorted(set(cuda_syncs or [])),
        )
    ctx.free()
