"""del-megatron: the Digit Entropy Loss (and its peers) for Megatron-Core, vocab-parallel.

The math is docs/DEL.md. Modules, each importing only those before it (calls and
TYPE_CHECKING included): number_tokens, tokenizers (digit ids of real tokenizers), vocab
(DigitVocab), sequence (CP / packed positions) | kernels/ (the vocab-parallel primitive),
numbers (place weights), heads (per-token terms), reference (slow oracles), preflight | loss
(the public entry) | megatron/ (framework glue), cpu/ | demo/ | cli.
`python -m tests.test_imports` prints the graph.
"""

from .loss import (
    LossParts,
    NumericalLossConfig,
    loss_parts,
    numerical_linear_loss,
    numerical_lm_loss,
)
from .numbers import place_weights
from .vocab import DigitVocab

# The one place the version is written: pyproject.toml reads this line without importing the
# package (keep it a plain string literal); tests/test_packaging.py checks CITATION.cff against it.
__version__ = "0.2.0"

__all__ = [
    "DigitVocab",
    "LossParts",
    "NumericalLossConfig",
    "loss_parts",
    "numerical_linear_loss",
    "numerical_lm_loss",
    "place_weights",
    "__version__",
]
