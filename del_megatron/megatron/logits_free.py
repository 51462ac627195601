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

import functools
import inspect
from typing import Any, Optional, Union

import torch

from ..kernels.linear import WEIGHT_GRADIENTS, WeightGradientSink
from . import capture
from . import registration as reg

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

    return takes_output_processor(capture.original_forward(GPTModel))


def check_core_supports() -> None:
    """Refuse, before any training, a megatron-core whose GPTModel has no output_processor."""
    if not core_supports():
        raise ValueError(
            f"--del-logits-free needs megatron-core >= {MIN_CORE[0]}.{MIN_CORE[1]} (GPTModel's "
            f"output_processor hook); this is megatron-core {core_version()}. Upgrade "
            "megatron-core, or train without --del-logits-free (the loss is the same)"
        )


def check_model_supports(model: Any, forward_takes_output_processor: bool) -> None:
    """Refuse a model whose forward takes no output_processor (e.g. Mamba/hybrid)."""
    if not forward_takes_output_processor:
        raise ValueError(_no_output_processor(type(model).__qualname__))


def check_model_class_supports(model_class: type) -> None:
    """The same refusal from the model's class, before any model is built (the hybrid
    scripts' HybridModel and MambaModel)."""
    if not takes_output_processor(capture.original_forward(model_class)):
        raise ValueError(_no_output_processor(model_class.__qualname__))


def _no_output_processor(name: str) -> str:
    return (
        f"{name}.forward takes no output_processor, so it cannot run the loss logits-free "
        f"(GPTModel on megatron-core >= {MIN_CORE[0]}.{MIN_CORE[1]} can); turn "
        "del_logits_free / --del-logits-free off"
    )


def check_no_bias(output_layer: Any) -> None:
    if getattr(output_layer, "bias", None) is not None:
        raise ValueError(
            "the output layer has a bias, which the logits-free loss does not add; build the "
            "model without one (Megatron's GPT output layer has none) or drop --del-logits-free"
        )


def output_weight(output_layer: Any, shared_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """[V/tp, h]: the weight the output layer would multiply by (the embedding's when tied)."""
    weight = shared_weight if shared_weight is not None else output_layer.weight
    if weight is None:
        raise ValueError("the output layer has no weight and none was passed to it")
    return weight


def logit_dtype(model: Any, output_layer: Any) -> Optional[torch.dtype]:
    """The dtype the output layer is asked to give its logits in (Megatron-LM dev:
    ColumnParallelLinear's output_dtype, from GPTModel's logit_dtype, --output-logit-dtype);
    None: the input's dtype."""
    dtype = getattr(output_layer, "output_dtype", None)
    return dtype if dtype is not None else getattr(model, "logit_dtype", None)


def run_forward_pre_hooks(output_layer: Any, hidden_states: torch.Tensor) -> None:
    """Run the output layer's own forward pre-hooks, as calling the layer would, before the
    logits-free loss reads its weight. Megatron's DDP waits there for the weight's all-gather
    under --overlap-param-gather (and dispatches the next bucket's); skipped, the weight would
    be read mid-gather and the next step would stop on `param_gather_handle is None`. A hook
    that would replace the layer's input is refused: the logits-free loss could not apply it."""
    args = (hidden_states,)
    for key, hook in list(output_layer._forward_pre_hooks.items()):
        if key in output_layer._forward_pre_hooks_with_kwargs:
            result = hook(output_layer, args, {})
        else:
            result = hook(output_layer, args)
        if result is not None:
            name = getattr(hook, "__qualname__", repr(hook))
            raise ValueError(
                f"the output layer's forward pre-hook {name} changes the layer's input, which "
                "the logits-free loss cannot apply; drop --del-logits-free or that hook"
            )


def main_grad_sink(output_layer: Any, weight: torch.Tensor) -> Optional[WeightGradientSink]:
    """Megatron's gradient-accumulation fusion, on the logits-free route (None when the output
    layer does not use it, or the weight has no main_grad: then autograd carries the gradient).

    With fusion, Megatron's output layer adds its weight gradient straight into the fp32
    `weight.main_grad` (formed in fp32) and, when DDP tracks the weight
    (`grad_added_to_main_grad`), sets that flag and returns a placeholder gradient: zeros when
    the weight is shared on this stage (`zero_out_wgrad`, the embedding under MTP or tied
    weights), else uninitialised; without DDP it returns None. DDP's hook then skips
    `param.grad` for a flagged weight, so a real gradient returned beside an MTP head's
    placeholder would be dropped. The logits-free loss follows the same protocol."""
    # Megatron's own layers name the switch gradient_accumulation_fusion, Transformer Engine's
    # (TELMHeadColumnParallelLinear, the output layer under MXFP8) fuse_wgrad_accumulation.
    fused = getattr(output_layer, "gradient_accumulation_fusion", False) or getattr(
        output_layer, "fuse_wgrad_accumulation", False
    )
    if not fused:
        return None
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return None
    return WeightGradientSink(weight, main_grad, functools.partial(_fused_placeholder, weight))


def _fused_placeholder(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """What Megatron's fused weight-gradient path returns for `weight` once it has added the
    gradient to main_grad (tensor_parallel/layers.py), flag included."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    placeholder = make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    weight.grad_added_to_main_grad = True
    return placeholder


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


def route_of(model: Any) -> Optional[str]:
    """The weight-gradient route of `model`'s logits-free loss: the current registration's
    setting (first) or `model`'s config field; None when neither asks for it (or nothing is
    registered)."""
    registration = reg.current()
    if registration is None:
        return None
    route = weight_gradient_of(registration.logits_free)
    if route is None:
        config = getattr(model, "config", None)
        route = weight_gradient_of(getattr(config, FIELD_LOGITS_FREE, False))
    return route
