"""Forward+backward time and peak memory of numerical_lm_loss against Megatron-Core's own
vocab_parallel_cross_entropy, on the same inputs in the same run.

    .venv/bin/python benchmarks/bench_loss.py --tokens 4096 --vocab 32000 151936 --tp 1 2

Every case runs on `tp` real processes (gloo on CPU), each holding its [s, b, V/tp] shard. Time is
the median over --reps of one forward+backward (max over ranks), the implementations taking
turns. Peak memory is the largest resident set of any rank during one forward+backward, counted
from before its logits shard was allocated (logits, working fp32 copy and gradient all count),
read from the kernel's high-water mark (VmHWM) after resetting it. It is measured in separate
processes where glibc serves every buffer over 64 KiB by mmap, so freed memory leaves the
resident set; that setting slows allocation, so time is measured with the default allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import del_megatron as dm  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VOCAB = dm.DigitVocab(digit_ids=range(15, 25), decimal_point_ids=[13])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _labels(tokens: int, vocab: int) -> torch.Tensor:
    """[b=1, s=tokens]: about 15% digits in numbers, like a math corpus."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(30, vocab, (1, tokens), generator=gen)
    digits = torch.randint(15, 25, (1, tokens), generator=gen)
    return torch.where(torch.rand(1, tokens, generator=gen) < 0.15, digits, labels)


def _implementations(dtype_name: str):
    """name -> fn(labels [b, s], logits [s, b, V/tp]) returning a [b, s] loss."""
    from megatron.core import tensor_parallel

    group = dist.group.WORLD
    inplace = dtype_name == "fp32"  # what Megatron's own CE does to fp32 logits

    def megatron_ce(labels, logits):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()

    def ours(loss, **extra):
        cfg = dm.NumericalLossConfig(loss=loss, alpha=0.01, vocab=VOCAB, **extra)
        return lambda labels, logits: dm.numerical_lm_loss(labels, logits, cfg, tp_group=group)

    impls = {
        "megatron_ce": megatron_ce,
        "ce": ours("ce", inplace=inplace),
        "del": ours("del", inplace=inplace),
        "ntl_was": ours("ntl_was", inplace=inplace),
    }
    if dtype_name == "fp32":
        impls["del_copy"] = ours("del")  # default: the caller's fp32 logits stay intact
    return impls


def _one_step(fn, labels, make_logits):
    logits = make_logits()
    start = time.perf_counter()
    # autograd.grad, as the output layer's backward would take it: no AccumulateGrad copy.
    (grad,) = torch.autograd.grad(fn(labels, logits).sum(), logits)
    elapsed = time.perf_counter() - start
    del grad
    return elapsed


def _worker(rank, world, port, case, phase, reps, queue):
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tokens, vocab, dtype_name = case["tokens"], case["vocab"], case["dtype"]
    local = vocab // world
    labels = _labels(tokens, local * world)

    def make_logits():
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, 1, local, generator=gen, dtype=DTYPES[dtype_name])
        return x.requires_grad_(True)

    impls = _implementations(dtype_name)
    rows = {name: {} for name in impls}
    if phase == "memory":
        for name, fn in impls.items():
            _one_step(fn, labels, make_logits)  # warm-up
            baseline = _status_kib("VmRSS")
            _reset_peak()
            _one_step(fn, labels, make_logits)
            rows[name]["peak_mib"] = (_status_kib("VmHWM") - baseline) / 1024
    else:
        # Round-robin with a rotating order, so that drift and the page-fault cost of fresh
        # buffers fall on every implementation alike.
        names = list(impls)
        times = {name: [] for name in names}
        for name in names:
            _one_step(impls[name], labels, make_logits)  # warm-up
        for rep in range(reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(_one_step(impls[name], labels, make_logits))
        for name in names:
            rows[name] = {"time_s": statistics.median(times[name]), "time_min_s": min(times[name])}
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        merged = {
            name: {key: max(r[name][key] for r in gathered) for key in rows[name]} for name in rows
        }
        queue.put(merged)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _spawn(case, phase, reps):
    from tests.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = (case["tp"], free_port(), case, phase, reps, queue)
    mp.spawn(_worker, args=args, nprocs=case["tp"])
    return queue.get()


def run_case(case, reps):
    """{impl: {time_s, time_min_s, peak_mib}} for one case."""
    rows = _spawn(case, "time", reps)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        memory = _spawn(case, "memory", reps)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    for name, row in rows.items():
        row.update(memory[name])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/bench_loss.json")
    args = parser.parse_args(argv)

    results = []
    header = (
        f"{'tokens':>6} {'vocab':>7} {'tp':>2} {'dtype':>5} {'impl':>12} "
        f"{'time ms':>9} {'x meg.':>7} {'peak MiB':>9} {'x meg.':>7}"
    )
    print(header)
    for tokens in args.tokens:
        for vocab in args.vocab:
            for tp in args.tp:
                for dtype in args.dtype:
                    case = {"tokens": tokens, "vocab": vocab, "tp": tp, "dtype": dtype}
                    rows = run_case(case, args.reps)
                    ref = rows["megatron_ce"]
                    for name, row in rows.items():
                        row["time_ratio"] = row["time_s"] / ref["time_s"]
                        row["peak_ratio"] = row["peak_mib"] / ref["peak_mib"]
                        results.append({**case, "impl": name, **row})
                        print(
                            f"{tokens:>6} {vocab:>7} {tp:>2} {dtype:>5} {name:>12} "
                            f"{row['time_s'] * 1e3:>9.1f} {row['time_ratio']:>7.3f} "
                            f"{row['peak_mib']:>9.1f} {row['peak_ratio']:>7.3f}",
                            flush=True,
                        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "reps": args.reps}
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
