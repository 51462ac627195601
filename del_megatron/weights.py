"""Range checks for the numbers that set how much a loss weighs: one rule for every entry
(NumericalLossConfig, Megatron-LM's flags, Bridge, NeMo, the CLI, the demo and compare).

A weight is any real number (int, float, a numpy scalar, a 0-d tensor) that is finite and >= 0;
a digit share is finite and in (0, 1]; a learning rate is finite and > 0 (a final learning rate
may be 0). All come back as a Python float.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

# The one default of alpha (--del-alpha, NumericalLossConfig, Bridge's and NeMo's
# enable_numerical_loss): the weight the DEL paper wrote and applied in its CodeLlama and
# Mistral-7B runs (docs/DEL.md, "The weight the paper's runs applied").
DEFAULT_ALPHA = 0.1


def _real(value: Any, name: str) -> float:
    item = getattr(value, "item", None)
    if not isinstance(value, numbers.Real) and callable(item):
        try:  # a 0-d tensor or array
            value = item()
        except (ValueError, RuntimeError):
            raise TypeError(f"{name} must be one real number, got {value!r}") from None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def check_weight(value: Any, name: str = "alpha") -> float:
    """`value` as a float, if it is a finite number >= 0; ValueError / TypeError naming `name`."""
    weight = _real(value, name)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(
            f"{name} must be a finite number >= 0, got {value!r} (a negative weight trains "
            "against the target)"
        )
    return weight


def check_digit_share(value: Any, name: str = "digit_share") -> float:
    """`value` as a float, if it is a finite share in (0, 1]."""
    share = _real(value, name)
    if not math.isfinite(share) or not 0 < share <= 1:
        raise ValueError(
            f"{name} must be the share of loss tokens that are digit targets, a number in "
            f"(0, 1], got {value!r} (`del-megatron check --data-path PREFIX` measures it)"
        )
    return share


def check_learning_rate(value: Any, name: str = "lr", allow_zero: bool = False) -> float:
    """`value` as a float, if it is a finite number > 0 (>= 0 with allow_zero: a final rate)."""
    rate = _real(value, name)
    if not math.isfinite(rate) or rate < 0 or (rate == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite learning rate {bound}, got {value!r}")
    return rate
