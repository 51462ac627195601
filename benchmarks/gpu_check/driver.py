"""The driver: each stage in a process of its own, killed at its limit with every process it
started, and a row for how each one ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .results import Results

STAGE_TAG = "GPU_CHECK_STAGE_TAG"  # in every process of a stage, torchrun's workers included
STDERR_TAIL = 3000  # characters of a failed stage's stderr in its row


def _tagged_processes(tag: str) -> List[int]:
    """Processes whose environment holds STAGE_TAG=tag (Linux /proc; [] elsewhere)."""
    needle = f"{STAGE_TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return [pid for pid in found if pid != os.getpid()]


def kill_stage(proc: subprocess.Popen, tag: str) -> int:
    """SIGKILL the stage's process group (its session), then every process that carries its
    tag: torchrun starts each worker in a session of its own, and a killed agent's workers are
    orphans. Waits for the stage's process. Returns how many tagged processes were found outside
    the stage's process group (strays)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # a process in the kernel's D state
        proc.wait(timeout=30)
    strays = set()
    for _ in range(50):
        left = _tagged_processes(tag)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) != proc.pid:
                    strays.add(pid)
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return len(strays)


@dataclass
class StageRun:
    """How one stage's process ended: "done" (exited by itself), "killed" (at its limit) or
    "interrupted" (gpu_check itself was stopped)."""

    outcome: str
    returncode: Optional[int]
    seconds: float
    strays: int
    stderr_tail: str = ""


def run_stage_process(
    command: Sequence[str], limit_s: float, env: Dict[str, str], stderr: Path
) -> StageRun:
    """Run `command` in a session of its own with a fresh STAGE_TAG, its stderr in a file; at
    limit_s, or when this process is interrupted (SIGINT, or SIGTERM through _interrupt), kill
    it with everything it started. Processes it leaves behind after a normal exit are killed
    too (strays)."""
    tag = uuid.uuid4().hex
    started = time.monotonic()
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            list(command), env={**env, STAGE_TAG: tag}, stderr=err, start_new_session=True
        )
    try:
        proc.wait(timeout=limit_s)
        outcome = "done"
    except subprocess.TimeoutExpired:
        outcome = "killed"
    except KeyboardInterrupt:
        outcome = "interrupted"
    strays = kill_stage(proc, tag)
    returncode = proc.returncode if outcome == "done" else None
    tail = stderr.read_bytes()[-STDERR_TAIL:].decode(errors="replace")
    return StageRun(outcome, returncode, round(time.monotonic() - started, 1), strays, tail)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def drive(
    results: Results,
    limits: Dict[str, float],
    envelope_s: float,
    command_of: Callable[[str, float], List[str]],
) -> None:
    """Run each stage's command (command_of(stage, its deadline as time.time())) with its
    limit, in order, its stderr in OUT/gpu_check_<stage>.stderr, and write how it ended: a
    "stage time" row (seconds, limit, outcome), and a failed "stage" row (with the tail of its
    stderr) for a stage killed at its limit, ended by a signal or a non-zero status, or stopped
    because gpu_check itself was (the stages after it do not run)."""
    results.add(
        "environment",
        "stage limits",
        None,
        limits_s=limits,
        sum_s=round(sum(limits.values()), 1),
        envelope_s=envelope_s,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for stage, limit in limits.items():
            command = command_of(stage, time.time() + limit)
            stderr = results.path.with_name(f"gpu_check_{stage}.stderr")
            ended = run_stage_process(command, limit, dict(os.environ), stderr)
            _report_stage(results, stage, limit, ended)
            if ended.outcome == "interrupted":
                print("gpu_check: interrupted; the stages above are what ran", file=sys.stderr)
                break
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_stage(results: Results, stage: str, limit: float, ended: StageRun) -> None:
    error = None
    if ended.outcome == "killed":
        error = f"killed at its limit of {limit:g} s, with every process it started"
    elif ended.outcome == "interrupted":
        error = "stopped: gpu_check was interrupted"
    elif ended.returncode:
        how = f"signal {-ended.returncode}" if ended.returncode < 0 else f"{ended.returncode}"
        error = f"its process ended with status {how}"
    if error:
        results.add(
            stage,
            "stage",
            False,
            error=error,
            limit_s=limit,
            outcome=ended.outcome,
            stderr_tail=ended.stderr_tail,
        )
    strays = {"strays_killed": ended.strays} if ended.strays else {}
    results.add(
        stage,
        "stage time",
        None,
        seconds=ended.seconds,
        limit_s=limit,
        outcome=ended.outcome,
        **strays,
    )
