"""The public entry: NumericalLossConfig and numerical_lm_loss on Megatron-shaped tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from .heads import HEADS
from .numbers import NumberLayout, check_label_dtype, del_weights, dist2_weights, number_layout
from .parallel import ProcessGroup, digit_cross_entropy
from .vocab import DigitVocab

LOSSES = ("ce",) + tuple(HEADS)
REDUCTIONS = ("token", "digit")


@dataclass(frozen=True)
class NumericalLossConfig:
    """What to add to cross-entropy, and how much.

    loss:         "ce" (plain cross-entropy), "del", "ntl_was", "ntl_mse" or "dist2"
    alpha:        weight of the numerical term
    vocab:        DigitVocab of the tokenizer (required unless loss == "ce")
    reduction:    "token" (each token carries CE_t + alpha * term_t) or "digit" (the numerical
                  term is averaged over digit targets instead of over tokens; spec/DEL.md)
    ignore_index: label value of positions without a loss
    inplace:      let fp32 logits be overwritten (softmax, then gradient) to save a buffer, as
                  Megatron's own vocab_parallel_cross_entropy always does
    validate:     check label ids against the vocab (one host sync per call) and shard sizes
    """

    loss: str = "del"
    alpha: float = 0.01
    vocab: Optional[DigitVocab] = None
    reduction: str = "token"
    ignore_index: int = -100
    inplace: bool = False
    validate: bool = True

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.vocab is not None and not isinstance(self.vocab, DigitVocab):
            raise TypeError(f"vocab must be a DigitVocab, got {type(self.vocab).__name__}")
        if self.loss != "ce" and self.vocab is None:
            raise ValueError(
                f"loss={self.loss!r} needs vocab=DigitVocab(...) (or DigitVocab.from_tokenizer)"
            )
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool):
            raise TypeError(f"alpha must be a number, got {self.alpha!r}")


class LossParts(NamedTuple):
    """Per-token pieces, each [b, s]: ce fp32, term fp32 (before alpha), is_digit bool."""

    ce: torch.Tensor
    term: torch.Tensor
    is_digit: torch.Tensor


# Any fixed vocab serves loss="ce": its digit logits are computed but unused.
_CE_ONLY_VOCAB = DigitVocab(range(10))


def _check_inputs(labels: torch.Tensor, logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("labels and logits must be torch.Tensors")
    if not logits.dtype.is_floating_point:
        raise TypeError(
            f"logits must be floating point (fp32, bf16, fp16 or fp64), got {logits.dtype}"
        )
    if logits.dim() != 3:
        raise ValueError(
            f"logits must be [seq, batch, vocab_local] as Megatron's output layer gives, got "
            f"shape {tuple(logits.shape)}"
        )
    check_label_dtype(labels)
    s, b, _ = logits.shape
    if tuple(labels.shape) != (b, s):
        raise ValueError(
            f"labels must be [batch, seq] = [{b}, {s}] to match logits [seq, batch, vocab_local] "
            f"= {list(logits.shape)}, got {list(labels.shape)} (Megatron passes labels [b, s] "
            "and logits [s, b, V/tp])"
        )


def _place_weights(loss: str, layout: NumberLayout, dtype: torch.dtype) -> torch.Tensor:
    if loss == "del":
        return del_weights(layout, dtype)
    if loss == "dist2":
        return dist2_weights(layout, dtype)
    return layout.is_digit.to(dtype)


class LossPieces(NamedTuple):
    """LossParts plus, for telemetry, digit logits fp32 [b, s, 10] and target digits [b, s]."""

    ce: torch.Tensor
    term: torch.Tensor
    is_digit: torch.Tensor
    digit_logits: torch.Tensor
    digit: torch.Tensor


def loss_pieces(
    labels: torch.Tensor,
    logits: torch.Tensor,
    cfg: NumericalLossConfig,
    tp_group: ProcessGroup = None,
) -> LossPieces:
    """Everything numerical_lm_loss composes its result from; see there for shapes."""
    if not isinstance(cfg, NumericalLossConfig):
        raise TypeError(f"cfg must be a NumericalLossConfig, got {type(cfg).__name__}")
    _check_inputs(labels, logits)
    s, b, v_local = logits.shape
    vocab = cfg.vocab if cfg.vocab is not None else _CE_ONLY_VOCAB

    target = labels.transpose(0, 1).reshape(-1).long()  # [s * b], rows of logits.view(-1, V)
    ce, digit_logits = digit_cross_entropy(
        logits.reshape(s * b, v_local),
        target,
        vocab,
        tp_group=tp_group,
        ignore_index=cfg.ignore_index,
        inplace=cfg.inplace,
        validate=cfg.validate,
    )
    ce = ce.view(s, b).transpose(0, 1).contiguous()  # [b, s], as Megatron returns it
    digit_logits = digit_logits.view(s, b, -1).transpose(0, 1)
    layout = number_layout(labels, vocab, cfg.ignore_index)
    if cfg.loss == "ce":
        term = torch.zeros_like(ce)
    else:
        # Rows that are not digit targets see zeros: no NaN/inf of theirs reaches the term.
        z = torch.where(layout.is_digit.unsqueeze(-1), digit_logits, 0.0)
        w = _place_weights(cfg.loss, layout, z.dtype)
        term = HEADS[cfg.loss](z.reshape(-1, z.size(-1)), layout.digit.reshape(-1), w.reshape(-1))
        term = term.view(b, s)
    return LossPieces(ce, term, layout.is_digit, digit_logits, layout.digit)


def numerical_lm_loss(
    labels: torch.Tensor,
    logits: torch.Tensor,
    cfg: NumericalLossConfig,
    tp_group: ProcessGroup = None,
    return_parts: bool = False,
) -> Union[torch.Tensor, LossParts]:
    """Cross-entropy plus a digit-aware term, per token.

    labels [b, s] int64; logits [s, b, V_local] (whole vocab when tp_group is None, else this
    rank's contiguous shard). Returns fp32 [b, s] (fp64 for fp64 logits), 0 where labels ==
    ignore_index. "token" reduction: CE_t + alpha * term_t. "digit" reduction: CE_t + alpha *
    term_t * n_tokens / n_digits, so that the mean over non-ignored tokens is the spec's
    per-micro-batch digit reduction. With return_parts, a LossParts of [b, s] tensors instead.
    """
    pieces = loss_pieces(labels, logits, cfg, tp_group)
    if return_parts:
        return LossParts(ce=pieces.ce, term=pieces.term, is_digit=pieces.is_digit)
    if cfg.loss == "ce":
        return pieces.ce
    term = pieces.term
    if cfg.reduction == "digit":
        n_tokens = (labels != cfg.ignore_index).sum().to(term.dtype)
        n_digits = pieces.is_digit.sum().clamp(min=1).to(term.dtype)
        term = term * (n_tokens / n_digits)
    return pieces.ce + cfg.alpha * term
