"""What each stage runs at (GPU sizes, or toy ones for --cpu) and the loss settings it uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from benchmarks import bench_loss

VOCAB = bench_loss.VOCAB  # digits 15..24, decimal point 13
OTHER = 30  # a token id that is no digit and no decimal point
ALPHA = 0.5
# The token reduction's given digit share in the kernel checks (its weight: ALPHA / share a token).
TOKEN_DIGIT_SHARE = 0.5


@dataclass(frozen=True)
class Sizes:
    """What each stage runs at: the GPU sizes, or toy ones for --cpu."""

    tokens: Sequence[int]  # correctness: N 16384 (N x V > 2^31) and an odd N
    vocab: int
    reference_rows: int  # the slice checked against the fp64 reference
    linear_tokens: int
    linear_hidden: int
    speed_cases: Sequence[tuple]  # (tokens, vocab)
    reps: int
    recompile_tokens: Sequence[int]
    integration_iterations: int


GPU_SIZES = Sizes(
    tokens=(16384, 4093),
    vocab=151936,
    reference_rows=256,
    linear_tokens=4096,
    linear_hidden=4096,
    speed_cases=((16384, 151936), (4096, 151936), (16384, 32000)),
    reps=5,
    recompile_tokens=(4096, 4093, 1, 8192),
    integration_iterations=5,
)
CPU_SIZES = Sizes(
    tokens=(256, 129),
    vocab=2000,
    reference_rows=64,
    linear_tokens=128,
    linear_hidden=32,
    speed_cases=((512, 8000),),
    reps=1,
    recompile_tokens=(64, 63, 128),
    integration_iterations=3,
)
