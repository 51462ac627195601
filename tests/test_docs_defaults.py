"""The defaults the user docs quote are the code's: each is defined once in the kernels, and the
docs' numbers are held to it here."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from del_megatron.kernels.linear import (
    LINEAR_CHUNK_BYTES,
    LINEAR_MIN_CHUNKS,
    resolve_weight_gradient,
)
from del_megatron.kernels.recompute import EAGER_CHUNK_BYTES

DOCS = Path(__file__).resolve().parent.parent / "docs"
FRACTIONS = {8: "an eighth"}


def _text(name: str) -> str:
    return re.sub(r"\s+", " ", (DOCS / name).read_text())


def test_chunk_sizes_in_the_docs_are_the_kernels():
    eager = f"{EAGER_CHUNK_BYTES // 2**20} MiB"
    performance = _text("performance.md")
    assert f"eager, {eager} of fp32 rows at a time" in performance
    assert f"in their {eager} chunks" in performance
    linear = (
        f"as many rows as {LINEAR_CHUNK_BYTES // 2**20} MiB of fp32 logits hold, and at most "
        f"{FRACTIONS[LINEAR_MIN_CHUNKS]} of the tokens"
    )
    assert linear in _text("internals.md")


def test_the_bf16_route_threshold_in_the_docs_is_the_rule():
    assert "`h <= N/8` in bf16" in _text("api.md")
    hidden, vocab = 64, 1 << 20  # V/tp far above 1.5 N: only h <= N/8 keeps "forward"
    for tokens, route in ((8 * hidden, "forward"), (8 * hidden - 8, "backward")):
        assert resolve_weight_gradient("auto", tokens, vocab, hidden, torch.bfloat16) == route
