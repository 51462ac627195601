"""The training worker of `del-megatron compare-qa`, run under torchrun: Megatron-Bridge's own
finetune() from a converted Hugging Face model on a fine-tuning folder (data.py), with one loss
through del_megatron's Bridge hook; CPU (gloo, fp32, local layers) where there is no CUDA.
Each iteration's logged values go to <save>/history.jsonl; <save>/trained.json marks the end.

    torchrun --nproc-per-node 1 -m del_megatron.tools.qa.finetune '<RunSettings as JSON>'
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass

HISTORY, TRAINED = "history.jsonl", "trained.json"


@dataclass(frozen=True)
class Schedule:
    """What every run of a sweep trains with: `iters` iterations of `global_batch` problems in
    micro-batches of `micro_batch`, peak `lr` after `warmup` iterations and a cosine to 0,
    sequences of `seq_length` tokens, `tensor_parallel` processes."""

    iters: int
    global_batch: int
    micro_batch: int
    lr: float
    warmup: int
    seq_length: int
    tensor_parallel: int = 1


@dataclass(frozen=True)
class RunSettings:
    """One run: the model (`hf_model`, its converted weights `init`), the data folder, where it
    saves, the loss and its weight, the seed and the schedule."""

    hf_model: str
    init: str
    data_root: str
    save: str
    loss: str
    alpha: float
    seed: int
    schedule: Schedule


def build_config(run: RunSettings):
    """Bridge's SFT recipe base (_sft_common: Adam beta2 0.98, cosine to 0) with the model,
    data and schedule of `run`; loss on answer tokens only, no packing, no evaluation."""
    import torch
    from megatron.bridge import AutoBridge
    from megatron.bridge.data.builders.gpt_sft import GPTSFTDatasetConfig
    from megatron.bridge.recipes.common import _sft_common

    cfg = _sft_common()
    cfg.model = AutoBridge.from_hf_pretrained(run.hf_model).to_megatron_provider(load_weights=False)
    cfg.model.seq_length = run.schedule.seq_length
    cfg.model.tensor_model_parallel_size = run.schedule.tensor_parallel
    cfg.dataset = GPTSFTDatasetConfig(
        seq_length=run.schedule.seq_length,
        dataset_root=run.data_root,
        seed=run.seed,
        do_validation=False,
        do_test=False,
        dataset_kwargs={"pad_to_max_length": False},
    )
    cfg.tokenizer.tokenizer_model = run.hf_model
    cfg.train.train_iters = run.schedule.iters
    cfg.train.global_batch_size = run.schedule.global_batch
    cfg.train.micro_batch_size = run.schedule.micro_batch
    cfg.validation.eval_iters = 0
    cfg.optimizer.lr = run.schedule.lr
    cfg.optimizer.min_lr = 0.0
    cfg.scheduler.lr_warmup_iters = run.schedule.warmup
    cfg.scheduler.lr_decay_iters = run.schedule.iters
    cfg.checkpoint.save = cfg.checkpoint.load = run.save
    cfg.checkpoint.pretrained_checkpoint = run.init
    cfg.checkpoint.save_interval = max(run.schedule.iters // 4, 1)
    cfg.checkpoint.most_recent_k = 1
    cfg.rng.seed = run.seed
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = os.path.join(run.save, "tensorboard")
    if not torch.cuda.is_available():
        from ...cpu.bridge import cpu_config

        cpu_config(cfg)
    return cfg


def _history_callback(path: str):
    from megatron.bridge.training.callbacks import Callback

    class History(Callback):
        """Rank 0 appends each iteration's reduced values, wall time (s) and the process's peak
        resident memory so far (GiB) to `path`."""

        last = time.time()

        def on_train_step_end(self, context) -> None:
            if int(os.environ.get("RANK", "0")) != 0:
                return
            now = time.time()
            row = {k: float(v) for k, v in (context.loss_dict or {}).items()}
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
            row.update(
                iteration=context.state.train_state.step, seconds=now - self.last, peak_gib=peak
            )
            self.last = now
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return History()


def train(run: RunSettings) -> None:
    import torch

    if not torch.cuda.is_available():
        from ...cpu import bridge

        bridge.activate()
    from megatron.bridge.training.finetune import finetune

    from ...megatron.bridge import enable_numerical_loss, numerical_forward_step

    cfg = build_config(run)
    enable_numerical_loss(cfg, loss=run.loss, alpha=run.alpha)
    os.makedirs(run.save, exist_ok=True)
    history = os.path.join(run.save, HISTORY)
    finetune(cfg, forward_step_func=numerical_forward_step, callbacks=[_history_callback(history)])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(run.save, TRAINED), "w") as f:
            json.dump(asdict(run), f, indent=1)


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    train(RunSettings(**{**given, "schedule": Schedule(**given["schedule"])}))
