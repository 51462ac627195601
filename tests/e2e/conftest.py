"""Fixtures of the end-to-end stage: Megatron-LM trees (patched or not) and cached runs."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

from tests.megatron_lm_source import UNAVAILABLE_EXIT, SourceUnavailable
from tests.sentencepiece_models import train_sentencepiece_models

from .megatron_lm import DROP_IN, Run, check_sources, prepare_tree, run_pretrain

VARIANTS = ("patched", "drop-in")


def pytest_configure(config):
    """No Megatron-LM sources for a tag: stop here, in one line, before any test runs."""
    try:
        check_sources()
    except SourceUnavailable as missing:
        pytest.exit(str(missing), returncode=UNAVAILABLE_EXIT)


class Trainer:
    """Runs one pretrain script (the patched pretrain_gpt.py, or the drop-in from a clean tree)
    and keeps each named run, so tests that look at the same run share it."""

    def __init__(self, variant: str, tree: Path, script: Path, workdir: Path) -> None:
        self.variant, self.tree, self.script, self.workdir = variant, tree, script, workdir
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
            made[key] = Trainer(variant, tree, script, base)
        return made[key]

    return get


@pytest.fixture(scope="session")
def sentencepiece_models(tmp_path_factory) -> Dict[str, str]:
    return train_sentencepiece_models(tmp_path_factory.mktemp("sentencepiece"))
