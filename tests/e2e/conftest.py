"""Fixtures of the end-to-end stage: Megatron-LM trees (patched or not) and cached runs."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

from .megatron_lm import DROP_IN, Run, prepare_tree, run_pretrain

VARIANTS = ("patched", "drop-in")


class Trainer:
    """Runs one pretrain script (the patched pretrain_gpt.py, or the drop-in from a clean tree)
    and keeps each named run, so tests that look at the same run share it."""

    def __init__(self, tree: Path, script: Path, workdir: Path) -> None:
        self.tree, self.script, self.workdir = tree, script, workdir
        self._runs: Dict[str, Run] = {}

    def path(self, name: str) -> Path:
        return self.workdir / name

    def run(self, name: str, flags: Sequence[str], nproc: int = 2) -> Run:
        if name not in self._runs:
            log = self.workdir / f"{name}.log"
            self._runs[name] = run_pretrain(self.tree, self.script, flags, nproc, log)
        return self._runs[name]


@pytest.fixture(scope="session")
def trainers(tmp_path_factory):
    """trainers(tag, variant) -> Trainer, made once a session."""
    made: Dict[tuple, Trainer] = {}

    def get(tag: str, variant: str) -> Trainer:
        key = (tag, variant)
        if key not in made:
            base = tmp_path_factory.mktemp(f"{tag}-{variant}")
            tree = prepare_tree(tag, base / "src", patched=variant == "patched")
            script: Optional[Path] = tree / "pretrain_gpt.py" if variant == "patched" else DROP_IN
            made[key] = Trainer(tree, script, base)
        return made[key]

    return get


@pytest.fixture(scope="session")
def sentencepiece_models(tmp_path_factory) -> Dict[str, str]:
    """Two SentencePiece models trained on number-rich text: "split" keeps one digit per
    token (Llama-2 / Mistral style), "merging" learns multi-digit pieces."""
    import random

    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("sentencepiece")
    rng = random.Random(0)
    lines = [
        f"item {rng.randint(0, 999)} costs {rng.randint(1, 99)}.{rng.randint(0, 99):02d} "
        f"and weighs {rng.randint(10, 5000)} grams"
        for _ in range(3000)
    ]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    models = {}
    for name, split in (("split", True), ("merging", False)):
        prefix = folder / name
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(prefix),
            vocab_size=400,
            split_digits=split,
            model_type="bpe",
            minloglevel=2,
        )
        models[name] = f"{prefix}.model"
    return models
