"""Bridge's other ways to a model config: the ModelConfig path (GPTModelConfig +
GPTModelBuilder), a recipe ConfigContainer with FSDP switched on, a recipe naming a chunking
tokenizer."""

from __future__ import annotations

from typing import Any, Dict

from tests.cases import TOKEN_FORM

from .fixtures import (
    ALPHA,
    SEQ,
    VOCAB,
    batches,
    del_fields,
    llama3_dir,
    reference_parts,
    slot_rule_read_back,
    tiny_hf_config,
    tiny_provider,
)


def model_config_path(state, tokenizer, vocab) -> Dict[str, Any]:
    """Bridge's ModelConfig path (GPTModelConfig + GPTModelBuilder, which builds
    GPTModel(config=model_config.transformer)). DEL fields set on the outer config never reach
    the model: numerical_forward_step refuses it. enable_numerical_loss(model_config, ...) puts
    them on .transformer: the built model runs DEL (loss checked against the reference)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.models.gpt import GPTModelConfig

    from del_megatron.megatron import register
    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step

    report: Dict[str, Any] = {}

    def build(outer_fields: bool):
        transformer = TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            use_cpu_initialization=True,
            hidden_dropout=0.0,  # forward_step and the reference forward see the same model
            attention_dropout=0.0,
        )
        model_config = GPTModelConfig(
            transformer=transformer,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            seq_length=SEQ,
        )
        if outer_fields:  # what a user might write: lands on the outer config only
            model_config.numerical_loss = "del"
            model_config.del_digit_token_ids = list(vocab.digit_ids)
        else:
            enable_numerical_loss(model_config, tokenizer, loss="del", alpha=ALPHA, **TOKEN_FORM)
        builder = model_config.get_builder_cls()(model_config)
        return builder.build_model(ProcessGroupCollection.use_mpu_process_groups())

    model = build(outer_fields=True)
    register(None)
    report["outer_reaches_model"] = hasattr(model.config, "numerical_loss")
    (batch,) = batches(1, seed=3)
    try:
        numerical_forward_step(state, iter([dict(batch)]), model)
        report["outer_refused"] = None
    except RuntimeError as err:
        report["outer_refused"] = str(err)
    model = build(outer_fields=False)
    output, loss_function = numerical_forward_step(state, iter([dict(batch)]), model)
    loss_sum, _, _ = loss_function(output)
    ref = reference_parts(model, batch, vocab)
    mask = batch["loss_mask"].double()
    report["loss_sum"] = float(loss_sum)
    report["ref_loss_sum"] = float(((ref["ce"] + ALPHA * ref["term"]) * mask).sum())
    return report


def logits_free_under_fsdp(provider, tokenizer) -> Dict[str, Any]:
    """enable_numerical_loss(ConfigContainer, logits_free=True) on a real recipe ConfigContainer
    with each of Bridge's FSDP switches (cfg.ddp.use_megatron_fsdp, cfg.dist.use_megatron_fsdp,
    cfg.dist.use_torch_fsdp2): the refusal's message, and whether the provider was left as it
    was; without FSDP the same call is accepted."""
    from megatron.bridge.recipes.common import _pretrain_common

    from del_megatron.megatron.bridge import enable_numerical_loss

    report: Dict[str, Any] = {}
    for where in ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp", "dist.use_torch_fsdp2", None):
        cfg = _pretrain_common()
        cfg.model = provider
        if where is not None:
            section, field = where.split(".")
            setattr(getattr(cfg, section), field, True)
        before = getattr(provider, "del_logits_free", None)
        try:
            enable_numerical_loss(cfg, tokenizer, loss="del", alpha=ALPHA, logits_free=True)
            report[str(where)] = {"refused": None}
        except ValueError as err:
            report[str(where)] = {"refused": str(err)}
        after = getattr(provider, "del_logits_free", None)
        report[str(where)]["provider_unchanged"] = after == before
        report[str(where)]["logits_free_after"] = after
    return report


def chunking_recipe() -> Dict[str, Any]:
    """A recipe ConfigContainer whose TokenizerConfig names Llama-3.2's tokenizer (chunks of up
    to three digits), with a provider of Llama-3.2's vocab size: enable_numerical_loss(cfg)
    builds the tokenizer with Bridge's build_tokenizer and puts its ids on the provider."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    from del_megatron.megatron import unregister
    from del_megatron.megatron.bridge import enable_numerical_loss

    tok_cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=llama3_dir())
    cfg = _pretrain_common()
    cfg.model = tiny_provider(AutoBridge.from_hf_config(tiny_hf_config(vocab_size=128256)))
    cfg.tokenizer = tok_cfg
    enabled = enable_numerical_loss(cfg, loss="del", alpha=ALPHA, slot_logits="length")
    unregister()
    tokenizer = build_tokenizer(tok_cfg)
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "tokenized_12": list(tokenizer.tokenize("12")),
        "bos": tokenizer.bos,
        "chunked": enabled.vocab.chunked,
        "provider": del_fields(cfg.model),
        "slot_logits": slot_rule_read_back(cfg.model),
    }
