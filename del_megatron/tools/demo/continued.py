"""Continued pretraining, the regime of the DEL paper and of our users: per seed, a base model
pretrained with CE on the base distribution and saved as a Megatron checkpoint, then continued
by every arm from those weights, in the same data order, on the continued distribution (longer
operands, more decimal places: corpus.CONTINUED). `compare --continue-from-base` and the demo
run it.

Layout under the output folder: data/ (the base corpus and its tokenizer), continued-data/
(the continued corpus, the same tokenizer), seed-<S>/base/ (the base run) beside the arms'
seed-<S>/<arm>/ runs."""

from __future__ import annotations

import os
from typing import Callable, Dict, Mapping, Optional, Tuple

from .compare import check_finished_run, read_run
from .config import WEIGHT_REDUCTION
from .corpus import BASE, CONTINUED
from .data import prepare, tokenizer_path

BASE_RUN = "base"
BASE_DATA, CONTINUED_DATA = "data", "continued-data"


def prepare_data(
    out: str,
    corpus: Optional[str],
    tokenizer: Optional[str],
    num_docs: int,
    num_eval: int,
    seed: int,
) -> Tuple[str, str]:
    """(base data folder, continued data folder) under `out`, each prepared unless it was: the
    base corpus (`corpus`, else the synthetic base distribution) with `tokenizer`, and the
    continued distribution tokenized with the base's tokenizer."""
    base_dir = os.path.join(out, BASE_DATA)
    if not os.path.exists(os.path.join(base_dir, "meta.json")):
        prepare(base_dir, corpus, tokenizer, num_docs, num_eval, seed, BASE)
    continued_dir = os.path.join(out, CONTINUED_DATA)
    if not os.path.exists(os.path.join(continued_dir, "meta.json")):
        base_tokenizer = tokenizer_path(base_dir)
        prepare(continued_dir, None, base_tokenizer, num_docs, num_eval, seed, CONTINUED)
    return base_dir, continued_dir


def base_run_dir(out: str, seed: int) -> str:
    return os.path.join(out, f"seed-{seed}", BASE_RUN)


def checkpoints_of(run_dir: str) -> str:
    """The checkpoints folder a run writes (demo.train), which an arm's --init-from names."""
    return os.path.join(run_dir, "checkpoints")


def base_settings(seed: int, settings: Mapping[str, object]) -> Dict[str, object]:
    """What a base run trains with: plain CE at `settings` (TrainConfig fields), seeded."""
    return {**settings, "loss": "ce", "alpha": 0.0, "seed": seed, "reduction": WEIGHT_REDUCTION}


def ensure_base(
    out: str,
    seed: int,
    train_base: Callable[[int, str], int],
    settings: Mapping[str, object],
    log: Callable[[str], None] = print,
) -> dict:
    """The metrics.json of seed's base run, trained (or continued from its checkpoint) unless
    it finished before with these `settings`; RuntimeError naming how to go on otherwise."""
    path = base_run_dir(out, seed)
    run = read_run(path)
    if run:
        check_finished_run(path, run, base_settings(seed, settings))
    if run.get("finished") and "base_ce" in run:
        log(f"seed {seed}, base: finished before, not run again")
        return run
    log(f"seed {seed}, base: training (CE, {settings['steps']} steps)")
    code = train_base(seed, path)
    run = read_run(path)
    if code != 0 or not run.get("finished") or "base_ce" not in run:
        raise RuntimeError(
            f"seed {seed}, base failed (exit {code}); rerun the same command to continue"
        )
    return run


def add_base_change(
    results: Dict[str, Dict[int, Dict[str, float]]], bases: Mapping[int, dict]
) -> None:
    """Each continued run's `base_ce_change`: its base-distribution CE minus its base's."""
    for by_seed in results.values():
        for seed, metrics in by_seed.items():
            if "base_ce" in metrics:
                metrics["base_ce_change"] = metrics["base_ce"] - bases[seed]["base_ce"]
