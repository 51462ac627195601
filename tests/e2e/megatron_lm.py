"""Megatron-LM's own pretrain_gpt.py, run for real: sources, patches, torchrun, its log.

Upstream sources are never copied into the repository. tests/megatron_lm_source.py finds them
(a user's checkout in MEGATRON_LM_DIR, release snapshots in MEGATRON_LM_ARCHIVES, or a shallow
clone of the tag; docs/testing.md); each test session unpacks or copies them into a temporary
folder and applies the matching patch from patches/ there.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from tests import megatron_lm_source
from tests.distributed import free_port

from .peak_rss import PREFIX as PEAK_RSS

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
DROP_IN = REPO / "examples" / "pretrain_gpt_del.py"
PEAK_RSS_SCRIPT = Path(__file__).with_name("peak_rss.py")
USER_CHECKOUT = os.environ.get("MEGATRON_LM_DIR")
RUN_TIMEOUT_S = 600

# The Megatron-LM releases each pinned environment runs (megatron-core major.minor -> tags).
TAGS_BY_CORE = {"0.16": ["core_v0.16.1"], "0.19": ["core_v0.18.0", "core_v0.19.0"]}
# Megatron-LM's development heads (snapshots named <branch>-<commit>, dated in docs/testing.md),
# run by tests/e2e/test_heads.py in the environment whose megatron-core they build against.
HEADS_BY_CORE = {"0.19": ["main-d98e8a6", "dev-d48bd6b"]}

# A tiny GPT on CPU, Megatron-LM flags only. Mock data over a NullTokenizer vocab of 1024:
# MockGPTDataset's documents count up 1, 2, 3, ... so ids 10..19 appear as one ten-digit number
# in some steps and not at all in others (iterations 4, 6, 8, 9 have no digit target).
DIGIT_IDS = [str(i) for i in range(10, 20)]
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--seed", "1234",
    "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--transformer-impl", "local",
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "5",
]  # fmt: skip
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]


def tags_for_this_environment() -> List[str]:
    """The tags to test with the installed megatron-core, or ["user"] for MEGATRON_LM_DIR."""
    if USER_CHECKOUT:
        return ["user"]
    core = ".".join(version("megatron-core").split(".")[:2])
    if core not in TAGS_BY_CORE:
        raise RuntimeError(f"no Megatron-LM tag is paired with megatron-core {core}")
    return TAGS_BY_CORE[core]


def heads_for_this_environment() -> List[str]:
    """The development heads to test with the installed megatron-core (none for a user's
    checkout, which runs every e2e test itself)."""
    if USER_CHECKOUT:
        return []
    return HEADS_BY_CORE.get(".".join(version("megatron-core").split(".")[:2]), [])


def check_sources() -> None:
    """Raise megatron_lm_source.SourceUnavailable, one line naming what to set, when a tag or
    head this environment tests has no sources anywhere."""
    megatron_lm_source.find_all(tags_for_this_environment() + heads_for_this_environment())


def applying_patch(tree: Path, tag: str) -> Optional[Path]:
    """patches/megatron-lm-<tag>-pretrain_gpt.patch for a release tag; for a development head
    or a user's checkout the first of our patches that `git apply --check` accepts there, or
    None when none does (the drop-in is the route there)."""
    candidates = sorted(PATCHES.glob("*.patch"))
    if tag in {t for tags in TAGS_BY_CORE.values() for t in tags}:
        candidates = [PATCHES / f"megatron-lm-{tag}-pretrain_gpt.patch"]
    for patch in candidates:
        check = subprocess.run(
            ["git", "apply", "--check", str(patch)], cwd=tree, capture_output=True, text=True
        )
        if check.returncode == 0:
            return patch
    return None


def _patch_for(tree: Path, tag: str) -> Path:
    patch = applying_patch(tree, tag)
    if patch is None:
        raise RuntimeError(f"no patch in {PATCHES} applies to {tree}/pretrain_gpt.py")
    return patch


def prepare_tree(tag: str, dest: Path, patched: bool) -> Path:
    """A Megatron-LM tree of `tag` under `dest`, with our patch applied if `patched`."""
    tree = megatron_lm_source.materialise(megatron_lm_source.find(tag), dest)
    if patched:
        subprocess.run(["git", "apply", str(_patch_for(tree, tag))], cwd=tree, check=True)
    # Bytecode once, as docker/Dockerfile does: with PYTHONDONTWRITEBYTECODE (or a read-only
    # tree) every rank of every launch would compile Megatron-LM's sources again (~3 s a rank).
    sources = [str(tree / "megatron"), *map(str, tree.glob("*.py"))]
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *sources], check=True)
    return tree


@dataclass
class Run:
    """One torchrun of a pretrain script: its exit code, its log and the values Megatron-LM
    printed (iterations[i][key], validation[i][key])."""

    returncode: int
    log: str
    iterations: Dict[int, Dict[str, float]] = field(default_factory=dict)
    validation: Dict[int, Dict[str, float]] = field(default_factory=dict)
    peak_rss_mib: Optional[float] = None

    def series(self, key: str, first: int = 1, last: int = 10) -> List[float]:
        return [self.iterations[i][key] for i in range(first, last + 1)]


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
_VALIDATION = re.compile(r"validation loss at iteration (\d+) .*?\|(.*)$")
_ENTRY = re.compile(r"^\s*([a-z][a-z0-9 _-]*?)\s*:\s*([-+0-9.eEnaNifINF]+)\s*$")
_MEMORY_REPORT = "[Rank "
_VALUE = re.compile(r"^\s*([a-z][a-z0-9 _-]*?) value\s*:\s*([-+0-9.eEnaNifINF]+)\s*$")


def parse_log(text: str) -> tuple:
    iterations: Dict[int, Dict[str, float]] = {}
    validation: Dict[int, Dict[str, float]] = {}
    for line in text.splitlines():
        found = _ITERATION.search(line)
        if found:
            # rank 0's memory report can land on the same line (stdout of two ranks interleaved)
            logged = found.group(2).split(_MEMORY_REPORT)[0]
            entries = (_ENTRY.match(part) for part in logged.split("|"))
            iterations[int(found.group(1))] = {m[1]: float(m[2]) for m in entries if m}
            continue
        found = _VALIDATION.search(line)
        if found:
            entries = (_VALUE.match(part) for part in found.group(2).split("|"))
            validation[int(found.group(1))] = {m[1]: float(m[2]) for m in entries if m}
    return iterations, validation


_VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+)[^|]*\|(.*)$")
_VALIDATION_ENTRY = re.compile(
    r"^\s*([a-z][a-z0-9 _-]*?) (value|PPL)\s*:\s*([-+0-9.eEnaNifINF]+)\s*$"
)


def validation_lines(text: str) -> List[tuple]:
    """Every validation line Megatron-LM printed, in order (the evaluation every
    --eval-interval, then after training the validation and the test set, all "at iteration N"):
    (N, {key: value}, {key: PPL})."""
    lines = []
    for line in text.splitlines():
        found = _VALIDATION_LINE.search(line)
        if found:
            values: Dict[str, float] = {}
            ppls: Dict[str, float] = {}
            for part in found.group(2).split("|"):
                entry = _VALIDATION_ENTRY.match(part)
                if entry:
                    (values if entry[2] == "value" else ppls)[entry[1]] = float(entry[3])
            lines.append((int(found.group(1)), values, ppls))
    return lines


def tensorboard_scalars(folder: Path) -> Dict[str, List[tuple]]:
    """Every scalar event in the TensorBoard event files under `folder`, read with TensorBoard's
    own EventAccumulator (none dropped): tag -> [(step, value), ...] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def cpu_environment(*path: Union[str, Path]) -> Dict[str, str]:
    """The environment of a CPU job: del_megatron.cpu's start-up hook in every process, and
    the folders `path` on PYTHONPATH (a test fixture's, for Megatron-LM's `--spec`)."""
    from del_megatron.cpu.training import job_environment

    env = job_environment(dict(os.environ, PYTHONUNBUFFERED="1"))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *map(str, path)])
    return env


def run_pretrain(
    tree: Path,
    script: Union[str, Path],
    flags: Sequence[str],
    nproc: int = 2,
    log_path: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
) -> Run:
    """torchrun `script` (a path, or "-m" with the module first in `flags`) from the Megatron-LM
    `tree` with `flags` on CPU (gloo), in `env` (default: cpu_environment())."""
    command = [
        sys.executable, str(PEAK_RSS_SCRIPT),
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), str(script), *flags,
    ]  # fmt: skip
    done = subprocess.run(
        command,
        cwd=tree,
        env=env or cpu_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if log_path is not None:
        log_path.write_text(done.stdout)
    iterations, validation = parse_log(done.stdout)
    peak = re.search(re.escape(PEAK_RSS) + r" (\d+)", done.stdout)
    return Run(
        done.returncode, done.stdout, iterations, validation, float(peak[1]) if peak else None
    )


def is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


# Entries whose console mean is over the digit targets of the interval (lm.py's IntervalMeans),
# each step weighted by its `digit tokens`; a step without digit targets writes no event.
DIGIT_KEYED = (
    "del term",
    "del weight",
    "digit acc",
    "digit entropy",
    "digit target prob",
    "digit distance",
)


def log_intervals(printed: Sequence[int]) -> Dict[int, List[int]]:
    """The steps each console line of Megatron-LM averages: the first line (iteration 1)
    its own step, without resetting the accumulators, so the next line averages from step 1;
    each later one the steps since the line before."""
    printed = sorted(printed)
    intervals = {printed[0]: [printed[0]]}
    start = printed[0]
    for line in printed[1:]:
        intervals[line] = list(range(start, line + 1))
        start = line + 1
    return intervals


def weight_key(key: str) -> Optional[str]:
    """The entry counting the digit targets `key` is a mean over: `digit tokens` for the main
    head's DIGIT_KEYED entries, `mtp_<k> digit tokens` for MTP head k's; None for the others."""
    if key in DIGIT_KEYED:
        return "digit tokens"
    if key.startswith("mtp_") and key.endswith((" digit acc", " digit entropy")):
        return key.split(" ")[0] + " digit tokens"
    return None


def steps_with_digits(key: str, scalars: Dict[str, List[tuple]]) -> List[int]:
    """The steps TensorBoard has `key` for: every step, or for an entry over digit targets the
    steps that have some (core <= 0.17 shows a count of 0 as 1e-20)."""
    counted = weight_key(key)
    if counted is None:
        return sorted(step for step, _ in scalars["lm loss"])
    return sorted(step for step, tokens in scalars[counted] if tokens > 1e-6)


def console_value(key: str, steps: Sequence[int], scalars: Dict[str, List[tuple]]) -> float:
    """What the console prints for `key` over `steps`, from TensorBoard's per-step events: the
    mean over steps, or for an entry over digit targets the mean weighted by each step's
    digit targets (weight_key; steps without any have no event and weigh nothing; none at all
    prints 0)."""
    events = dict(scalars[key])
    counted = weight_key(key)
    if counted is None:
        return sum(events[step] for step in steps) / len(steps)
    weights = dict(scalars[counted])
    held = [step for step in steps if weights[step] > 1e-6]  # core <= 0.17 shows 0 as 1e-20
    if not held:
        return 0.0
    return sum(events[s] * weights[s] for s in held) / sum(weights[s] for s in held)
