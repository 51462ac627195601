"""Fixtures of the end-to-end stage: Megatron-LM trees (patched or not) and cached runs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from tests.megatron_lm_source import UNAVAILABLE_EXIT, SourceUnavailable
from tests.sentencepiece_models import train_sentencepiece_models

from .megatron_lm import (
    DROP_IN,
    Run,
    applying_patch,
    check_sources,
    heads_for_this_environment,
    prepare_tree,
    run_pretrain,
    tags_for_this_environment,
)

# The chunking-tokenizer run reads Llama-3.2 through Megatron-LM's HuggingFaceTokenizer: it needs
# transformers (the Python 3.12 environment's) and core_v0.19.0 or a user's checkout.
_TAGS = tags_for_this_environment()
collect_ignore = []
if importlib.util.find_spec("transformers") is None or not {"core_v0.19.0", "user"} & set(_TAGS):
    collect_ignore.append("test_chunked_tokenizer.py")
# Megatron-LM's development heads: in the environment whose megatron-core they pair with.
if not heads_for_this_environment():
    collect_ignore.append("test_heads.py")


def variants_for_this_environment() -> tuple:
    """The ways into the plugin the tests run: the patched pretrain_gpt.py and the drop-in;
    for a user's checkout that none of our patches applies to (Megatron-LM's dev branch), the
    drop-in alone, which is the route there."""
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout and applying_patch(Path(checkout), "user") is None:
        print(
            f"MEGATRON_LM_DIR={checkout}: no patch in patches/ applies; the drop-in runs the checks"
        )
        return ("drop-in",)
    return ("patched", "drop-in")


VARIANTS = variants_for_this_environment()
# The script of the checks that run one way in: the patched one where a patch applies.
SCRIPT = VARIANTS[0]
# The drop-in launched from the patched tree, as the Docker image allows: both ways at once.
DROP_IN_OVER_PATCH = "drop-in-over-patch"


def pytest_configure(config):
    """No Megatron-LM sources for a tag: stop here, in one line, before any test runs."""
    try:
        check_sources()
    except SourceUnavailable as missing:
        pytest.exit(str(missing), returncode=UNAVAILABLE_EXIT)


# The drop-in as a module of the installed package (del_megatron/megatron/pretrain_gpt_del.py);
# examples/pretrain_gpt_del.py (DROP_IN) is the same by path.
DROP_IN_MODULE = "del_megatron.megatron.pretrain_gpt_del"


def drop_in_launch(tag: str) -> List[str]:
    """How the drop-in starts at `tag`: at the environment's newest tag as a module, from the
    Megatron-LM tree with del_megatron imported from its install (`torchrun ... -m
    del_megatron.megatron.pretrain_gpt_del`), at the others by path (the example script). Both
    run every drop-in test, so each way is tested end to end without a run more."""
    if tag == tags_for_this_environment()[-1]:
        return ["-m", DROP_IN_MODULE]
    return [str(DROP_IN)]


class Trainer:
    """Runs one pretrain script (the patched pretrain_gpt.py, the drop-in from a clean tree, or
    the drop-in from the patched one) and keeps each named run, so tests that look at the same
    run share it. `launch`: what follows torchrun's (or python's) options, before the flags: the
    script's path, or "-m" and the module."""

    def __init__(
        self,
        variant: str,
        tree: Path,
        launch: List[str],
        workdir: Path,
        env: Optional[Dict[str, str]] = None,
    ) -> None:
        self.variant, self.tree, self.launch, self.workdir = variant, tree, launch, workdir
        self.env = env
        self._runs: Dict[str, Run] = {}

    def path(self, name: str) -> Path:
        return self.workdir / name

    def run(self, name: str, flags: Sequence[str], nproc: int = 2) -> Run:
        if name not in self._runs:
            log = self.workdir / f"{name}.log"
            first, *rest = self.launch  # run_pretrain puts `first` where torchrun takes a script
            self._runs[name] = run_pretrain(self.tree, first, [*rest, *flags], nproc, log, self.env)
        return self._runs[name]


@pytest.fixture(scope="session")
def trainers(tmp_path_factory):
    """trainers(tag, variant) -> Trainer, made once a session (variant: one of VARIANTS, or
    DROP_IN_OVER_PATCH, which shares the patched trainer's tree)."""
    made: Dict[tuple, Trainer] = {}

    def get(tag: str, variant: str) -> Trainer:
        key = (tag, variant)
        if key not in made:
            base = tmp_path_factory.mktemp(f"{tag}-{variant}")
            if variant == DROP_IN_OVER_PATCH:
                tree = get(tag, "patched").tree
            else:
                tree = prepare_tree(tag, base / "src", patched=variant == "patched")
            if variant == "patched":
                launch = [str(tree / "pretrain_gpt.py")]
            else:
                launch = drop_in_launch(tag)
            made[key] = Trainer(variant, tree, launch, base)
        return made[key]

    return get


@pytest.fixture(scope="session")
def sentencepiece_models(tmp_path_factory) -> Dict[str, str]:
    return train_sentencepiece_models(tmp_path_factory.mktemp("sentencepiece"))
