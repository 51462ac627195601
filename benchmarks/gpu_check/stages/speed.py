"""The speed stage, which writes the memory stage's rows too: forward and backward time, bytes/s
and peak memory of each implementation against Megatron's CE, its fused CE and TE's."""

from __future__ import annotations

import ctypes
import statistics

from benchmarks import bench_loss

from ..context import Context

SPEED_IMPLS = (
    "megatron_ce", "megatron_fused", "te_ce", "del", "del_recompute", "del_softmax",
    "del_compiled", "ce",
)  # fmt: skip
REFERENCES = ("megatron_ce", "megatron_fused", "te_ce")


def stage_speed_and_memory(ctx: Context) -> None:
    """Per case and implementation: forward and backward time (median of reps, inputs made
    before the clock starts), ratios against the references, achieved bytes/s against the
    traffic floor (bf16: 2 B a logit read in forward, 4 B read + written in backward) and its
    share of HBM peak; peak memory against the references and the logits + gradient floor."""
    if not ctx.cuda:
        _serve_big_buffers_by_mmap()
    for tokens, vocab in ctx.sizes.speed_cases:
        case = {
            "tokens": tokens,
            "vocab": vocab,
            "tp": 1,
            "dtype": "bf16",
            "device": ctx.device.type,
        }
        impls = bench_loss.loss_implementations("bf16", 1, ctx.group, ctx.device)
        impls = {name: impls[name] for name in SPEED_IMPLS if name in impls}
        if ctx.cuda:  # "del" takes the compiled kernel there
            impls.pop("del_compiled", None)
        else:  # toy sizes: Megatron's own compiled CE would only add its compile time
            impls.pop("megatron_fused", None)
        make = bench_loss._make_inputs(case, 0, 1, ctx.device)
        meter = bench_loss.Meter(ctx.device)
        measured = {name: [] for name in impls}
        peak = {}
        for name, fn in impls.items():
            bench_loss._one_step(fn, make, meter)  # warm-up, compilation
            peak[name] = bench_loss._one_step(fn, make, meter)[-1]
        for rep in range(ctx.sizes.reps):
            order = list(impls)[rep % len(impls) :] + list(impls)[: rep % len(impls)]
            for name in order:
                measured[name].append(bench_loss._one_step(impls[name], make, meter)[:2])
        _speed_rows(ctx, case, measured, peak)
        ctx.free()


def _speed_rows(ctx: Context, case: dict, measured: dict, peak: dict) -> None:
    logits = case["tokens"] * case["vocab"]
    floor_bytes = 2 * logits * 2  # bf16 logits and their gradient
    forward_traffic, backward_traffic = 2 * logits, 4 * logits
    times = {
        name: (
            statistics.median(f for f, _ in runs),
            statistics.median(b for _, b in runs),
        )
        for name, runs in measured.items()
    }
    for name, (fwd, bwd) in times.items():
        row = dict(case, impl=name, forward_ms=fwd * 1e3, backward_ms=bwd * 1e3)
        if name in ("del", "ce"):
            row["kernel"] = bench_loss.kernel_of(name, case)
        row["forward_gb_s"] = forward_traffic / fwd / 1e9
        row["backward_gb_s"] = backward_traffic / bwd / 1e9
        row["gb_s"] = (forward_traffic + backward_traffic) / (fwd + bwd) / 1e9
        if ctx.hbm_peak:
            row["hbm_share"] = row["gb_s"] * 1e9 / ctx.hbm_peak
        for ref in REFERENCES:
            if ref in times and ref != name and sum(times[ref]) > 0:
                row[f"time_vs_{ref}"] = (fwd + bwd) / sum(times[ref])
        ctx.results.add("speed", f"{name} {case['tokens']} x {case['vocab']}", None, **row)
    for name, bytes_ in peak.items():
        row = dict(case, impl=name, peak_mib=bytes_ / 2**20, vs_floor=bytes_ / floor_bytes)
        for ref in REFERENCES:
            if ref in peak and ref != name and peak[ref] > 0:
                row[f"peak_vs_{ref}"] = bytes_ / peak[ref]
        ok = None
        # The kernels that keep the logits, not an fp32 softmax: at most Megatron's peak.
        if name in ("del", "ce", "del_recompute", "del_compiled") and "peak_vs_megatron_ce" in row:
            ok = row["peak_vs_megatron_ce"] <= 1.0
        ctx.results.add("memory", f"{name} {case['tokens']} x {case['vocab']}", ok, **row)


def _serve_big_buffers_by_mmap() -> None:
    """CPU: glibc serves every buffer over 64 KiB by mmap, so that a freed buffer leaves the
    resident set and the peak-RSS meter sees each step alone (as bench_loss.py's memory runs)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except OSError:
        pass
