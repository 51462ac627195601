"""What the logits-free route needs from Megatron-Core, checked: GPTModel's output_processor hook
(megatron-core >= 0.18), an output layer without bias, no MuP output multiplier, and which weight
the output layer would have used.

With --del-logits-free (Registration.logits_free, or the model-config field del_logits_free) the
loss hook hands GPTModel.forward an output_processor when labels are given. It runs the output
layer's matmul and the numerical loss chunked over tokens (numerical_linear_loss), so the
[s, b, V/tp] logits of the main head never exist. Calls without labels (inference, generation)
get Megatron's own output layer and logits. MTP heads keep their materialised logits (they go
through the loss hook, exact either way). The setting is True ("auto") or the name of the
weight gradient's route ("forward", "backward"; kernels/linear.py).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Union

import torch

from ..kernels.linear import WEIGHT_GRADIENTS

MIN_CORE = (0, 18)
FIELD_LOGITS_FREE = "del_logits_free"


def core_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return "unknown"
    return __version__


def takes_output_processor(forward) -> bool:
    return "output_processor" in inspect.signature(forward).parameters


def core_supports() -> bool:
    """Whether this megatron-core's GPTModel.forward (unwrapped) takes an output_processor."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return takes_output_processor(getattr(GPTModel, "_del_megatron_forward", GPTModel.forward))


def check_core_supports() -> None:
    """Refuse, before any training, a megatron-core whose GPTModel has no output_processor."""
    if not core_supports():
        raise ValueError(
            f"--del-logits-free needs megatron-core >= {MIN_CORE[0]}.{MIN_CORE[1]} (GPTModel's "
            f"output_processor hook); this is megatron-core {core_version()}. Upgrade "
            "megatron-core, or train without --del-logits-free (the loss is the same)"
        )


def check_model_supports(model: Any, forward_takes_output_processor: bool) -> None:
    """Refuse a model class whose forward takes no output_processor (e.g. Mamba/hybrid)."""
    if not forward_takes_output_processor:
        raise ValueError(
            f"{type(model).__qualname__}.forward takes no output_processor, so it cannot run "
            "the loss logits-free (GPTModel on megatron-core >= "
            f"{MIN_CORE[0]}.{MIN_CORE[1]} can); turn del_logits_free / --del-logits-free off"
        )


def output_weight(output_layer: Any, shared_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """[V/tp, h]: the weight the output layer would multiply by (the embedding's when tied)."""
    if getattr(output_layer, "bias", None) is not None:
        raise ValueError(
            "the output layer has a bias, which the logits-free loss does not add; build the "
            "model without one (Megatron's GPT output layer has none) or drop --del-logits-free"
        )
    weight = shared_weight if shared_weight is not None else output_layer.weight
    if weight is None:
        raise ValueError("the output layer has no weight and none was passed to it")
    return weight


def check_no_logit_scaling(config: Any) -> None:
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        raise ValueError(
            f"MuP scales the logits by mup_output_mult={config.mup_output_mult}, which the "
            "logits-free loss does not apply; drop --del-logits-free or MuP's output multiplier"
        )


def weight_gradient_of(setting: Union[bool, str, None]) -> Optional[str]:
    """The weight-gradient route a logits-free setting asks for: None (off) for False/None,
    "auto" for True, else the route it names; anything else is refused."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return "auto"
    if isinstance(setting, str) and setting in WEIGHT_GRADIENTS:
        return setting
    raise ValueError(
        f"logits_free must be True, False or a weight-gradient route {WEIGHT_GRADIENTS}, "
        f"got {setting!r}"
    )


def set_on_model_config(config: Any, setting: Union[bool, str]) -> None:
    """Record the choice (True, False or a route) on a model config as a plain attribute
    (Bridge and NeMo serialise dataclass fields only); refuse it on a core without
    output_processor."""
    if weight_gradient_of(setting) is not None:
        check_core_supports()
    object.__setattr__(config, FIELD_LOGITS_FREE, setting)
