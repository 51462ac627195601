"""Run test bodies on several real processes joined by a gloo process group.

GlooWorkers keeps a group of processes alive, with Megatron's parallel_state set up in the
layout asked for, and runs one body after another on all of its ranks, so that every check is
its own test without paying a spawn (imports: ~10 s) for each.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from del_megatron.cpu.ports import free_port
from del_megatron.cpu.quick_exit import skip_final_collections

__all__ = ["GlooWorkers", "free_port"]

# A rank that waits this long in a collective for a peer that failed gives up.
COLLECTIVE_TIMEOUT_S = 120
# After one rank fails, how long the others get to report before the group is closed.
FAILURE_GRACE_S = 10


def _next_task(tasks, parent: int):
    """The next (fn, args), or None when told to stop or when the test process is gone."""
    while True:
        try:
            return tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _with_default(world_size: int, megatron: Dict[str, int]) -> Dict[str, int]:
    """initialize_model_parallel's keywords; none given: tensor parallel over all ranks."""
    return megatron or {"tensor_model_parallel_size": world_size}


def _use_layout(megatron: Dict[str, int]) -> None:
    """Megatron's parallel_state in another layout (as Megatron-Core's own unit tests switch
    between tests): the old groups are dropped, new ones made over the same processes."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**megatron)


def _serve(
    rank: int, world_size: int, port: int, tasks, results, parent: int, megatron: Dict[str, int]
) -> None:
    """A worker: join the group, set up Megatron's parallel_state, then run (fn, args) tasks
    until None arrives."""
    from megatron.core import parallel_state

    skip_final_collections()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    parallel_state.initialize_model_parallel(**megatron)
    try:
        while (task := _next_task(tasks, parent)) is not None:
            fn, args = task
            try:
                fn(*args)
                results.put((rank, None))
            except BaseException:  # reported to the test, which fails with it
                results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooWorkers:
    """`world_size` processes in one gloo group (dist.group.WORLD), reused for many calls, with
    Megatron's parallel_state initialised by `megatron` (initialize_model_parallel's keywords;
    default: the whole group is the tensor-parallel group, as Megatron's own CE compared
    against reads it from there)."""

    def __init__(self, world_size: int, **megatron: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        megatron = self.layout = _with_default(world_size, megatron)
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port, parent = free_port(), os.getpid()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world_size, port, tasks, self.results, parent, megatron),
            )
            for rank, tasks in enumerate(self.tasks)
        ]
        for proc in self.procs:
            proc.start()

    def use_layout(self, **megatron: int) -> GlooWorkers:
        """The same processes with Megatron's parallel_state in this layout (keywords of
        initialize_model_parallel; default: tensor parallel over all)."""
        megatron = _with_default(self.world_size, megatron)
        if megatron != self.layout:
            self.run(_use_layout, megatron)
            self.layout = megatron
        return self

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600) -> None:
        """fn(*args) on every rank; raises AssertionError with the failing ranks' tracebacks.
        After a failure the workers are closed (a peer may still wait in a collective)."""
        for tasks in self.tasks:
            tasks.put((fn, args))
        errors: Dict[int, str] = {}
        reported = set()
        deadline = time.monotonic() + timeout_s
        while len(reported) < self.world_size:
            if time.monotonic() > deadline:
                silent = sorted(set(range(self.world_size)) - reported)
                errors[-1] = f"ranks {silent} did not finish in time (waiting in a collective?)"
                break
            try:
                rank, error = self.results.get(timeout=1)
            except queue.Empty:
                if not self.alive():
                    errors[-1] = "a worker process died (see its output above)"
                    break
                continue
            reported.add(rank)
            if error is not None:
                errors[rank] = error
                # Peers that fail too report soon; one left waiting in a collective is killed.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if errors:
            self.close()
            report = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__}{args} failed:\n{report}")

    def stop(self) -> None:
        """Ask every worker to leave the group and exit; close() waits for them."""
        for tasks, proc in zip(self.tasks, self.procs, strict=True):
            if proc.is_alive():
                tasks.put(None)

    def close(self) -> None:
        self.stop()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
