"""README.md's Megatron-Bridge block, run as written on a recipe ConfigContainer (the tiny one
examples/bridge_pretrain_del.py --tiny builds); Bridge's pretrain() is recorded, not run (the
continued-pretraining tests run it)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any, Dict

from ..docs_snippets import ROOT, python_blocks


def readme_bridge_block(tokenizer_dir: str) -> Dict[str, Any]:
    """What README's Bridge block did: the settings it put on the provider, and the call it
    made to pretrain()."""
    from del_megatron import NumericalLossConfig
    from del_megatron.megatron import unregister

    spec = importlib.util.spec_from_file_location(
        "bridge_pretrain_del", os.path.join(ROOT, "examples", "bridge_pretrain_del.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cfg = example.build_config(example.parse_args(["--tiny", "--tokenizer", tokenizer_dir]))
    (block,) = [b for b in python_blocks("README.md") if "megatron.bridge" in b]
    calls = []

    def pretrain(config, forward_step_func):
        calls.append((config is cfg, forward_step_func.__qualname__))

    scope = {"cfg": cfg, "pretrain": pretrain, "argparse": argparse}
    exec(compile(block, "README.md", "exec"), scope)
    numerical = NumericalLossConfig.from_fields(cfg.model)
    unregister()
    return {
        "pretrain_calls": calls,
        "loss": numerical.loss,
        "alpha": numerical.alpha,
        "reduction": numerical.reduction,
        "digit_ids": list(numerical.vocab.digit_ids),
    }
