"""The public entry: numerical_lm_loss and its peers on Megatron-shaped tensors.

Composes kernel -> number layout -> head -> reduction: a kernel (kernels/) gives per-token CE and
the ten digit logits, numbers.py locates every digit in its number (over the whole sequence under
context parallelism or packing), a head (heads.py) turns digit logits into the numerical term,
and the reduction puts CE and alpha * term together. The math is docs/DEL.md.

NumericalLossConfig (config.py) says what a run means; how it is computed (kernel, inplace,
validate, chunk_tokens) is a keyword argument of the functions below.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .config import CE_TERM_LOSSES, LOSSES, REDUCTIONS, NumericalLossConfig
from .digits.numbers import (
    DigitPlaces,
    check_label_dtype,
    del_weights,
    dist2_weights,
    number_layout,
    select_positions,
)
from .digits.slots import length_conditioned
from .digits.vocab import NUM_DIGITS, DigitVocab
from .heads import HEADS
from .kernels import ProcessGroup, digit_cross_entropy
from .kernels.linear import DEFAULT_WEIGHT_GRADIENT, SequenceParallelGather
from .layout import LOOSE, VocabParallelLayout, layout_of
from .sequence import doc_starts, gather_sequence

__all__ = [
    "CE_TERM_LOSSES",
    "LOSSES",
    "REDUCTIONS",
    "LossParts",
    "NumericalLossConfig",
    "VocabParallelLayout",
    "digit_term_scale",
    "loss_parts",
    "numerical_linear_loss",
    "numerical_lm_loss",
]


class LossParts(NamedTuple):
    """Per-token pieces of the loss, each over [b, s] (this rank's positions); S is the vocab's
    max_digits (1, or 3 for a chunking vocab: one slot per digit of a number token):

    ce            fp32 per-token cross-entropy over the whole vocab (0 where ignored)
    term          fp32 numerical term before alpha (DEL: the sum over the label's digits of
                  place weight x l; digit_ce: ce x the label's digits), 0 off number-token
                  targets
    is_digit      bool, the label is a number token (a digit token, one digit a token) and not
                  ignored
    digit_logits  fp32 [b, s, 10] the raw logits of the ten digits (one digit a token), or
                  [b, s, 3, 10] the slot logits of each digit of the label (docs/DEL.md)
    digit         int64 target digit 0..9 where is_digit, else 0 ([b, s, 3] per slot)
    n_tokens      [] int64 loss tokens of the whole sequence (all CP ranks)
    n_digits      [] int64 digit targets of the whole sequence (all CP ranks), in digits
    digit_count   int64, digits the label holds (is_digit for one digit a token)
    """

    ce: torch.Tensor
    term: torch.Tensor
    is_digit: torch.Tensor
    digit_logits: torch.Tensor
    digit: torch.Tensor
    n_tokens: torch.Tensor
    n_digits: torch.Tensor
    digit_count: torch.Tensor

    def token_loss(self, weight: float) -> torch.Tensor:
        """[b, s] CE_t + weight * term_t (weight: NumericalLossConfig.token_weight): the
        "token" reduction, and what the model returns."""
        return self.ce + weight * self.term


def digit_term_scale(n_tokens: torch.Tensor, n_digits: torch.Tensor) -> torch.Tensor:
    """The "digit" reduction: the factor [] on the term of the token form CE_t + alpha * term_t
    that turns a sum divided by n_tokens (the normaliser the loss is divided by) into alpha x
    the term's mean over n_digits digit targets: n_tokens / n_digits (no digits counts one).
    Every scope computes it here: a sequence (numerical_lm_loss), a micro-batch and a training
    step (megatron/loss_func.py's term_weight, accounting.py). Floating tensors, on the device:
    no host sync."""
    return n_tokens / n_digits.clamp(min=1)


# Any fixed vocab serves loss="ce": its digit logits are computed but unused.
_CE_ONLY_VOCAB = DigitVocab(range(NUM_DIGITS))


def _check_not_empty(shape, what: str) -> None:
    if any(size == 0 for size in shape):
        raise ValueError(
            f"{what} is {list(shape)}: a sequence, batch or vocab of length 0 has no loss to "
            "compute; pass at least one position of at least one sequence"
        )


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
    _check_not_empty(logits.shape, "logits [seq, batch, vocab_local]")
    if tuple(labels.shape) != (b, s):
        raise ValueError(
            f"labels must be [batch, seq] = [{b}, {s}] to match logits [seq, batch, vocab_local] "
            f"= {list(logits.shape)}, got {list(labels.shape)} (Megatron passes labels [b, s] "
            "and logits [s, b, V/tp])"
        )


def _place_weights(loss: str, layout: DigitPlaces, dtype: torch.dtype) -> torch.Tensor:
    if loss == "del":
        return del_weights(layout, dtype)
    if loss == "dist2":
        return dist2_weights(layout, dtype)
    return layout.in_slot.to(dtype)


def _check_config(cfg: NumericalLossConfig) -> None:
    if not isinstance(cfg, NumericalLossConfig):
        raise TypeError(f"cfg must be a NumericalLossConfig, got {type(cfg).__name__}")


def _vocab(cfg: NumericalLossConfig) -> DigitVocab:
    return cfg.vocab if cfg.vocab is not None else _CE_ONLY_VOCAB


def _flat_target(labels: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [s * b] int64, in the row order of logits [s, b, V].view(-1, V)."""
    return labels.transpose(0, 1).reshape(-1).long()


class _Layout(NamedTuple):
    """This rank's DigitPlaces [b, s_local] and the loss-token and digit counts of the whole
    (unsplit) sequence."""

    local: DigitPlaces
    n_tokens: torch.Tensor
    n_digits: torch.Tensor


def _sequence_layout(
    labels: torch.Tensor, cfg: NumericalLossConfig, seq: VocabParallelLayout
) -> _Layout:
    """Numbers are located on the whole sequence: gathered over the CP group, cut at packed
    document starts."""
    whole, positions, cu_seqlens = labels, None, seq.cu_seqlens
    if _world(seq.cp_group) > 1:
        whole, positions = gather_sequence(labels, seq.cp_group, cu_seqlens, seq.cp_balancing)
    doc_start = None
    if cu_seqlens is not None:
        if whole.size(0) != 1:
            raise ValueError(
                f"cu_seqlens describes one packed row (THD, labels [1, T]), got labels of "
                f"shape {list(labels.shape)}"
            )
        doc_start = doc_starts(cu_seqlens, whole.size(1), whole.device).unsqueeze(0)
    layout = number_layout(whole, _vocab(cfg), cfg.ignore_index, doc_start)
    n_tokens = (whole != cfg.ignore_index).sum()
    n_digits = layout.digit_count.sum()
    if positions is not None:
        layout = select_positions(layout, positions)
    return _Layout(layout, n_tokens, n_digits)


def _compose_parts(
    labels: torch.Tensor,
    ce: torch.Tensor,
    digit_logits: torch.Tensor,
    cfg: NumericalLossConfig,
    sequence: VocabParallelLayout,
) -> LossParts:
    """ce [s * b] and digit logits [s * b, W] of a kernel (W: the vocab's number tokens) ->
    LossParts of [b, s]."""
    b, s = labels.shape
    vocab = _vocab(cfg)
    slots = vocab.max_digits
    ce = ce.view(s, b).transpose(0, 1).contiguous()  # [b, s], as Megatron returns it
    digit_logits = digit_logits.view(s, b, -1).transpose(0, 1).contiguous()
    seq = _sequence_layout(labels, cfg, sequence)
    layout = seq.local
    # [b, s, S, 10]: a chunking vocab's slot logits, else the ten digit logits as one slot
    digit_logits = digit_logits.view(b, s, slots, NUM_DIGITS)
    if vocab.chunked and cfg.slot_logits == "length":
        digit_logits = length_conditioned(
            digit_logits.view(-1, slots, NUM_DIGITS), layout.digit.view(-1, slots)
        ).view(b, s, slots, NUM_DIGITS)
    if cfg.loss == "ce":
        term = torch.zeros_like(ce)
    elif cfg.loss in CE_TERM_LOSSES:
        # the token's CE once per digit its label holds (one digit a token: CE at digit targets)
        term = ce * layout.digit_count.to(ce.dtype)
    else:
        # Slots that hold no target digit see zeros: no NaN/inf of theirs reaches the term.
        z = torch.where(layout.in_slot.unsqueeze(-1), digit_logits, 0.0)
        w = _place_weights(cfg.loss, layout, z.dtype)
        term = HEADS[cfg.loss](z.reshape(-1, z.size(-1)), layout.digit.reshape(-1), w.reshape(-1))
        term = term.view(b, s, slots).sum(dim=-1)
    digit = layout.digit
    if not vocab.chunked:
        digit_logits, digit = digit_logits.squeeze(-2), digit.squeeze(-1)
    return LossParts(
        ce,
        term,
        layout.is_digit,
        digit_logits,
        digit,
        seq.n_tokens,
        seq.n_digits,
        layout.digit_count,
    )


def _kernel_parts(
    inputs: Tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    cfg: NumericalLossConfig,
    layout: VocabParallelLayout,
    how: dict,
) -> LossParts:
    """A kernel's per-token CE and digit logits for `inputs` [s * b, ...] -> LossParts."""
    target = _flat_target(labels)
    ce, digit_logits = digit_cross_entropy(
        inputs,
        target,
        _vocab(cfg),
        layout.tp_group,
        ignore_index=cfg.ignore_index,
        slot_logits=cfg.slot_logits,
        **how,
    )
    return _compose_parts(labels, ce, digit_logits, cfg, layout)


def _result(
    parts: LossParts, cfg: NumericalLossConfig, return_parts: bool
) -> Union[torch.Tensor, LossParts]:
    if return_parts:
        return parts
    if cfg.loss == "ce":
        return parts.ce
    scale = None
    if cfg.counts_digits:  # the sequence's own counts
        dtype = parts.term.dtype
        scale = digit_term_scale(parts.n_tokens.to(dtype), parts.n_digits.to(dtype))
    return parts.token_loss(cfg.term_weight(scale))


def numerical_lm_loss(
    labels: torch.Tensor,
    logits: torch.Tensor,
    cfg: NumericalLossConfig,
    layout: Optional[VocabParallelLayout] = None,
    return_parts: bool = False,
    *,
    kernel: str = "auto",
    inplace: bool = False,
    validate: bool = True,
    chunk_tokens: Optional[int] = None,
    **loose: Any,
) -> Union[torch.Tensor, LossParts]:
    """Cross-entropy plus a digit-aware term, per token (docs/DEL.md).

    labels [b, s] int64; logits [s, b, V_local]. Returns fp32 [b, s] (fp64 for fp64 logits), 0
    where labels == ignore_index. "digit" reduction: CE_t + alpha * term_t * n_tokens / n_digits,
    so that the mean over non-ignored tokens is mean CE + alpha * sum(term) / n_digits. "token"
    reduction: CE_t + alpha / digit_share * term_t (the same mean where the sequence's digit
    share is digit_share). With return_parts, the LossParts instead.

    layout: how the tensors are split over ranks (VocabParallelLayout; None: one rank holds the
    whole vocabulary and the whole sequence). Under tensor parallelism each rank's logits are
    its contiguous vocab shard (layout.tp_group); under context parallelism, this rank's
    load-balanced chunks of the sequence (layout.cp_group: every digit is weighed, and the
    "digit" reduction counted, as in the whole sequence, with one all-gather of the labels);
    with packed documents (layout.cu_seqlens), numbers never run across a document start. The
    loose keywords tp_group=, cp_group=, cu_seqlens=, cp_balancing= of 0.1 still work in 0.2,
    with a FutureWarning.

    How it is computed (results agree to rounding):
    kernel:       "auto", "softmax", "recompute" or "compiled" (kernels/__init__.py's table)
    inplace:      let the logits be overwritten (by their gradient; under "softmax", fp32 logits
                  by the softmax first) to save an [N, V/tp] buffer, as Megatron's CE does
    validate:     check label ids against the vocab (on the device: no host sync) and the
                  shard sizes (on the host, the first time a group sees a shard size)
    chunk_tokens: rows a "recompute"/"compiled" pass converts at once
    """
    layout = layout_of("numerical_lm_loss", layout, loose, _LM_LOOSE)
    _check_config(cfg)
    _check_inputs(labels, logits)
    how = dict(kernel=kernel, inplace=inplace, validate=validate, chunk_tokens=chunk_tokens)
    inputs = (logits.reshape(-1, logits.size(-1)),)
    parts = _kernel_parts(inputs, labels, cfg, layout, how)
    return _result(parts, cfg, return_parts)


# The loose keywords of 0.1 (VocabParallelLayout's fields) each entry still takes in 0.2.
_LM_LOOSE = ("tp_group", "cp_group", "cu_seqlens", "cp_balancing")


def loss_parts(
    labels: torch.Tensor,
    logits: torch.Tensor,
    cfg: NumericalLossConfig,
    layout: Optional[VocabParallelLayout] = None,
    **how: Any,
) -> LossParts:
    """The per-token LossParts numerical_lm_loss composes its result from, before any reduction
    (numerical_lm_loss(..., return_parts=True)); keyword arguments as there."""
    loose = {name: how.pop(name) for name in list(how) if name in LOOSE}
    layout = layout_of("loss_parts", layout, loose, _LM_LOOSE)
    return numerical_lm_loss(labels, logits, cfg, layout, return_parts=True, **how)


def numerical_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cfg: NumericalLossConfig,
    layout: Optional[VocabParallelLayout] = None,
    return_parts: bool = False,
    *,
    loss_mask: Optional[torch.Tensor] = None,
    kernel: str = "auto",
    inplace: bool = False,
    validate: bool = True,
    chunk_tokens: Optional[int] = None,
    weight_gradient: str = DEFAULT_WEIGHT_GRADIENT,
    **loose: Any,
) -> Union[torch.Tensor, LossParts]:
    """numerical_lm_loss(labels, hidden @ weight.T, cfg, layout, ...) without the logits.

    hidden [s, b, h] (the output layer's input: this CP rank's positions, the whole sequence on
    every tensor-parallel rank), weight [V_local, h] (this rank's shard of the output layer; the
    whole one without layout.tp_group), labels [b, s] int64. layout as in numerical_lm_loss,
    and layout.sequence_parallel: hidden is [s/tp, b, h], this rank's slice of the positions, as
    Megatron's --sequence-parallel hands it to the output layer (labels stay [b, s]); it is
    all-gathered over tp_group here ([s, b, h], small beside the logits) and its gradient comes
    back sliced. Tokens are processed chunk_tokens at a time (default: kernels/linear.py's
    default_chunk_tokens) and multiplied out again in backward. Gradients reach hidden (summed
    over the tensor-parallel group) and weight.

    loss_mask [b, s]: the weights the caller's reduction puts on each token's loss, as Megatron's
    loss_func does (sum(loss * loss_mask) times one scale). On the "forward" weight-gradient
    route, forward then also forms the gradients, and backward only scales them; the upstream
    gradient must then be proportional to loss_mask (checked on the device, no host sync; refused
    otherwise: for another reduction pass weight_gradient="backward", or no loss_mask).

    weight_gradient: where the gradients are formed. "forward" (with loss_mask): in forward,
    the weight's summed over the token chunks into an fp32 [V_local, h] accumulator held until
    backward, 3 matmuls as the materialised path. "backward": in backward, vocab tile by vocab
    tile, one matmul more, nothing [V_local, h] but the gradient and an fp32 [N, h] for
    grad_hidden. "auto": the route kernels/linear.py's resolve_weight_gradient picks from
    N = s * b, h, V_local and the dtype: "forward" in fp32, "backward" in fp16 ("forward" is
    refused there), in bf16 by the size of "forward"'s buffers (docs/api.md).

    It has one kernel, "linear": kernel must be "auto" or "linear", and inplace False (there are
    no logits to overwrite); anything else is refused. The loose keywords of 0.1 (tp_group=,
    cp_group=, cu_seqlens=, cp_balancing=, sequence_parallel=) still work in 0.2, with a
    FutureWarning.
    """
    layout = layout_of("numerical_linear_loss", layout, loose)
    _check_config(cfg)
    tp_group = layout.tp_group
    _check_linear_inputs(hidden, weight, labels, tp_group, layout.sequence_parallel)
    ce_weights = None if loss_mask is None else _flat_loss_mask(loss_mask, labels)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        ce_weights = None  # no backward (evaluation): form no gradients in forward
    if cfg.loss in CE_TERM_LOSSES:
        ce_weights = None  # ce's gradient is weighed again at digit targets: not loss_mask's
    if layout.sequence_parallel and _world(tp_group) > 1:
        hidden = SequenceParallelGather.apply(hidden, tp_group)
    how = dict(kernel=kernel, inplace=inplace, validate=validate, chunk_tokens=chunk_tokens)
    how.update(ce_weights=ce_weights, weight_gradient=weight_gradient)
    inputs = (hidden.reshape(-1, hidden.size(-1)), weight)
    parts = _kernel_parts(inputs, labels, cfg, layout, how)
    return _result(parts, cfg, return_parts)


def _flat_loss_mask(loss_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [s * b], in the rows' order (as _flat_target), detached."""
    if not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape) != tuple(labels.shape):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask)
        raise ValueError(
            f"loss_mask must be [batch, seq] like labels {tuple(labels.shape)}, got {got}"
        )
    return loss_mask.detach().transpose(0, 1).reshape(-1)


def _world(group: ProcessGroup) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _check_linear_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tp_group: ProcessGroup,
    sequence_parallel: bool,
) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 3:
        raise ValueError(
            f"hidden must be [seq, batch, hidden] as Megatron's output layer takes it, got shape "
            f"{tuple(hidden.shape)}"
        )
    _check_not_empty(hidden.shape, "hidden [seq, batch, hidden]")
    if weight.dim() != 2 or weight.size(1) != hidden.size(2):
        raise ValueError(
            f"weight must be [vocab_local, hidden] = [V/tp, {hidden.size(2)}] (the output layer's "
            f"weight shard), got shape {tuple(weight.shape)}"
        )
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must share one floating dtype, got {hidden.dtype} and "
            f"{weight.dtype} (cast the weight, or run the output layer under the same autocast)"
        )
    check_label_dtype(labels)
    local, b, _ = hidden.shape
    tp = _world(tp_group)
    s = local * tp if sequence_parallel else local
    if not sequence_parallel and tp > 1 and labels.dim() == 2 and labels.size(0) == b:
        if labels.size(1) == local * tp:
            raise ValueError(
                f"hidden holds {local} of the {labels.size(1)} positions: it is "
                "sequence-parallel. Pass layout=VocabParallelLayout(..., "
                "sequence_parallel=True) (it is gathered inside)"
            )
    if tuple(labels.shape) != (b, s):
        held = f"{tp} sequence-parallel slices of " if sequence_parallel else ""
        raise ValueError(
            f"labels must be [batch, seq] = [{b}, {s}] to match hidden [seq, batch, hidden] = "
            f"{held}{list(hidden.shape)}, got {list(labels.shape)}"
        )
