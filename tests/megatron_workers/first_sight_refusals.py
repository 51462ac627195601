"""Settings register() could not see, refused the first time the hook sees the model."""

from __future__ import annotations

import pytest

from del_megatron import megatron as dmm

from ..gpt_helpers import build_gpt, number_batch
from .config import CFG
from .logits_free import _refused_by_this_core

# (config field, value, logits_free, what the message names); set on a model's config after it
# is built (TransformerConfig validates some of them against settings a CPU run lacks).
FIRST_SIGHT_REFUSALS = [
    ("cuda_graph_impl", "full_iteration", False, "--cuda-graph-impl full_iteration"),
    ("overlap_moe_expert_parallel_comm", True, False, "--overlap-moe-expert-parallel-comm"),
    ("defer_embedding_wgrad_compute", True, True, "--defer-embedding-wgrad-compute"),
    ("fp16", True, "forward", "--fp16 with --del-logits-free forward"),
    ("gtp_weight_remat_size", 2, True, "gtp_weight_remat_size=2"),  # audit G2
]


def check_refused_when_the_hook_first_sees_the_model(tp: int) -> None:
    """A model config that register() could not see (Bridge providers, NeMo, models built by
    hand) is checked the first time the hook sees the model, before any loss: in its forward,
    or in compute_language_model_loss called outside it (the combined 1F1B schedule's
    post-process, where the message names the flag, not a model class); an output weight FSDP
    shards is refused for logits-free. The check runs once a model, not per call."""
    from del_megatron.megatron import refusals

    tokens, labels, positions = number_batch(2, seed=31)
    for field, value, logits_free, named in FIRST_SIGHT_REFUSALS:
        if logits_free and _refused_by_this_core():
            continue
        model = build_gpt(tp)
        setattr(model.config, field, value)
        logits = build_gpt(tp)(tokens, positions, None).transpose(0, 1).contiguous()
        for call in ("forward", "compute_language_model_loss"):
            dmm.register(CFG, logits_free=logits_free)  # a fresh registration: unchecked
            try:
                with pytest.raises(ValueError, match=named):
                    if call == "forward":
                        model(tokens, positions, None, labels=labels)
                    else:
                        model.compute_language_model_loss(labels, logits)
            finally:
                dmm.unregister()
    if not _refused_by_this_core():
        model = build_gpt(tp)
        model.output_layer.weight.__fsdp_param__ = True  # what Megatron-FSDP marks
        dmm.register(CFG, logits_free=True)
        try:
            with pytest.raises(ValueError, match="sharded by FSDP"):
                model(tokens, positions, None, labels=labels)
        finally:
            dmm.unregister()
        for tied in (False, True):  # audit G2: what GTP weight remat marks (core >= 0.19)
            model = build_gpt(tp, share_embeddings_and_output_weights=tied)
            weight = model.shared_embedding_or_output_weight() if tied else None
            weight = model.output_layer.weight if weight is None else weight
            weight.is_gtp_weight_remat, weight.gtp_remat_size = True, 2
            dmm.register(CFG, logits_free=True)
            try:
                with pytest.raises(ValueError, match="GTP weight-remat shard"):
                    model(tokens, positions, None, labels=labels)
            finally:
                dmm.unregister()
    calls, check = [], refusals.check_megatron_settings
    refusals.check_megatron_settings = lambda *args: calls.append(args) or check(*args)
    model = build_gpt(tp)
    dmm.register(CFG)
    try:
        for _ in range(3):
            model(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()
        refusals.check_megatron_settings = check
    assert len(calls) == 1, calls
