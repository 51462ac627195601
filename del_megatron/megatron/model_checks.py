"""The checks of a model the loss is computed for: its config (support.check_settings), once
per model and registration, and the log line saying which fused cross-entropy the loss
replaces and at what memory."""

from __future__ import annotations

from typing import Any, Optional

from . import logits_free as lf
from . import settings, state, support

FUSION_NAMES = {
    "native": "Megatron's fused cross-entropy (impl 'native')",
    "te": "Transformer Engine's fused cross-entropy (impl 'te')",
}
FUSION_REPLACED_BY = {
    "native": (
        "Megatron's fused cross-entropy (impl 'native') is replaced by del_megatron's "
        "vocab-parallel CE+digit kernel, which computes the loss in fp32 from the same logits"
    ),
    "te": (
        "Transformer Engine's fused cross-entropy (impl 'te') is replaced by del_megatron's "
        "vocab-parallel CE+digit kernel ('compiled' on CUDA, 'recompute' elsewhere). TE's "
        "kernel writes the gradient over the logits in place; del_megatron's keeps the logits "
        "for backward and writes their gradient into a new buffer, so the loss holds one more "
        "[s, b, V/tp] buffer than TE's (2 bytes a logit in bf16: 4 against TE's 2). "
        "--del-logits-free forms no logits at all"
    ),
}
LOGITS_FREE_REPLACES = (
    "%s is replaced by del_megatron's logits-free loss (--del-logits-free, weight-gradient "
    "route '%s'): the output layer's matmul and the CE+digit passes chunked over tokens, with "
    "no [s, b, V/tp] logits or gradient held (less than the fused kernel's logits buffer)"
)


def fusion_replacement(impl: str, logits_free: Optional[str] = None) -> str:
    """The log line saying what replaces fused cross-entropy `impl`, and at what memory
    (logits_free: the weight-gradient route, None when the loss keeps its logits)."""
    if logits_free is not None:
        return LOGITS_FREE_REPLACES % (FUSION_NAMES[impl], logits_free)
    return FUSION_REPLACED_BY[impl]


def check_model_config(config: Any, logits_free: Optional[str] = None) -> None:
    """Refuse a model config del_megatron cannot train right (support.check_settings; logits_free:
    the weight-gradient route, None when the loss keeps its logits), and log once which fused
    cross-entropy it replaces."""
    support.check_settings(config, logits_free)
    if getattr(config, "cross_entropy_loss_fusion", False):
        impl = getattr(config, "cross_entropy_fusion_impl", "native")
        state.log_once("fusion", "del_megatron: %s", fusion_replacement(impl, logits_free))


def check_model_once(module: Any) -> None:
    """check_model_config for a model the loss hook sees for the first time in this
    registration (its config and logits-free setting; then nothing for it again), and for
    logits-free its output layer: no bias, no MuP logit multiplier, no FSDP- or GTP-sharded
    weight."""
    registration = state.current()
    if registration is None or id(module) in registration.checked_models:
        return
    registration.checked_models[id(module)] = module
    if settings.of_model(module) is None:
        return
    route = lf.route_of(module)
    check_model_config(module.config, route)
    output_layer = getattr(module, "output_layer", None)
    if route is not None and output_layer is not None:
        lf.check_no_logit_scaling(module.config)
        lf.check_no_bias(output_layer)
        if getattr(module, "share_embeddings_and_output_weights", False):
            support.check_sharded_weight(module.shared_embedding_or_output_weight())
        elif getattr(output_layer, "weight", None) is not None:
            support.check_sharded_weight(output_layer.weight)
