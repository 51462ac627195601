"""del-megatron: the Digit Entropy Loss (and its peers) for Megatron-Core, vocab-parallel."""

from .loss import LossParts, NumericalLossConfig, numerical_linear_loss, numerical_lm_loss
from .numbers import place_weights
from .vocab import DigitVocab

__version__ = "0.1.0"

__all__ = [
    "DigitVocab",
    "LossParts",
    "NumericalLossConfig",
    "numerical_linear_loss",
    "numerical_lm_loss",
    "place_weights",
    "__version__",
]
