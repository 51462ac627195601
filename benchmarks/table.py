"""Markdown table of benchmark JSON files (bench_loss.py output), one row per case and impl.

.venv/bin/python benchmarks/table.py benchmarks/bench_loss_cpu.json [--impls del megatron_ce]
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+")
    parser.add_argument("--impls", nargs="*", default=[])
    args = parser.parse_args(argv)
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
