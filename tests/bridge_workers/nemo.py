"""The NeMo check: NeMo 2.7.0's real MaskedTokenLossReduction subclassed by
numerical_loss_reduction, and enable_numerical_loss on NeMo's llm.GPTModel."""

from __future__ import annotations

import json
from typing import Any, Dict

import torch

from .fixtures import ALPHA, del_fields, init_single_rank, llama3_dir, slot_rule_read_back


def check_nemo(out: str) -> None:
    """NeMo 2.7.0's real MaskedTokenLossReduction, subclassed by numerical_loss_reduction: its
    forward (3 values) and reduce on two micro-batches of a tiny Megatron-Core GPTModel with the
    loss hook, and the telemetry reduce logs; plus enable_numerical_loss on NeMo's llm.GPTModel
    when nemo.collections.llm imports."""
    init_single_rank()
    from del_megatron import NumericalLossConfig
    from del_megatron.megatron import register
    from tests.gpt_helpers import GPT_VOCAB, build_gpt

    model = build_gpt(1)
    cfg = NumericalLossConfig(
        loss="del", alpha=ALPHA, vocab=GPT_VOCAB, reduction="token", digit_share=1.0
    )
    for name, value in cfg.to_fields().items():
        setattr(model.config, name, value)
    register(None)
    result = masked_token_loss_reduction(model)
    result.update(enabled_on_a_nemo_module(model, cfg))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def masked_token_loss_reduction(model) -> Dict[str, Any]:
    """numerical_loss_reduction(MaskedTokenLossReduction): forward and reduce on two
    micro-batches of `model` (its config naming DEL, the hook registered), against the fp64
    reference; what it logs; NeMo's own reduce of the same forward results."""
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

    from del_megatron.megatron.nemo import numerical_loss_reduction
    from del_megatron.reference import reference_lm_loss
    from tests.gpt_helpers import GPT_VOCAB, number_batch

    result: Dict[str, Any] = {}
    logged = []
    reduction = numerical_loss_reduction(MaskedTokenLossReduction)(
        log=lambda name, value, **kwargs: logged.append((name, float(value), kwargs))
    )
    micro = []
    ref_ce = ref_term = ref_tokens = ref_digits = 0.0
    for seed in (0, 1):
        tokens, labels, positions = number_batch(2, seed)
        loss_mask = torch.ones(labels.shape)
        loss_mask[0, :3] = 0
        output = model(tokens, positions, None, labels=labels)
        reduction.setup({"loss_mask": loss_mask})  # as MegatronParallel does per micro-batch
        forward_result = reduction(output)
        result.setdefault("forward_len", len(forward_result))
        loss_sum, num_valid, reduced = forward_result
        loss_sum.backward()
        micro.append({k: v for k, v in reduced.items()})
        with torch.no_grad():
            logits = model(tokens, positions, None)  # [b, s, V]
        ce, term = reference_lm_loss(labels, logits.transpose(0, 1), GPT_VOCAB, "del", ALPHA)
        m = loss_mask.double()
        ref_ce += float((ce * m).sum())
        ref_term += float((term * m).sum())
        ref_tokens += float(m.sum())
        is_digit = (labels >= 40) & (labels < 50)
        ref_digits += float((is_digit.double() * m).sum())
    result["forward_keys"] = sorted(micro[0])
    result["loss"] = float(reduction.reduce(micro))
    result["ref_loss"] = (ref_ce + ALPHA * ref_term) / ref_tokens
    result["telemetry"] = {k: float(v) for k, v in reduction.last_telemetry.items()}
    result["ref_telemetry"] = {
        "ce loss": ref_ce / ref_tokens,
        "del term": ref_term / ref_digits,
        "digit share": ref_digits / ref_tokens,
    }
    result["logged"] = [(name, value) for name, value, _ in logged]
    result["plain_reduce"] = float(MaskedTokenLossReduction().reduce(micro))
    return result


def enabled_on_a_nemo_module(model, cfg) -> Dict[str, Any]:
    """enable_numerical_loss on NeMo's llm.GPTModel; where nemo.collections.llm does not import
    (its nemo_run / leptonai imports), on a plain LightningModule holding `model`'s config."""
    from del_megatron.megatron.nemo import enable_numerical_loss
    from tests.gpt_helpers import GPT_VOCAB

    result: Dict[str, Any] = {}
    try:
        from nemo.collections.llm.gpt.model.base import GPTConfig, GPTModel

        module = GPTModel(GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4))
        result["llm_import_error"] = None
    except ImportError as err:
        import lightning.pytorch as pl

        result["llm_import_error"] = str(err)
        module = pl.LightningModule()
        module.config = model.config
    for name in cfg.to_fields():
        if name in vars(module.config):
            delattr(module.config, name)
    enable_numerical_loss(module, vocab=GPT_VOCAB, loss="del", alpha=ALPHA)
    result["enabled"] = {
        "training": type(module._training_loss_reduction).__name__,
        "validation_step": module._validation_loss_reduction.validation_step,
        "val_prefix": module._validation_loss_reduction.log_prefix,
        "config_loss": module.config.numerical_loss,
        "config_digits": module.config.del_digit_token_ids,
    }
    enable_numerical_loss(module, vocab=GPT_VOCAB, loss="digit_ce", alpha=0.38)
    result["control"] = {"loss": module.config.numerical_loss, "alpha": module.config.del_alpha}
    result["chunking"] = nemo_chunking(module)
    return result


def nemo_chunking(module) -> Dict[str, Any]:
    """NeMo's AutoTokenizer on Llama-3.2's tokenizer folder as `module.tokenizer`:
    enable_numerical_loss(module) reads the chunking tokenizer's ids from it."""
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

    from del_megatron.megatron.nemo import enable_numerical_loss

    module.tokenizer = AutoTokenizer(llama3_dir())
    enabled = enable_numerical_loss(module, loss="del", alpha=ALPHA, slot_logits="length")
    return {
        "tokenizer_class": type(module.tokenizer).__name__,
        "text_to_ids_12": list(module.tokenizer.text_to_ids("12")),
        "chunked": enabled.vocab.chunked,
        "config": del_fields(module.config),
        "slot_logits": slot_rule_read_back(module.config),
    }
