"""The demo's training worker (run under torchrun, one process per TP rank, gloo on CPU):
a small Megatron-Core GPTModel trained on the prepared corpus with one loss, then evaluated."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import del_megatron as dm

from ... import cpu
from ... import megatron as dmm
from .config import SINGLE_DIGIT_DEL, TrainConfig, differing_settings
from .data import build_train_dataset, load_eval, tokenizer_path
from .evaluate import base_ce, curve_point, curve_steps, score, summarize
from .text_tokenizer import TextTokenizer


def _build_model(cfg: TrainConfig, vocab_size: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = dist.get_world_size()
    config = TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cpu.seed(cfg.seed)
    padded = -(-vocab_size // (8 * tp)) * 8 * tp  # as Megatron-LM pads the vocab
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=padded,
        max_sequence_length=cfg.seq_len * 2,
        position_embedding_type="rope",
    )


def _loss_config(cfg: TrainConfig, vocab: dm.DigitVocab) -> dm.NumericalLossConfig:
    """The run's loss; `del_single` is DEL over the single-digit tokens of `vocab` only."""
    if cfg.loss == SINGLE_DIGIT_DEL:
        loss, vocab = "del", vocab.single_digits_only()
    else:
        loss = cfg.loss
    return dm.NumericalLossConfig(
        loss=loss,
        alpha=cfg.alpha,
        vocab=vocab,
        reduction=cfg.reduction,
        slot_logits=cfg.slot_logits,
    )


def _step_record(report: dict, loss_cfg: dm.NumericalLossConfig) -> dict:
    """A step's history entry from the loss function's report: the CE, the digit accuracy, the
    share of loss tokens that are digit targets and the weight on the mean digit term."""

    def mean(name: str) -> float:
        total, count = report[name]
        return (total / count.clamp(min=1)).item()

    return {
        "ce": mean("ce loss"),
        "digit_acc": mean("digit acc"),
        "digit_share": mean("digit share"),
        # the control arm ("ce") reports no weight: its term weighs 0
        "term_weight": mean(f"{loss_cfg.loss} weight") if loss_cfg.loss != "ce" else 0.0,
    }


def _batch(dataset, step: int, micro_batch: int):
    samples = [dataset[step * micro_batch + i] for i in range(micro_batch)]
    return {k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask")}


def _lr_scheduler(optimizer, cfg: TrainConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=min(cfg.warmup, cfg.steps // 5),
        lr_decay_steps=cfg.steps,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=cfg.steps,
        wd_incr_style="constant",
    )


def _checkpoint_dir(cfg: TrainConfig) -> str:
    return os.path.join(cfg.out_dir, "checkpoints")


def save_checkpoint(cfg, step, model, optimizer, scheduler, record) -> None:
    """Model weights with Megatron's dist_checkpointing; optimizer, scheduler, RNG and the run's
    record (history, curve) per rank beside them; `latest` names the newest complete
    checkpoint, and the older ones are removed."""
    from megatron.core import dist_checkpointing

    root = _checkpoint_dir(cfg)
    path = os.path.join(root, f"iter_{step:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            **record,
            "config": asdict(cfg),
        },
        os.path.join(path, f"train_state_rank{dist.get_rank()}.pt"),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest.tmp"), "w") as fh:
            fh.write(os.path.basename(path))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        for name in os.listdir(root):
            if name.startswith("iter_") and name != os.path.basename(path):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_base_weights(model, checkpoints: str) -> None:
    """The model weights of the newest checkpoint in `checkpoints` (a base run's), without its
    optimizer, schedule or RNG: continued pretraining starts those afresh."""
    from megatron.core import dist_checkpointing

    latest = os.path.join(checkpoints, "latest")
    if not os.path.exists(latest):
        raise FileNotFoundError(
            f"{checkpoints} holds no finished checkpoint to continue from: train the base run "
            "first (compare --continue-from-base trains it before its arms)"
        )
    with open(latest) as fh:
        path = os.path.join(checkpoints, fh.read().strip())
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))


def load_checkpoint(cfg, model, optimizer, scheduler):
    """(step, record) of the newest checkpoint, restored into model/optimizer/scheduler; record
    holds the run's "history" and "curve" so far."""
    from megatron.core import dist_checkpointing

    latest = os.path.join(_checkpoint_dir(cfg), "latest")
    if not os.path.exists(latest):
        return 0, {"history": [], "curve": []}
    with open(latest) as fh:
        path = os.path.join(_checkpoint_dir(cfg), fh.read().strip())
    state = torch.load(
        os.path.join(path, f"train_state_rank{dist.get_rank()}.pt"), weights_only=False
    )
    differ = differing_settings(state.get("config", {}), asdict(cfg))
    if differ:  # the same on every rank: all of them stop here
        raise ValueError(
            f"the checkpoint in {path} was trained with other settings ({', '.join(differ)}): "
            "resume with the settings it was trained with, or train into another output folder"
        )
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"], {"history": state["history"], "curve": state.get("curve", [])}


def _mean_train_ce(history, since_step: int) -> float:
    """Mean training CE (per-batch) of the steps after `since_step`."""
    values = [h["ce"] for h in history if h["step"] > since_step]
    return sum(values) / len(values) if values else float("nan")


def _previous_train_seconds(out_dir: str, default: float) -> float:
    try:
        with open(os.path.join(out_dir, "metrics.json")) as fh:
            return json.load(fh).get("train_seconds", default)
    except FileNotFoundError:
        return default


def train(cfg: TrainConfig) -> None:
    """Train one run, scoring the first cfg.curve_problems held-out problems at the curve's
    steps and all cfg.eval_problems (0: all) at the end; rank 0 writes metrics.json."""
    rank = dist.get_rank()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    tok = TextTokenizer(tokenizer_path(cfg.data_dir))
    vocab = dm.DigitVocab.from_tokenizer(tok.inner)
    model = _build_model(cfg, tok.vocab_size)
    loss_cfg = _loss_config(cfg, vocab)
    dmm.register(loss_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    scheduler = _lr_scheduler(optimizer, cfg)
    dataset = build_train_dataset(
        cfg.data_dir, tok, cfg.seq_len, cfg.steps * cfg.micro_batch, cfg.seed
    )
    problems = load_eval(cfg.data_dir)[: cfg.eval_problems or None]
    subset = problems[: cfg.curve_problems or None]
    scored_at = set(curve_steps(cfg.steps, cfg.curve_points))
    start, record = (0, {"history": [], "curve": []})
    if cfg.resume:
        start, record = load_checkpoint(cfg, model, optimizer, scheduler)
    if start == 0 and cfg.init_from:
        load_base_weights(model, cfg.init_from)
    history, curve = record["history"], record["curve"]
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.loss:>7}", unit="step")
    began, eval_seconds = time.time(), 0.0
    for step in range(start, cfg.steps):
        if cfg.stop_after and step >= cfg.stop_after:
            break
        batch = _batch(dataset, step, cfg.micro_batch)
        positions = torch.arange(cfg.seq_len).expand_as(batch["tokens"])
        optimizer.zero_grad()
        output = model(batch["tokens"], positions, None, labels=batch["labels"])
        loss_sum, num_tokens, report = dmm.numerical_loss_func(batch["loss_mask"], output)
        loss = loss_sum / num_tokens
        loss.backward()
        optimizer.step()
        scheduler.step(1)
        history.append({"step": step + 1, "loss": loss.item(), **_step_record(report, loss_cfg)})
        history[-1]["lr"] = optimizer.param_groups[0]["lr"]
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{history[-1]['ce']:.3f}")
            bar.update(1)
        if step + 1 in scored_at and step + 1 < cfg.steps:  # the last point: from the end's
            timed = time.time()
            summary = summarize(score(model, tok, subset, vocab), subset)
            since = curve[-1]["step"] if curve else 0
            curve.append(curve_point(step + 1, summary, _mean_train_ce(history, since)))
            eval_seconds += time.time() - timed
        if (step + 1) % cfg.save_interval == 0 or step + 1 == cfg.steps:
            save_checkpoint(cfg, step + 1, model, optimizer, scheduler, record)
    if bar is not None:
        bar.close()
    finished = bool(history) and history[-1]["step"] == cfg.steps
    metrics = {}
    if finished:
        timed = time.time()
        scores = score(model, tok, problems, vocab)
        metrics = summarize(scores, problems)
        if scored_at and (not curve or curve[-1]["step"] < cfg.steps):
            since = curve[-1]["step"] if curve else 0
            end = summarize(scores, problems, len(subset))
            curve.append(curve_point(cfg.steps, end, _mean_train_ce(history, since)))
        if cfg.base_data_dir:
            ce, se = base_ce(model, tok, load_eval(cfg.base_data_dir)[: cfg.eval_problems or None])
            metrics["base_ce"] = ce
            metrics["standard_errors"]["base_ce"] = se
        eval_seconds += time.time() - timed
    dmm.unregister()
    train_seconds = time.time() - began - eval_seconds
    if start == cfg.steps:  # re-scored from its last checkpoint: keep the training's time
        train_seconds = _previous_train_seconds(cfg.out_dir, train_seconds)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        result = {
            "config": asdict(cfg),
            "history": history,
            "curve": curve,
            "finished": finished,
            "train_seconds": train_seconds,
            "eval_seconds": eval_seconds,
            **metrics,
        }
        with open(os.path.join(cfg.out_dir, "metrics.json"), "w") as fh:
            json.dump(result, fh, indent=1)
