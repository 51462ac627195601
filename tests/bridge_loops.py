"""Megatron-Bridge's own finetune() and pretrain() loops with DEL on CPU, two gloo ranks under one
torchrun (torchrun ... -m tests.bridge_loops <folder> <out.json>), on the model, data and
converted checkpoint of tests/hf_workers.py `prepare`:

1. examples/bridge_pretrain_del.py's main() with FINETUNE_FLAGS: what
   `torchrun --nproc-per-node 2 examples/bridge_pretrain_del.py <FINETUNE_FLAGS>` runs (Bridge's
   finetune() from the converted weights, tensor-parallel 2, the digit reduction, 3 iterations,
   saved at the end for the export). Bridge logs its iterations to stdout, which the test reads;
   these lines are the ones with "/ 3" iterations.
2. pretrain() from random weights, configured by the example's --cpu flags, data-parallel 2,
   the "digit" reduction over 2 micro-batches per rank, 4 iterations, a checkpoint at
   iterations 2 and 4;
3. pretrain() again, resumed from the iteration-2 checkpoint (checkpoint.ckpt_step): its
   iterations 3 and 4 must log what the uninterrupted run logged.

One process group for the three runs (Bridge keeps a group it did not make; each run's end
tears Megatron's model-parallel state down, as a Bridge job's does), so Bridge is imported
once a rank. The pretrain() runs' logged values (Bridge's reduced loss_dict, the numbers of its
"iteration N" line) are written by rank 0.
"""

from __future__ import annotations

import json
import os
import sys

from . import hf_workers

ALPHA = 0.5
FINETUNE_ITERS = 3


def finetune_flags(folder: str) -> list:
    """The flags of the continued-pretraining command (docs/continued-pretraining.md)."""
    flags = ["--hf-model", hf_workers.hf_dir(folder)]
    flags += ["--pretrained-checkpoint", hf_workers.megatron_dir(folder)]
    flags += ["--data-path", hf_workers.data_prefix(folder)]
    flags += ["--save", hf_workers.trained_dir(folder)]
    flags += ["--tp", "2", "--alpha", str(ALPHA), "--seq-length", str(hf_workers.SEQ)]
    flags += ["--lr", "1e-3", "--global-batch-size", "4", "--micro-batch-size", "2"]
    return flags + ["--train-iters", str(FINETUNE_ITERS), "--cpu"]


def example():
    import importlib.util

    path = os.path.join(hf_workers.ROOT, "examples", "bridge_pretrain_del.py")
    spec = importlib.util.spec_from_file_location("bridge_pretrain_del", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(module, argv: list, **checkpoint) -> list:
    """One pretrain() with the example's --cpu configuration; returns the logged loss_dicts."""
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.pretrain import pretrain

    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step

    args = module.parse_args(argv)
    cfg = module.build_config(args)
    for name, value in checkpoint.items():
        setattr(cfg.checkpoint, name, value)
    enable_numerical_loss(
        cfg, loss="del", alpha=args.alpha, reduction=args.reduction, digit_share=args.digit_share
    )
    rows: list = []

    class Record(Callback):
        def on_train_step_end(self, context):
            row = {k: float(v) for k, v in context.loss_dict.items()}
            rows.append({"iteration": context.state.train_state.step + 1, **row})

    pretrain(cfg, forward_step_func=numerical_forward_step, callbacks=[Record()])
    return rows


def main(folder: str, out: str) -> None:
    import torch.distributed as dist

    from del_megatron.cpu import bridge

    bridge.activate()
    dist.init_process_group("gloo")
    module = example()
    assert module.main(finetune_flags(folder)) == 0
    saved = os.path.join(folder, "loops_checkpoints")
    argv = ["--cpu", "--hf-model", hf_workers.hf_dir(folder)]
    argv += ["--data-path", hf_workers.data_prefix(folder), "--reduction", "digit"]
    argv += ["--alpha", str(ALPHA), "--seq-length", str(hf_workers.SEQ), "--lr", "1e-3"]
    argv += ["--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "4"]
    argv += ["--save", saved, "--save-interval", "2"]
    result = {"uninterrupted": run(module, argv)}
    result["resumed"] = run(module, argv, load=saved, ckpt_step=2, save=None)
    result["saved"] = sorted(os.listdir(saved))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
