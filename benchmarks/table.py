"""Markdown table of benchmark JSON files (bench_loss.py output), one row per case and impl.

.venv/bin/python benchmarks/table.py benchmarks/bench_loss_cpu.json [--impls del megatron_ce]
.venv/bin/python benchmarks/table.py --kernels benchmarks/bench_kernels_cpu.json
.venv/bin/python benchmarks/table.py --linear benchmarks/bench_linear_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(paths, impls):
    for path in paths:
        for row in json.loads(Path(path).read_text())["results"]:
            if not impls or row["impl"] in impls:
                yield row


def fmt(value, spec):
    return "" if value is None else format(value, spec)


HEADS = ("ce", "del", "ntl_was", "ntl_mse", "dist2")
PEERS = ("megatron_fused", "del_softmax", "del_compiled", "del_naive", "ntloss_was")


def summary(paths) -> None:
    """One line a case: Megatron's time, then time / memory ratios of DEL and the peers."""
    cases = {}
    for r in rows(paths, ()):
        cases.setdefault((r["tokens"], r["vocab"], r["tp"], r["dtype"]), {})[r["impl"]] = r
    print(
        "| tokens | vocab | TP | logits | Megatron CE ms | DEL time | DEL memory | slowest head | "
        + " | ".join(PEERS)
        + " | place_weights / DEL |"
    )
    print("|---" * (9 + len(PEERS)) + "|")
    for (tokens, vocab, tp, dtype), impls in cases.items():
        ref, ours = impls["megatron_ce"], impls["del"]
        heads = [impls[h]["time_ratio"] for h in HEADS if h in impls]
        peers = []
        for name in PEERS:
            row = impls.get(name)
            cell = f"{row['time_ratio']:.2f}x / {row['peak_ratio']:.2f}x" if row else "-"
            peers.append(cell)
        share = None
        if "place_weights" in impls:
            share = impls["place_weights"]["time_s"] / ours["time_s"]
        print(
            f"| {tokens} | {vocab} | {tp} | {dtype} | {ref['time_s'] * 1e3:.0f} | "
            f"{ours['time_ratio']:.3f}x | {ours['peak_ratio']:.3f}x | {max(heads):.3f}x | "
            + " | ".join(peers)
            + f" | {'-' if share is None else format(share, '.1e')} |"
        )


# Issue targets of the logits-free path against the materialised one.
LINEAR_TIME_TARGET, LINEAR_PEAK_TARGET = 1.3, 0.25


# The logits-free rows: what --del-logits-free runs ("auto"), then each route forced.
LOGITS_FREE = {
    "linear_logits_free": "auto: ",
    "linear_logits_free_forward": "",
    "linear_logits_free_backward": "",
}


def linear_summary(paths) -> None:
    """One line a logits-free row of bench_loss.py --linear: the materialised path, then the
    logits-free path's weight-gradient route, time and peak against it, its weight-gradient
    accumulator and the targets. Rows from before the routes existed took "forward"."""
    print(
        "| tokens | vocab | h | TP | dtype | materialised ms | materialised MiB | weight "
        "gradient | logits-free time | logits-free peak | accumulator MiB (share of peak) | "
        "targets |"
    )
    print("|---" * 12 + "|")
    for r in rows(paths, tuple(LOGITS_FREE)):
        # the materialised row of the same run, which the ratios are taken against
        ref_ms, ref_mib = 1e3 * r["time_s"] / r["time_ratio"], r["peak_mib"] / r["peak_ratio"]
        met = r["time_ratio"] <= LINEAR_TIME_TARGET and r["peak_ratio"] <= LINEAR_PEAK_TARGET
        route = LOGITS_FREE[r["impl"]] + r.get("weight_gradient", "forward")
        print(
            f"| {r['tokens']} | {r['vocab']} | {r['hidden']} | {r['tp']} | {r['dtype']} | "
            f"{ref_ms:.0f} | {ref_mib:.0f} | {route} | "
            f"{r['time_ratio']:.3f}x | {r['peak_ratio']:.3f}x | {r['accumulator_mib']:.0f} "
            f"({r['accumulator_share']:.2f}) | {'met' if met else 'missed'} |"
        )


# What each row measures (numerical_lm_loss rows: DEL, alpha 0.01, on the same logits).
MEASURES = {
    "megatron_ce": "Megatron-Core's vocab_parallel_cross_entropy (the reference)",
    "megatron_fused": "Megatron-Core's torch.compile'd fused CE",
    "te_ce": "Transformer Engine's parallel CE (Megatron's wrapper)",
    "del": "DEL, kernel 'auto'",
    "del_softmax": "DEL, 'softmax' forced: an fp32 softmax kept, Megatron's scheme",
    "del_recompute": "DEL, 'recompute' forced: eager passes over 8 MiB fp32 chunks",
    "del_compiled": "DEL, 'compiled' forced: torch.compile'd pointwise passes over all rows",
}
AUTO = (
    "'auto' takes 'compiled' on CUDA; off CUDA 'recompute', or 'softmax' for fp32/fp64 "
    "logits with inplace=True (kernels/__init__.py)"
)


def kernels_table(paths) -> None:
    """One line a kernel row: what it measures, the kernel it ran, forward and backward time,
    time and peak memory against Megatron's CE."""
    print(f"`del` = {AUTO}.\n")
    print(
        "| tokens | vocab | TP | logits | threads | row | measures | kernel | forward ms | "
        "backward ms | time | peak MiB | peak |"
    )
    print("|---" * 13 + "|")
    for r in rows(paths, tuple(MEASURES)):
        forward, backward = r.get("forward_s"), r.get("backward_s")
        print(
            f"| {r['tokens']} | {r['vocab']} | {r['tp']} | {r['dtype']} | "
            f"{r.get('threads', '-')} | {r['impl']} | "
            f"{MEASURES[r['impl']]} | {r.get('kernel', '-')} | "
            f"{fmt(None if forward is None else forward * 1e3, '.0f')} | "
            f"{fmt(None if backward is None else backward * 1e3, '.0f')} | "
            f"{r['time_ratio']:.3f}x | {r['peak_mib']:.0f} | {r['peak_ratio']:.3f}x |"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+")
    parser.add_argument("--impls", nargs="*", default=[])
    parser.add_argument("--summary", action="store_true", help="one line a case")
    parser.add_argument("--linear", action="store_true", help="one line a --linear case")
    parser.add_argument("--kernels", action="store_true", help="one line a kernel, described")
    args = parser.parse_args(argv)
    if args.kernels:
        kernels_table(args.json)
        return
    if args.summary:
        summary(args.json)
        return
    if args.linear:
        linear_summary(args.json)
        return
    print("| tokens | vocab | TP | logits | impl | time ms | x ref | peak MiB | x ref |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows(args.json, args.impls):
        ratio = r.get("time_ratio", r.get("share_of_del"))
        time_ms = r["time_s"] * 1e3 if "time_s" in r else None
        print(
            f"| {r['tokens']} | {r['vocab']} | {r['tp']} | {r['dtype']} | {r['impl']} | "
            f"{fmt(time_ms, '.0f' if (time_ms or 0) >= 10 else '.2f')} | {fmt(ratio, '.3f')} | "
            f"{fmt(r.get('peak_mib'), '.0f')} | {fmt(r.get('peak_ratio'), '.3f')} |"
        )


if __name__ == "__main__":
    main()
