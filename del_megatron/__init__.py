"""del-megatron: the Digit Entropy Loss (and its peers) for Megatron-Core, vocab-parallel.

The math is docs/DEL.md. The loss sits at the top level, by concept: config (NumericalLossConfig,
what a run means), layout (VocabParallelLayout, how the tensors are split over ranks), loss
(numerical_lm_loss, loss_parts, numerical_linear_loss: the public entry), heads (the per-token
terms on the ten digit logits), kernels/ (the vocab-parallel primitive: per-token CE and digit
logits in one pass), sequence (positions under context parallelism and packing), digit_stats
(the digit distribution's sums at digit targets), device (checks on the device, no host sync),
reference (slow fp64 oracles for the tests).

Folders: digits/ (what a tokenizer's numbers are: ids, number runs, slots, a dataset's digit
share), megatron/, automodel/ and cpu/ (the framework glue: Megatron-LM, Megatron-Bridge and
NeMo; NeMo AutoModel; CUDA-less runs), tools/ (the `del-megatron` command, which a training job
never imports). The loss imports no glue and no tools, and the glue no tools
(tests/test_imports.py); `python -m tests.test_imports` prints the graph.
"""

from .digits.numbers import place_weights
from .digits.vocab import DigitVocab
from .layout import VocabParallelLayout
from .loss import (
    LossParts,
    NumericalLossConfig,
    loss_parts,
    numerical_linear_loss,
    numerical_lm_loss,
)

# The one place the version is written: pyproject.toml reads this line without importing the
# package (keep it a plain string literal); tests/test_packaging.py checks CITATION.cff against it.
__version__ = "0.2.0"

__all__ = [
    "DigitVocab",
    "LossParts",
    "NumericalLossConfig",
    "VocabParallelLayout",
    "loss_parts",
    "numerical_linear_loss",
    "numerical_lm_loss",
    "place_weights",
    "__version__",
]
