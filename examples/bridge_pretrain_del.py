"""Pretrain with DEL through Megatron-Bridge 0.6 (a recipe-style script).

A Bridge recipe builds the ConfigContainer (model provider instance, data, optimizer,
checkpointing); one call turns DEL on with the digit ids of the recipe's tokenizer, and Bridge's
own pretrain() runs with del_megatron's forward step (telemetry, step-wide digit reduction).
Checkpoints are ordinary Bridge checkpoints: `load_megatron_model` and AutoBridge's HF export
treat them exactly as a cross-entropy run's.

    # Qwen2.5-0.5B recipe, mock data, DEL on (GPU; the tokenizer is fetched from the HF Hub)
    torchrun --nproc-per-node 1 examples/bridge_pretrain_del.py --alpha 0.01

    # a tiny Qwen2-class model from a local config, mock data, 20 iterations
    torchrun --nproc-per-node 1 examples/bridge_pretrain_del.py --tiny \\
        --tokenizer /path/to/hf_tokenizer_dir --train-iters 20

    # CPU, from the repository root: build everything and stop before pretrain() (Bridge's
    # training loop needs CUDA); without Transformer Engine installed, --dry-run imports
    # Bridge with the tests' TE placeholder (tests/bridge_workers.py)
    python examples/bridge_pretrain_del.py --tiny --tokenizer /path/to/dir --dry-run

The tokenizer must split numbers one digit per token (Qwen2.5, Llama-2, Mistral, DeepSeek);
the recipe's default NullTokenizer has no digits, so a Hugging Face tokenizer replaces it.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from del_megatron.loss import LOSSES

    parser.add_argument("--loss", default="del", choices=list(LOSSES))
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--reduction", default="token", choices=["token", "digit"])
    parser.add_argument(
        "--tokenizer",
        default="Qwen/Qwen2.5-0.5B",
        help="Hugging Face tokenizer: a Hub id or a local folder (must split digits)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2-class model, no download")
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--save", default=None, help="checkpoint folder (recipe default if unset)")
    parser.add_argument(
        "--dry-run", action="store_true", help="set everything up, print it, skip pretrain()"
    )
    return parser.parse_args(argv)


def tiny_provider():
    """A 2-layer, hidden-64 Qwen2-class provider from a local HF config (no download), the way
    recipes make theirs: AutoBridge -> to_megatron_provider()."""
    from megatron.bridge import AutoBridge
    from transformers import Qwen2Config

    hf_config = Qwen2Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )
    return AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)


def build_config(args: argparse.Namespace):
    from megatron.bridge.recipes.qwen.qwen2 import qwen25_500m_pretrain_config

    if args.tiny:
        from megatron.bridge.recipes.common import _pretrain_common

        cfg = _pretrain_common()
        cfg.model = tiny_provider()
        cfg.model.seq_length = args.seq_length or 128
        cfg.dataset.seq_length = cfg.model.seq_length
        cfg.train.train_iters = args.train_iters or 20
        cfg.train.global_batch_size = 8
        cfg.train.micro_batch_size = 2
        cfg.scheduler.lr_warmup_iters = 2
        cfg.validation.eval_interval = 10
        cfg.validation.eval_iters = 2
        cfg.checkpoint.save_interval = cfg.train.train_iters
        cfg.logger.log_interval = 1
    else:
        cfg = qwen25_500m_pretrain_config()  # mock data unless cfg.dataset.blend is set
        if args.train_iters:
            cfg.train.train_iters = args.train_iters
        if args.seq_length:
            cfg.model.seq_length = cfg.dataset.seq_length = args.seq_length
    if args.save:
        cfg.checkpoint.save = cfg.checkpoint.load = args.save
    # The recipe's NullTokenizer has no digit tokens: use the model family's real tokenizer.
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = args.tokenizer
    cfg.tokenizer.vocab_size = None
    return cfg


def _bridge_without_transformer_engine() -> None:
    """--dry-run on a CPU machine: `import megatron.bridge` reaches a module that imports
    Transformer Engine (LoRA's fused layers); the tests' placeholder stands in for it there."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, root)
        from tests.bridge_workers import without_transformer_engine

        without_transformer_engine()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        _bridge_without_transformer_engine()
    cfg = build_config(args)

    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step

    # One call: digit ids from cfg.tokenizer, settings on the provider instance (not on its
    # dataclass fields, so run_config.yaml stays a plain Bridge config), loss hook registered.
    numerical = enable_numerical_loss(
        cfg, loss=args.loss, alpha=args.alpha, reduction=args.reduction
    )
    print(
        f"DEL: {numerical.loss}, alpha {numerical.alpha}, {numerical.reduction} reduction, "
        f"digit ids {list(numerical.vocab.digit_ids)}, "
        f"decimal points {list(numerical.vocab.decimal_point_ids)}; "
        f"provider {type(cfg.model).__module__}.{type(cfg.model).__qualname__}",
        flush=True,
    )
    if args.dry_run:
        return 0

    from megatron.bridge.training.pretrain import pretrain

    pretrain(cfg, forward_step_func=numerical_forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
