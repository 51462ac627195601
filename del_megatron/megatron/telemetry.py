"""Per-step DEL telemetry and the "digit" reduction, in Megatron-LM's loss_func.

The loss hook records, per micro-batch, the parts behind the [b, s] loss it returns (with the
entries of the MTP heads that the same forward computed first). The loss_func wrapper (it has
the loss mask) finds them by the output tensor and reports `[sum, count]` pairs, which
Megatron-LM sums over micro-batches and data-parallel x context-parallel ranks into each step's
sum / count: the value TensorBoard and W&B get for the step, and whose mean over the log
interval the console line prints (docs/megatron-lm.md, "What the log shows").

Counts carry a tiny COUNT_EPS, so a step without digit targets reports 0 for the digit entries
instead of 0/0 = NaN (which would hide them for the whole interval); it is lost in float32 next
to any count >= 1, so real steps are exact. Megatron-LM up to core 0.17 also drops an entry
whose interval mean is exactly 0; there, an exact 0 shows as ZERO_SHOWN_AS.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch

from ..loss import LossParts, NumericalLossConfig
from ..numbers import held_slots
from . import accounting, state

COUNT_EPS = 1e-8
ZERO_SHOWN_AS = 1e-20


class _Record(NamedTuple):
    """output: the [b, s] loss the hook returned; parts: the pieces behind it; cp_size: the
    context-parallel ranks its sequences are split over; mtp: report entries of the MTP heads
    of the same forward (mtp_entries)."""

    output: torch.Tensor
    parts: LossParts
    cfg: NumericalLossConfig
    cp_size: int = 1
    mtp: Optional[Dict[str, torch.Tensor]] = None


def record(
    output: torch.Tensor,
    parts: LossParts,
    cfg: NumericalLossConfig,
    cp_size: int = 1,
    mtp: Optional[Dict[str, torch.Tensor]] = None,
) -> None:
    """Keep the parts behind `output` for the loss function (nothing when not registered).
    cp_size: the context-parallel ranks that hold a share of each of its sequences; mtp: report
    entries of the forward's MTP heads, reported beside the main head's."""
    registration = state.current()
    if registration is not None:
        registration.records.append(_Record(output, parts, cfg, cp_size, mtp))


def find(output: torch.Tensor) -> Optional[_Record]:
    registration = state.current()
    for rec in reversed(registration.records if registration is not None else ()):
        if rec.output is output:
            return rec
    return None


@functools.lru_cache(maxsize=1)
def _zero_floor() -> float:
    """ZERO_SHOWN_AS where Megatron-LM's training log drops entries whose mean is 0 (core up to
    0.17: `if avg > 0.0`), else 0."""
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return 0.0
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return ZERO_SHOWN_AS if (major, minor) < (0, 18) else 0.0


def digit_reduced(loss_mask: torch.Tensor, rec: _Record) -> torch.Tensor:
    """The per-token loss [b, s] that Megatron's masked sum and normalisation turn into the
    "digit" reduction: CE_t + alpha * term_t * scale (the recorded output unchanged for the
    "token" reduction). Inside a `with DigitAccounting(...)` step the scale makes the term a mean
    over the step's global digit targets (accounting.py); otherwise over this micro-batch's
    (n_tokens / n_digits, counted under `loss_mask`)."""
    if rec.cfg.reduction != "digit":
        return rec.output
    mask = loss_mask.reshape(rec.output.shape).to(rec.parts.term.dtype)
    n_tokens = mask.sum()
    step = accounting.active()
    if step is not None:
        scale = step.term_scale(n_tokens).to(n_tokens)
    else:
        scale = n_tokens / (rec.parts.digit_count * mask).sum().clamp(min=1.0)
    extra = rec.cfg.alpha * rec.parts.term * (scale - 1.0)
    return rec.output + extra.to(rec.output.dtype)


def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A Megatron-LM report entry [sum, count] (float32 [2]): COUNT_EPS keeps an empty count
    from 0/0, and ZERO_SHOWN_AS x count shows an exact 0 on cores that print only means > 0."""
    count = count.detach().float() + COUNT_EPS
    return torch.stack([total.detach().float() + _zero_floor() * count, count])


def digit_stats(mask: torch.Tensor, parts: LossParts) -> tuple:
    """(n_digits, correct, entropy) [] float32, summed over the digit targets under `mask`
    [b, s] (float): one per digit target, a chunking vocab's held [b, s, 3] slots, else [b, s].
    correct counts the targets whose digit is the argmax of the ten digit logits; entropy sums,
    in nats, the entropy of the softmax over them (the logits DEL uses, slot logits included).
    Tensors only: nothing is read on the host."""
    digit, logits = parts.digit, parts.digit_logits.detach()
    if digit.dim() == mask.dim():
        digit, logits = digit.unsqueeze(-1), logits.unsqueeze(-2)
    held = held_slots(parts.digit_count, digit.size(-1)) & (mask.unsqueeze(-1) != 0)
    # Slots that hold no target digit may hold inf (slot logits): they never reach a sum.
    logits = torch.where(held.unsqueeze(-1), logits.float(), 0.0)
    entropy = torch.special.entr(torch.softmax(logits, dim=-1)).sum(dim=-1)  # -sum p ln p
    correct = logits.argmax(dim=-1) == digit
    digit_mask = held.float() * mask.unsqueeze(-1)
    return digit_mask.sum(), (correct * digit_mask).sum(), (entropy * digit_mask).sum()


def mtp_entries(depth: int, mask: torch.Tensor, parts: LossParts) -> Dict[str, torch.Tensor]:
    """The report entries of MTP head `depth` (1-based, as Megatron-LM's `mtp_1 loss`): its
    digit accuracy and entropy over its digit targets under `mask` [b, s], the loss mask
    Megatron rolls for that depth."""
    n_digits, correct, entropy = digit_stats(mask.reshape(parts.ce.shape).float(), parts)
    return {
        f"mtp_{depth} digit acc": _pair(correct, n_digits),
        f"mtp_{depth} digit entropy": _pair(entropy, n_digits),
    }


def report_entries(loss_mask: torch.Tensor, rec: _Record) -> dict:
    """Telemetry as Megatron-LM `[sum, count]` report entries (float32 [2] each), the forward's
    MTP heads' entries last. `digit tokens` counts 1 / cp_size a rank, so that its sum over the
    context-parallel ranks of a micro-batch (Megatron-LM sums over DP x CP) is one micro-batch."""
    mask = loss_mask.reshape(rec.output.shape).float()
    n_digits, correct, entropy = digit_stats(mask, rec.parts)
    n_tokens = mask.sum()
    return {
        "ce loss": _pair((rec.parts.ce.float() * mask).sum(), n_tokens),
        f"{rec.cfg.loss} term": _pair((rec.parts.term.float() * mask).sum(), n_digits),
        f"{rec.cfg.loss} weight": effective_weight(rec.cfg, n_digits, n_tokens, _pair),
        "digit acc": _pair(correct, n_digits),
        "digit entropy": _pair(entropy, n_digits),
        "digit tokens": _pair(n_digits, torch.full_like(n_digits, 1.0 / rec.cp_size)),
        "digit share": _pair(n_digits, n_tokens),
        **(rec.mtp or {}),
    }


def effective_weight(
    cfg: NumericalLossConfig, n_digits: torch.Tensor, n_tokens: torch.Tensor, pair: Callable
) -> torch.Tensor:
    """The report entry of the weight the loss puts on the mean term over digit targets: alpha
    for the "digit" reduction; for the "token" one alpha / digit_share x the measured share,
    summed as Megatron-LM sums entries (micro-batches, data-parallel ranks), so that the logged
    sum / count is token_weight x (the step's digit targets / its loss tokens)."""
    if cfg.reduction == "token":
        return pair(cfg.token_weight * n_digits, n_tokens)
    return pair(cfg.token_weight * n_digits, n_digits)


# Marks the functions make_loss_func (and lm.install's forward_step wrapper) made.
WRAPPED = "_del_megatron"

NOT_RECORDED = (
    "del_megatron: the loss function got a loss that del_megatron's hook did not compute, in a "
    "run registered for the numerical loss {loss!r}: the model computed it another way (a fused "
    "cross-entropy that bypasses LanguageModule.compute_language_model_loss, a schedule that "
    "hands the loss function a copy, a model class the hook does not cover), so this step would "
    "train plain cross-entropy. Stopped before it does; see docs/support.md for what is supported"
)


def _expected_loss(model: Any) -> Optional[str]:
    """The numerical loss the current registration (else `model`'s config) asks for, if any."""
    registration = state.current()
    if registration is None:
        return None
    if registration.cfg is not None:
        return registration.cfg.loss
    from .hook import cfg_from_model_config

    while hasattr(model, "module"):  # DDP / Float16Module
        model = model.module
    cfg = cfg_from_model_config(getattr(model, "config", None))
    return None if cfg is None else cfg.loss


def check_recorded(rec: Optional[_Record], loss: Optional[str]) -> None:
    """Stop a run whose loss function sees a loss del_megatron did not compute while the run
    asks for a numerical loss (`loss` other than None or "ce"). It raises rather than warns:
    such a step trains plain cross-entropy, and a run that does so silently wastes its compute;
    no supported configuration reaches the loss function with an unrecorded loss."""
    if rec is None and loss not in (None, "ce"):
        raise RuntimeError(NOT_RECORDED.format(loss=loss))


def apply_to_loss(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    base: Callable[[torch.Tensor], tuple],
    model: Any = None,
) -> tuple:
    """Run a framework loss `base(per_token_losses) -> (loss_sum, num_tokens, report)` on the
    "digit"-reduced losses (so its NaN/spike checks and 'lm loss' see the real loss) and add the
    telemetry entries. Outputs the hook did not record go to `base` unchanged, unless the run
    asks for a numerical loss (the registration's, else `model`'s config): then it stops
    (check_recorded)."""
    rec = find(output_tensor)
    if rec is None:  # the model computed its loss without del_megatron
        check_recorded(rec, _expected_loss(model))
        return base(output_tensor)
    registration = state.current()
    if registration is not None and registration.unreduced is output_tensor:
        registration.unreduced = None
    result = base(digit_reduced(loss_mask, rec))
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[2], dict)):
        raise ValueError(
            "del_megatron needs a loss function returning (loss_sum, num_tokens, report), as "
            "Megatron-LM's pretrain_gpt.py (core 0.12 on) and Megatron-Bridge's do"
        )
    loss, num_tokens, report = result
    entries = report_entries(loss_mask, rec)
    watch = registration.share_watch if registration is not None else None
    if watch is not None and torch.is_grad_enabled():  # training micro-batches only
        watch.observe(*entries["digit share"])
    return loss, num_tokens, {**report, **entries}


def make_loss_func(base_loss_func: Callable) -> Callable:
    """Wrap a Megatron-LM loss_func(loss_mask, output_tensor, model=None) -> (loss_sum,
    num_tokens, report) with the "digit" reduction and the telemetry (see apply_to_loss). A
    loss_func this function made is returned as it is: wrapped twice, the outer wrapper would
    hand the inner one a reduced loss that no record matches."""
    if getattr(base_loss_func, WRAPPED, False):
        return base_loss_func

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None, **kwargs):
        return apply_to_loss(
            loss_mask,
            output_tensor,
            lambda losses: base_loss_func(loss_mask, losses, model=model, **kwargs),
            model,
        )

    setattr(loss_func, WRAPPED, True)
    return loss_func


def _plain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Megatron-LM's pretrain_gpt loss_func without its NaN/spike checks (those need args)."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


numerical_loss_func = make_loss_func(_plain_loss_func)
