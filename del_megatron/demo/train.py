"""The demo's training worker (run under torchrun, one process per TP rank, gloo on CPU):
a small Megatron-Core GPTModel trained on the prepared corpus with one loss, then evaluated."""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict
from typing import Dict, List

import torch
import torch.distributed as dist

import del_megatron as dm

from .. import cpu
from .. import megatron as dmm
from .config import TrainConfig, differing_settings
from .data import build_train_dataset, load_eval, tokenizer_path
from .stats import ratio_standard_error, standard_error
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


def save_checkpoint(cfg, step, model, optimizer, scheduler, history) -> None:
    """Model weights with Megatron's dist_checkpointing; optimizer, scheduler, RNG and history
    per rank beside them; `latest` names the newest complete checkpoint."""
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
            "history": history,
            "config": asdict(cfg),
        },
        os.path.join(path, f"train_state_rank{dist.get_rank()}.pt"),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest.tmp"), "w") as fh:
            fh.write(os.path.basename(path))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))


def load_checkpoint(cfg, model, optimizer, scheduler):
    """(step, history) of the newest checkpoint, restored into model/optimizer/scheduler."""
    from megatron.core import dist_checkpointing

    latest = os.path.join(_checkpoint_dir(cfg), "latest")
    if not os.path.exists(latest):
        return 0, []
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
    return state["step"], state["history"]


EVAL_BATCH = 64  # sequences a teacher-forced evaluation forward
ANSWER_TOKENS = 12  # the most tokens greedy decoding writes for an answer


def _full_logits(model, tokens):
    """[b, s, V] whole-vocab logits (all-gathered over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    local = model(tokens, positions, None)  # [b, s, V/tp]
    return gather_from_tensor_model_parallel_region(local)


def _parse_number(text: str):
    match = re.match(r"\s*(-?\d+(?:\.\d+)?)", text)
    return float(match.group(1)) if match else None


@torch.no_grad()
def evaluate(model, tok: TextTokenizer, problems: List[dict], vocab: dm.DigitVocab) -> Dict:
    """Teacher-forced digit accuracy on the answers; greedy-decoded exact-answer accuracy and
    mean |log10 error| = |log10(1 + |predicted|) - log10(1 + |true|)| (an answer that does not
    parse counts as 0); each with its standard error over the problems."""
    model.eval()
    digit_ids = torch.tensor(vocab.digit_ids)
    correct_digits, total_digits = [], []
    exact, log_errors, samples = [], [], []
    by_length: Dict[int, List[dict]] = {}  # for generation: prompts of one length
    by_full_length: Dict[int, List[tuple]] = {}  # for teacher forcing: prompt + answer
    for problem in problems:
        prompt = tok.encode(problem["prompt"])
        answer = tok.encode(problem["answer"])
        by_length.setdefault(len(prompt), []).append({**problem, "ids": prompt})
        by_full_length.setdefault(len(prompt) + len(answer), []).append((prompt, answer))
    for pairs in by_full_length.values():
        for start in range(0, len(pairs), EVAL_BATCH):
            chunk = pairs[start : start + EVAL_BATCH]
            full = torch.tensor([prompt + answer for prompt, answer in chunk])
            predicted = _full_logits(model, full).argmax(-1)  # [b, s]
            for row, (prompt, _) in enumerate(chunk):
                targets = full[row, len(prompt) :]
                is_digit = torch.isin(targets, digit_ids)
                hits = (predicted[row, len(prompt) - 1 : -1] == targets) & is_digit
                correct_digits.append(int(hits.sum()))
                total_digits.append(int(is_digit.sum()))
    for group in by_length.values():
        tokens = torch.tensor([p["ids"] for p in group])
        generated = [[] for _ in group]
        for _ in range(ANSWER_TOKENS):
            next_ids = _full_logits(model, tokens)[:, -1].argmax(-1)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            for row, token in enumerate(next_ids.tolist()):
                if not (generated[row] and generated[row][-1] == tok.eod):  # row not finished
                    generated[row].append(token)
            if all(ids and ids[-1] == tok.eod for ids in generated):
                break
        for problem, ids in zip(group, generated, strict=True):
            text = tok.decode([i for i in ids if i != tok.eod])
            value, truth = _parse_number(text), float(problem["answer"])
            exact.append(int(text.strip() == problem["answer"]))
            guess = 0.0 if value is None else value
            log_errors.append(abs(math.log10(1 + abs(guess)) - math.log10(1 + abs(truth))))
            if len(samples) < 8:
                samples.append(
                    {"prompt": problem["prompt"], "answer": problem["answer"], "output": text}
                )
    model.train()
    return {
        "digit_accuracy": sum(correct_digits) / max(sum(total_digits), 1),
        "exact_accuracy": sum(exact) / max(len(exact), 1),
        "mean_abs_log10_error": sum(log_errors) / max(len(log_errors), 1),
        "eval_problems": len(problems),
        "standard_errors": {
            "digit_accuracy": ratio_standard_error(correct_digits, total_digits),
            "exact_accuracy": standard_error(exact),
            "mean_abs_log10_error": standard_error(log_errors),
        },
        "samples": samples,
    }


def train(cfg: TrainConfig) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    tok = TextTokenizer(tokenizer_path(cfg.data_dir))
    vocab = dm.DigitVocab.from_tokenizer(tok.inner)
    model = _build_model(cfg, tok.vocab_size)
    dmm.register(dm.NumericalLossConfig(loss=cfg.loss, alpha=cfg.alpha, vocab=vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    scheduler = _lr_scheduler(optimizer, cfg)
    dataset = build_train_dataset(
        cfg.data_dir, tok, cfg.seq_len, cfg.steps * cfg.micro_batch, cfg.seed
    )
    start, history = (0, [])
    if cfg.resume:
        start, history = load_checkpoint(cfg, model, optimizer, scheduler)
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.loss:>7}", unit="step")
    began = time.time()
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
        ce = report["ce loss"]
        acc = report["digit acc"]
        history.append(
            {
                "step": step + 1,
                "loss": loss.item(),
                "ce": (ce[0] / ce[1]).item(),
                "digit_acc": (acc[0] / acc[1].clamp(min=1)).item(),
                "lr": optimizer.param_groups[0]["lr"],
            }
        )
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{history[-1]['ce']:.3f}")
            bar.update(1)
        if (step + 1) % cfg.save_interval == 0 or step + 1 == cfg.steps:
            save_checkpoint(cfg, step + 1, model, optimizer, scheduler, history)
    if bar is not None:
        bar.close()
    finished = bool(history) and history[-1]["step"] == cfg.steps
    metrics = (
        evaluate(model, tok, load_eval(cfg.data_dir)[: cfg.eval_problems or None], vocab)
        if finished
        else {}
    )
    dmm.unregister()
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        result = {
            "config": asdict(cfg),
            "history": history,
            "finished": finished,
            "train_seconds": time.time() - began,
            **metrics,
        }
        with open(os.path.join(cfg.out_dir, "metrics.json"), "w") as fh:
            json.dump(result, fh, indent=1)
