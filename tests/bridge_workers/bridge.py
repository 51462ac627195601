"""The Bridge check: the recipe flow through the real GPTModelProvider, gpt_step.forward_step,
Bridge's checkpoints and its other config paths, one result a part."""

from __future__ import annotations

import json
import tempfile
from typing import Any, Dict

from del_megatron.cpu.bridge import without_transformer_engine

from .checkpoints import export_round_trip, run_config_round_trip
from .configs import chunking_recipe, logits_free_under_fsdp, model_config_path
from .fixtures import (
    ALPHA,
    batches,
    digit_tokenizer_dir,
    global_state,
    init_single_rank,
    tiny_hf_config,
    tiny_provider,
)
from .forward_step import (
    digit_reduction_step,
    logits_free_token_reduction,
    refused_without_registration,
    token_reduction,
)
from .readme import readme_bridge_block


def check_bridge(out: str) -> None:
    """The recipe flow through the real GPTModelProvider, gpt_step.forward_step and
    run_config.yaml round trip; results to `out` for the test to compare."""
    without_transformer_engine()
    init_single_rank(training_runtime=True)
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    from del_megatron.megatron.bridge import enable_numerical_loss

    result: Dict[str, Any] = {}
    folder = tempfile.mkdtemp()
    tok_cfg = TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=digit_tokenizer_dir(folder)
    )
    tokenizer = build_tokenizer(tok_cfg)
    result["tokenizer_digit_ids"] = [tokenizer.tokenize(str(d))[0] for d in range(10)]

    bridge = AutoBridge.from_hf_config(tiny_hf_config())
    provider = tiny_provider(bridge)
    result["provider_class"] = f"{type(provider).__module__}.{type(provider).__qualname__}"
    cfg = enable_numerical_loss(
        provider, tokenizer, loss="del", alpha=ALPHA, reduction="token", digit_share=1.0
    )
    result["digit_ids"] = list(cfg.vocab.digit_ids)
    result["point_ids"] = list(cfg.vocab.decimal_point_ids)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    state = global_state(provider)

    (batch,) = batches(1)
    result["token"] = token_reduction(state, model, batch, cfg.vocab)
    result["logits_free"] = logits_free_token_reduction(state, model, batch, provider, tokenizer)
    result["digit"], result["stacked"], result["digit_ce"] = digit_reduction_step(
        state, model, provider, tokenizer, cfg.vocab
    )
    result["refused_without_registration"] = refused_without_registration(state, model, batch)
    result["run_config"] = run_config_round_trip(state, tok_cfg, folder)
    result["export"] = export_round_trip(bridge, model, folder)
    result["model_config"] = model_config_path(state, tokenizer, cfg.vocab)
    result["fsdp"] = logits_free_under_fsdp(provider, tokenizer)
    result["chunking"] = chunking_recipe()
    result["readme"] = readme_bridge_block(digit_tokenizer_dir(tempfile.mkdtemp()))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
