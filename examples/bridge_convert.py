"""Hugging Face <-> Megatron checkpoints with Megatron-Bridge's AutoBridge (0.6).

    # Hugging Face model -> Megatron checkpoint (the weights a DEL run starts from)
    python examples/bridge_convert.py import --hf-model Qwen/Qwen2.5-0.5B \\
        --megatron-path /ckpt/qwen25-0.5b-megatron

    # DEL-trained Megatron checkpoint -> Hugging Face model (architecture and tokenizer from
    # --hf-model; the latest iter_* folder of --megatron-path)
    python examples/bridge_convert.py export --hf-model Qwen/Qwen2.5-0.5B \\
        --megatron-path /ckpt/qwen25-del --hf-path /models/qwen25-0.5b-del

    # the same for a checkpoint that Megatron-LM's pretrain_gpt.py wrote (its model settings
    # are read from the checkpoint's saved arguments)
    python examples/bridge_convert.py export --megatron-lm --hf-model Qwen/Qwen2.5-7B \\
        --megatron-path /ckpt/qwen25-7b-del --hf-path /models/qwen25-7b-del

A DEL checkpoint converts exactly as a cross-entropy one: the loss settings are not in it.
The Megatron checkpoint is Megatron-Core's torch_dist format, which Megatron-LM's
pretrain_gpt.py also loads (--pretrained-checkpoint). --cpu runs the conversion in one gloo
process without CUDA (the tests' tiny models; Transformer Engine is not needed there).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=["import", "export"])
    parser.add_argument("--hf-model", required=True, help="Hugging Face model: Hub id or folder")
    parser.add_argument("--megatron-path", required=True, help="Megatron checkpoint folder")
    parser.add_argument("--hf-path", help="export: the Hugging Face folder to write")
    parser.add_argument(
        "--megatron-lm",
        action="store_true",
        help="export: the checkpoint was written by Megatron-LM (pretrain_gpt.py), not Bridge",
    )
    parser.add_argument("--cpu", action="store_true", help="one gloo process, no CUDA")
    args = parser.parse_args(argv)
    if args.direction == "export" and not args.hf_path:
        parser.error("export needs --hf-path")
    return args


def init_cpu_process() -> None:
    """One gloo rank with Megatron-Core on CPU (Bridge would otherwise start NCCL), and Bridge's
    CPU runtime (del_megatron.cpu.bridge: the Transformer Engine placeholder Bridge's import
    needs without CUDA)."""
    from del_megatron.cpu.bridge import activate, init_single_process

    activate()
    init_single_process()


def latest_iteration(folder: str) -> str:
    """The iter_* folder that latest_checkpointed_iteration.txt names."""
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as f:
        iteration = f.read().strip()
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(folder, name)


def export_megatron_lm(args: argparse.Namespace) -> None:
    """Bridge's load_megatron_model for a Megatron-LM checkpoint (model_type "gpt": the model
    config comes from the arguments Megatron-LM saved), then AutoBridge's HF export."""
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.model_load_save import load_megatron_model

    bridge = AutoBridge.from_hf_pretrained(args.hf_model)
    model = load_megatron_model(
        latest_iteration(args.megatron_path),
        model_type="gpt",
        use_cpu_init=True,
        skip_temp_dist_context=dist.is_initialized(),
    )
    model = model if isinstance(model, list) else [model]
    bridge.save_hf_pretrained(model, args.hf_path, show_progress=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        init_cpu_process()
    from megatron.bridge import AutoBridge

    if args.direction == "import" and args.cpu:  # import_ckpt's own steps, local layers
        from del_megatron.cpu.bridge import import_hf

        import_hf(args.hf_model, args.megatron_path)
    elif args.direction == "import":
        AutoBridge.import_ckpt(args.hf_model, args.megatron_path)
    elif args.megatron_lm:
        export_megatron_lm(args)
    elif args.cpu:  # export_ckpt's own steps, in the gloo process made above
        from del_megatron.cpu.bridge import export_hf

        export_hf(args.hf_model, args.megatron_path, args.hf_path)
    else:
        bridge = AutoBridge.from_hf_pretrained(args.hf_model)
        bridge.export_ckpt(args.megatron_path, args.hf_path, show_progress=False)
    if args.direction == "import":
        print(f"imported {args.hf_model} -> {args.megatron_path}", flush=True)
    else:
        print(f"exported {args.megatron_path} -> {args.hf_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
