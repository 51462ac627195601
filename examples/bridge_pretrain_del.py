"""Pretrain or continue pretraining with DEL through Megatron-Bridge 0.6 (a recipe-style script).

A ConfigContainer (model provider instance, data, optimizer, checkpointing) is built; one call
turns DEL on with the digit ids of its tokenizer, and Bridge's own pretrain() or finetune()
runs with del_megatron's forward step (telemetry, step-wide digit reduction). Checkpoints are
ordinary Bridge checkpoints: examples/bridge_convert.py exports them to Hugging Face exactly as
a cross-entropy run's. docs/continued-pretraining.md walks the whole path.

    # continued pretraining from a Hugging Face model converted with bridge_convert.py import:
    # Bridge's finetune() loads the weights (no optimizer state, iteration 0), then resumes
    # from --save on a restart; it refuses to start without a checkpoint
    torchrun --nproc-per-node 8 examples/bridge_pretrain_del.py --hf-model Qwen/Qwen2.5-0.5B \\
        --pretrained-checkpoint /ckpt/qwen25-0.5b-megatron \\
        --data-path /data/numbers_text_document --save /ckpt/qwen25-del \\
        --train-iters 2000 --alpha 0.1

    # Qwen2.5-0.5B recipe from random weights, mock data (the tokenizer from the HF Hub)
    torchrun --nproc-per-node 1 examples/bridge_pretrain_del.py --alpha 0.1

    # score a checkpoint (CE- or DEL-trained, --loss ce or del): the training run's command
    # with --load <its --save> and --skip-train, here the continued-pretraining run's. Bridge
    # loads the latest checkpoint, prints its evaluation on the validation and test sets
    # ("validation loss at iteration N on validation set | ce loss value: ... | digit acc
    # value: ... |") and exits. It reads the validation batches of the run's first validation:
    # a run given --eval-interval above --train-iters validates once, after its last (saved)
    # iteration, and logged these same numbers.
    torchrun --nproc-per-node 8 examples/bridge_pretrain_del.py --hf-model Qwen/Qwen2.5-0.5B \\
        --pretrained-checkpoint /ckpt/qwen25-0.5b-megatron \\
        --data-path /data/numbers_text_document --load /ckpt/qwen25-del \\
        --train-iters 2000 --alpha 0.1 --skip-train

    # a tiny Qwen2-class model from a local config, built and printed, pretrain() not run
    python examples/bridge_pretrain_del.py --tiny --tokenizer /path/to/hf_tokenizer_dir --dry-run

--cpu runs on a machine without CUDA (gloo, fp32, Megatron-Core's local layers; Bridge's CPU
runtime, del_megatron.cpu.bridge): a smoke test of the path with a tiny model, not for training.
The tokenizer must split numbers one digit per token (Qwen2.5, Llama-2, Mistral, DeepSeek).
"""

from __future__ import annotations

import argparse
import sys

from del_megatron.config import DEFAULT_ALPHA


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from del_megatron.loss import LOSSES

    parser.add_argument("--loss", default="del", choices=list(LOSSES))
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    parser.add_argument("--reduction", default="digit", choices=["digit", "token"])
    parser.add_argument(
        "--digit-share",
        type=float,
        default=None,
        help="with --reduction token: the data's share of digit targets (del-megatron check "
        "--data-path prints it)",
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hf-model", help="Hugging Face model (Hub id or folder): architecture")
    model.add_argument("--tiny", action="store_true", help="tiny Qwen2-class model, no download")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer (Hub id or folder; must split digits); default: --hf-model's, "
        "else Qwen/Qwen2.5-0.5B",
    )
    parser.add_argument(
        "--pretrained-checkpoint",
        help="Megatron checkpoint of --hf-model (bridge_convert.py import): start from its weights "
        "with Bridge's finetune()",
    )
    parser.add_argument("--data-path", help="Megatron indexed dataset prefix (default: mock data)")
    parser.add_argument(
        "--save", default=None, help="checkpoint folder, resumed from if it has one"
    )
    parser.add_argument("--save-interval", type=int, default=None)
    parser.add_argument(
        "--load",
        default=None,
        help="checkpoint folder to start from (default: --save's); nothing is written there "
        "unless it is also --save",
    )
    parser.add_argument(
        "--skip-train",
        action="store_true",
        help="with --load: score its latest checkpoint, i.e. Bridge's evaluation on the "
        "validation and test sets, no training (give the training run's other flags)",
    )
    parser.add_argument("--eval-interval", type=int, default=None)
    parser.add_argument("--eval-iters", type=int, default=None)
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--cpu", action="store_true", help="no CUDA: gloo, fp32, local layers")
    parser.add_argument(
        "--dry-run", action="store_true", help="set everything up, print it, skip training"
    )
    args = parser.parse_args(argv)
    if args.skip_train and not (args.load or args.save):
        parser.error("--skip-train needs --load (the checkpoint folder to score)")
    if args.pretrained_checkpoint and not args.hf_model:
        parser.error("--pretrained-checkpoint needs --hf-model (the model it was converted from)")
    return args


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


def hf_provider(path: str):
    """The provider of a Hugging Face model's architecture; the weights come from the converted
    checkpoint (--pretrained-checkpoint), loaded by Bridge's checkpointing."""
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=False)


def build_config(args: argparse.Namespace):
    from megatron.bridge.recipes.common import _pretrain_common

    if args.tiny or args.hf_model:
        cfg = _pretrain_common()
        cfg.model = tiny_provider() if args.tiny else hf_provider(args.hf_model)
        cfg.model.seq_length = args.seq_length or (128 if args.tiny else cfg.model.seq_length)
        cfg.train.train_iters = 20
        cfg.train.global_batch_size = 8
        cfg.train.micro_batch_size = 2
        cfg.scheduler.lr_warmup_iters = 2
        cfg.validation.eval_interval = 10
        cfg.validation.eval_iters = 2
        cfg.logger.log_interval = 1
    else:
        from megatron.bridge.recipes.qwen.qwen2 import qwen25_500m_pretrain_config

        cfg = qwen25_500m_pretrain_config()
    if args.seq_length:
        cfg.model.seq_length = args.seq_length
    cfg.dataset.seq_length = cfg.model.seq_length
    cfg.model.tensor_model_parallel_size = args.tp
    for name in ("train_iters", "global_batch_size", "micro_batch_size"):
        if getattr(args, name) is not None:
            setattr(cfg.train, name, getattr(args, name))
    if args.lr is not None:
        cfg.optimizer.lr = args.lr
        cfg.optimizer.min_lr = args.lr / 10
    if cfg.train.train_iters < cfg.scheduler.lr_warmup_iters * 2:
        cfg.scheduler.lr_warmup_iters = 0
    if args.save_interval or args.tiny or args.hf_model:
        cfg.checkpoint.save_interval = args.save_interval or cfg.train.train_iters
    if args.save:
        cfg.checkpoint.save = cfg.checkpoint.load = args.save
    if args.load:
        cfg.checkpoint.load = args.load
    for name in ("eval_interval", "eval_iters"):
        if getattr(args, name) is not None:
            setattr(cfg.validation, name, getattr(args, name))
    if args.pretrained_checkpoint:
        cfg.checkpoint.pretrained_checkpoint = args.pretrained_checkpoint
    if args.data_path:  # one indexed dataset, 98/1/1 train/validation/test
        cfg.dataset.blend = [[args.data_path], None]
        cfg.dataset.split = "98,1,1"
    # The recipe's NullTokenizer has no digit tokens: use the model family's real tokenizer.
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = args.tokenizer or args.hf_model or "Qwen/Qwen2.5-0.5B"
    cfg.tokenizer.vocab_size = None
    if args.hf_model:  # the model's (padded) vocabulary, as in the converted checkpoint
        cfg.tokenizer.use_tokenizer_vocab_size = False
    if args.cpu:  # gloo, fp32, Megatron-Core's local layers, no fusions
        from del_megatron.cpu.bridge import cpu_config

        cpu_config(cfg)
    if args.skip_train:
        score_only(cfg)
    return cfg


def score_only(cfg) -> None:
    """--skip-train: Bridge's pretrain()/finetune() load cfg.checkpoint.load, run Bridge's
    evaluation (validation, then test) and exit. Under skip_train Bridge builds the validation
    loader from sample 0 with cfg.dataset.dataloader_type, where a training run's validation
    loader is always the shuffled "cyclic" one for a GPT dataset
    (megatron/bridge/data/loaders.py): the scoring run gets that sampler, so it reads the
    batches of a training run's first validation (its test loader follows the same setting, so
    its test line reads the test split in that order, not in the training run's). A folder
    without a checkpoint is refused (Bridge would evaluate the untrained model)."""
    from megatron.bridge.training.config import GPTDatasetConfig
    from megatron.bridge.training.utils.checkpoint_utils import checkpoint_exists

    if not checkpoint_exists(cfg.checkpoint.load):
        raise SystemExit(f"--skip-train: no checkpoint in {cfg.checkpoint.load}")
    cfg.validation.skip_train = True
    if isinstance(cfg.dataset, GPTDatasetConfig):
        cfg.dataset.dataloader_type = "cyclic"


def _bridge_without_cuda(dry_run: bool) -> None:
    """--cpu / --dry-run on a CPU machine: Bridge imports Transformer Engine in one module
    (LoRA's fused layers), and its training loop needs CPU answers (del_megatron.cpu.bridge)."""
    from del_megatron.cpu import bridge

    bridge.without_transformer_engine() if dry_run else bridge.activate()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu or args.dry_run:
        _bridge_without_cuda(dry_run=not args.cpu)
    cfg = build_config(args)

    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step

    # One call: digit ids from cfg.tokenizer, settings on the provider instance (not on its
    # dataclass fields, so run_config.yaml stays a plain Bridge config), loss hook registered.
    numerical = enable_numerical_loss(
        cfg,
        loss=args.loss,
        alpha=args.alpha,
        reduction=args.reduction,
        digit_share=args.digit_share,
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

    if args.pretrained_checkpoint:
        from megatron.bridge.training.finetune import finetune

        finetune(cfg, forward_step_func=numerical_forward_step)
    else:
        from megatron.bridge.training.pretrain import pretrain

        pretrain(cfg, forward_step_func=numerical_forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
