"""The integration stage: Megatron-LM's pretrain_gpt.py through the drop-in, logits-free off and
on, for each DEL reduction (the runs themselves: benchmarks/gpu_integration.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from benchmarks import gpu_integration
from del_megatron.megatron.logits_free import MIN_CORE as MIN_LOGITS_FREE_CORE

from ..context import Context

INTEGRATION = "pretrain_gpt.py logits-free vs materialised"


def stage_integration(ctx: Context) -> None:
    """Megatron-LM's pretrain_gpt.py through examples/pretrain_gpt_del.py (gpu_integration.py:
    the TE spec on a GPU, bf16, gradient-accumulation fusion, the distributed optimizer with
    overlapped reduce-scatter and all-gather in small buckets, MTP, an untied output layer, V
    151936) on a corpus with numbers, at DP 2 where it can (gpu_integration.data_parallel):
    for the digit reduction, then the token one, logits-free off and on must agree in lm loss,
    DEL term and each rank's output-layer main_grad before iteration 1's optimizer step."""
    checkout = os.environ.get("MEGATRON_LM_DIR")
    ranks, why = gpu_integration.data_parallel(ctx.cuda, torch.cuda.device_count())
    iterations = ctx.sizes.integration_iterations
    data = ctx.out / "integration_data" / "numbers"
    launches = gpu_integration.commands(ctx.cuda, ranks, ctx.out, data, iterations)
    plan = dict(ranks=ranks, data_parallel=why)
    version = gpu_integration.megatron_core_version(Path(checkout)) if checkout else None
    skipped = None
    if not checkout:
        skipped = "set MEGATRON_LM_DIR to a Megatron-LM checkout to run it"
    elif version is not None and version < MIN_LOGITS_FREE_CORE:
        skipped = (
            f"--del-logits-free needs megatron-core >= {MIN_LOGITS_FREE_CORE[0]}."
            f"{MIN_LOGITS_FREE_CORE[1]}; MEGATRON_LM_DIR holds {version[0]}.{version[1]}"
        )
    if skipped:
        commands = {k: " ".join(v) for k, v in launches.items()}
        ctx.results.add(
            "integration", INTEGRATION, None, skipped=skipped, **plan, commands=commands
        )
        return
    vocab = gpu_integration.GPU_VOCAB if ctx.cuda else gpu_integration.CPU_VOCAB
    corpus = gpu_integration.write_number_corpus(data, vocab, tokens=100_000)
    ctx.results.add("integration", "corpus with numbers", corpus["digit_share"] > 0.2, **corpus)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_LM_DIR=checkout)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not ctx.cuda:
        from del_megatron.cpu.training import job_environment

        env = job_environment(env)
    for reduction in gpu_integration.REDUCTIONS:
        try:
            names = {run: f"{reduction}_{run}" for run in gpu_integration.RUNS}
            ran = _run_together({n: launches[n] for n in names.values()}, checkout, env, ctx.out)
            logs = {run: gpu_integration.parse_log(ran[name][0]) for run, name in names.items()}
            grads = {
                run: [
                    torch.load(ctx.out / f"integration_{name}_main_grad.rank{r}.pt")
                    for r in range(ranks)
                ]
                for run, name in names.items()
            }
            ok, figures = gpu_integration.compare(logs, grads, iterations)
            figures["run_seconds"] = {run: ran[name][1] for run, name in names.items()}
        except (RuntimeError, OSError, KeyError) as exc:  # a run failed; the next one runs
            ok, figures = False, {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
        ctx.results.add(
            "integration",
            f"{INTEGRATION}, {reduction} reduction",
            ok,
            reduction=reduction,
            **plan,
            **figures,
        )


def _run_together(
    launches: Dict[str, List[str]], checkout: str, env: Dict[str, str], out: Path
) -> Dict[str, Tuple[str, float]]:
    """Run the torchrun commands at the same time (each a free port, its output in
    OUT/integration_<name>.log as it comes, stale gradient files removed first) from the
    checkout: the two runs of a pair are independent jobs, and on a GPU most of a run is
    start-up and compiling on the host. Returns {name: (log, seconds)}; RuntimeError with the
    tail of each failed run's log."""
    from del_megatron.cpu.ports import free_port

    running = {}
    started = time.monotonic()
    for name, command in launches.items():
        for stale in out.glob(f"integration_{name}_main_grad.rank*.pt"):
            stale.unlink()
        command = [str(free_port()) if arg == gpu_integration.PORT else arg for arg in command]
        log_path = out / f"integration_{name}.log"
        print(f"integration: {name} starts, log {log_path}", flush=True)
        with log_path.open("w") as log:
            proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=log, stderr=log)
        running[name] = (proc, log_path)
    seconds = {}
    while len(seconds) < len(running):
        for name, (proc, _) in running.items():
            if name not in seconds and proc.poll() is not None:
                seconds[name] = round(time.monotonic() - started, 1)
        time.sleep(0.2)
    logs = {name: log_path.read_text() for name, (_, log_path) in running.items()}
    failed = [
        f"{name} exited {proc.returncode}; see {log_path}: {logs[name][-900:]}"
        for name, (proc, log_path) in running.items()
        if proc.returncode != 0
    ]
    if failed:
        raise RuntimeError("\n".join(failed))
    return {name: (logs[name], seconds[name]) for name in running}
