"""The "digit" reduction over a whole training step: micro-batches and data-parallel ranks.

Megatron normalises the summed per-token loss of each micro-batch either by the global number of
loss tokens (calculate_per_token_loss: grads scaled by 1 / sum over micro-batches and DP x CP
ranks) or per micro-batch (loss / n_tokens / num_microbatches, grads averaged over DP x CP). The
"digit" reduction wants the numerical term divided by the global number of digit targets
instead. That count must be known before the step's first backward, so DigitAccounting looks
ahead: on the first batch of each step it pulls all of the step's micro-batches from the data
iterator, counts loss tokens and digit targets, and all-reduces the two counts over the ranks
whose batches make the global batch (the DP group when every CP rank reads whole sequences, as in
Megatron-LM and Bridge; one collective of 2 numbers per step). Each micro-batch's term is then
scaled so that, after Megatron's own normalisation, the step's loss is

    sum(CE * m) / (Megatron's token normaliser) + alpha * sum(term * m) / N_digits_global

whatever the cut into micro-batches and ranks.

ShareWatch is the token reduction's counterpart: there the weight on the mean term is alpha only
while the share of loss tokens that are digit targets is the digit share the run was given (it
is in effect alpha x measured / given). It sums the measured counts on the device, a micro-batch
at a time, reads them once per log interval, and warns once when the interval's share differs
from the given one by more than FACTOR either way.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..config import NumericalLossConfig
from ..device import check_on_device
from ..digits.numbers import number_layout
from ..digits.vocab import DigitVocab
from ..loss import digit_term_scale
from . import groups
from . import registration as reg

NO_COUNTS = (
    "DigitAccounting has no counts for this step: pass the data iterator through "
    "accounting.wrap(...) (or call count(batches)) before the step's forward passes"
)


def _dict_labels_and_mask(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    return batch["labels"], batch.get("loss_mask")


class DigitAccounting:
    """Global counts of one step's loss tokens and digit targets, and the term scale from them.

    vocab / ignore_index: as in NumericalLossConfig. num_microbatches: micro-batches a step
    (an int, or a function read at each step, e.g. Megatron's get_num_microbatches).
    group: the ranks whose batches together make the global batch: the DP x CP group when each
    CP rank's iterator yields its own chunks, the DP group when every CP rank reads the whole
    sequences (Megatron-LM); None: one rank. ranks: the DP x CP size Megatron averages over
    (default: the size of `group`). per_token_loss: Megatron's calculate_per_token_loss.
    share_group / share_src: ranks that compute the loss without reading data (Megatron-LM's
    tensor-parallel ranks other than the first) receive the counts by a broadcast from global
    rank share_src before every use. labels_and_mask: batch -> (labels [b, s], loss_mask [b, s]
    or None); default reads a Megatron-LM dict batch. eval_microbatches: micro-batches an
    evaluation step runs (an int or a function; None: as many as a training step), for the
    caller to wrap evaluation iterators with.
    """

    def __init__(
        self,
        vocab: DigitVocab,
        num_microbatches: Union[int, Callable[[], int]],
        group: Optional[dist.ProcessGroup] = None,
        per_token_loss: bool = False,
        ignore_index: int = -100,
        labels_and_mask: Callable[[Any], Tuple[torch.Tensor, Optional[torch.Tensor]]] = (
            _dict_labels_and_mask
        ),
        ranks: Optional[int] = None,
        share_group: Optional[dist.ProcessGroup] = None,
        share_src: int = 0,
        eval_microbatches: Union[None, int, Callable[[], int]] = None,
    ) -> None:
        if not callable(num_microbatches) and (
            not isinstance(num_microbatches, int) or num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        self.vocab, self._microbatches, self.group = vocab, num_microbatches, group
        self.per_token_loss, self.ignore_index = per_token_loss, ignore_index
        self.labels_and_mask = labels_and_mask
        self._ranks, self.share_group, self.share_src = ranks, share_group, share_src
        self.eval_microbatches = eval_microbatches
        self.n_tokens: Optional[torch.Tensor] = None
        self.n_digits: Optional[torch.Tensor] = None
        # Micro-batches of the window last counted: Megatron divides each one's loss by it.
        # (an int where counted, a tensor [] where received from share_src)
        self.microbatches: Union[None, int, torch.Tensor] = None
        self._on_device: Dict[torch.device, torch.Tensor] = {}
        self._outer: Optional[DigitAccounting] = None

    @property
    def num_microbatches(self) -> int:
        return self._microbatches() if callable(self._microbatches) else self._microbatches

    @property
    def ranks(self) -> int:
        if self._ranks is not None:
            return self._ranks
        return 1 if self.group is None else dist.get_world_size(self.group)

    def _device(self, group) -> str:
        return "cuda" if dist.get_backend(group) == "nccl" else "cpu"

    def count(self, batches: List[Any], microbatches: Optional[int] = None) -> None:
        """Count this rank's loss tokens and digit targets in `batches` and sum over the group.
        microbatches: how many the step runs (Megatron's divisor; default num_microbatches).

        The counts stay tensors on the device they are summed on (the batches', or the group's
        collective device): nothing is read on the host. Batches on the host and an NCCL group
        cost one host-to-device copy of the two counts a step."""
        counts = None
        for batch in batches:
            labels, mask = self.labels_and_mask(batch)
            if mask is None:
                mask = labels != self.ignore_index
            mask = mask.reshape(labels.shape).to(torch.float64)
            # digits, not tokens: a three-digit token of a chunking vocab counts 3
            digits = number_layout(labels, self.vocab, self.ignore_index).digit_count
            these = torch.stack([mask.sum(), (digits * mask).sum()])
            counts = these if counts is None else counts.to(these.device) + these
        if counts is None:
            counts = torch.zeros(2, dtype=torch.float64)
        if self.group is not None:
            counts = counts.to(self._device(self.group))
            dist.all_reduce(counts, group=self.group)
        self.n_tokens, self.n_digits = counts.unbind()
        self.microbatches = self.num_microbatches if microbatches is None else microbatches
        self._on_device = {}

    def _share(self) -> None:
        """Broadcast the counts from share_src over share_group (-1: it has none, and every
        rank stops the step: checked on the device)."""
        device = self._device(self.share_group)
        source = dist.get_rank() == self.share_src
        if source and self.n_digits is not None:
            counts = torch.stack([self.n_tokens, self.n_digits]).to(device)
            counts = torch.cat([counts, counts.new_full((1,), float(self.microbatches))])
        else:
            counts = torch.full((3,), -1.0, dtype=torch.float64, device=device)
        dist.broadcast(counts, src=self.share_src, group=self.share_group)
        check_on_device(counts[1] >= 0, NO_COUNTS)
        if not source:
            self.n_tokens, self.n_digits, self.microbatches = counts.unbind()
            self._on_device = {}

    def wrap(
        self,
        data_iterator: Iterator,
        microbatches: Union[None, int, Callable[[], int]] = None,
    ) -> Iterator:
        """The iterator's batches, counted a step at a time: `microbatches` batches (an int, or a
        function read at every step), by default num_microbatches (read at every step: it may
        ramp up); pass eval_microbatches for an evaluation iterator."""
        while True:
            step = self.num_microbatches if microbatches is None else microbatches
            step = step() if callable(step) else step
            batches = []
            for _ in range(step):
                try:
                    batches.append(next(data_iterator))
                except StopIteration:
                    break
            if not batches:
                return
            self.count(batches, step)
            yield from batches

    def term_scale(self, microbatch_tokens: torch.Tensor) -> torch.Tensor:
        """Factor [] (fp64, on microbatch_tokens' device) for this micro-batch's summed numerical
        term (its loss tokens: microbatch_tokens) so that Megatron's normalisation turns it into
        sum(term) / N_digits_global. Reads nothing on the host; the counts are moved to that
        device once a step if they are elsewhere."""
        if self.share_group is not None and dist.get_world_size(self.share_group) > 1:
            self._share()
        if self.n_digits is None:
            raise RuntimeError(NO_COUNTS)
        n_tokens, n_digits = self._counts_on(microbatch_tokens.device)
        if not self.per_token_loss:  # Megatron divides by this micro-batch's tokens x mb x ranks
            n_tokens = self.microbatches * self.ranks * microbatch_tokens.double()
        return digit_term_scale(n_tokens, n_digits)

    def _counts_on(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        # copied to a device once per counted step, not once per micro-batch
        if self.n_digits.device == device:
            return self.n_tokens, self.n_digits
        if device not in self._on_device:
            self._on_device[device] = torch.stack([self.n_tokens, self.n_digits]).to(device)
        return self._on_device[device].unbind()

    def __enter__(self) -> DigitAccounting:
        """Make this the current registration's step accounting (register() first)."""
        registration = reg.current()
        if registration is None:
            raise RuntimeError("register() the numerical loss before entering its accounting")
        self._outer = registration.accounting
        registration.accounting = self
        return self

    def __exit__(self, *exc) -> None:
        registration = reg.current()
        if registration is not None and registration.accounting is self:
            registration.accounting = self._outer


def active() -> Optional[DigitAccounting]:
    """The current registration's step accounting, if it has one (yet)."""
    registration = reg.current()
    return registration.accounting if registration is not None else None


def for_model(
    cfg: NumericalLossConfig,
    model: Any,
    num_microbatches: Union[int, Callable[[], int]],
    *,
    per_token_loss: bool,
    share_over_tp: bool = False,
    eval_microbatches: Union[None, int, Callable[[], int]] = None,
) -> DigitAccounting:
    """The step accounting of a Megatron-LM or Megatron-Bridge run of `model`. Each data-parallel
    rank's iterator yields whole sequences (CP slices them later), so the counts are summed over
    the DP group and Megatron averages over DP x CP ranks. share_over_tp: only the first
    tensor-parallel rank reads data (Megatron-LM), and the others receive the counts by
    broadcast from it. Groups: groups.process_groups(model)."""
    dp, dp_cp, tp = groups.process_groups(model)
    share = dict(share_group=tp, share_src=dist.get_global_rank(tp, 0)) if share_over_tp else {}
    return DigitAccounting(
        cfg.vocab,
        num_microbatches,
        group=dp,
        per_token_loss=per_token_loss,
        ignore_index=cfg.ignore_index,
        ranks=dist.get_world_size(dp_cp),
        eval_microbatches=eval_microbatches,
        **share,
    )


FACTOR = 2.0

MISMATCH = (
    "del_megatron: --del-digit-share is %g, but %.4g of the loss tokens of the last %d "
    "micro-batches were digit targets (this rank's data): with --del-reduction token the "
    "weight on the mean digit term is alpha x %.4g / %g = %.4g, not alpha %g. Pass "
    "--del-digit-share %.3g (`del-megatron check --data-path` measures the share of the "
    "datasets), or drop --del-reduction token: the default 'digit' reduction counts the digit "
    "targets itself"
)


class ShareWatch:
    """given: the run's digit share; alpha: its weight; microbatches: the micro-batches of one
    log interval (read when an interval starts); reports: whether this rank logs the warning
    (one rank of those that compute the loss)."""

    def __init__(
        self,
        given: float,
        alpha: float,
        microbatches: Callable[[], int],
        reports: Callable[[], bool],
    ) -> None:
        self.given, self.alpha = given, alpha
        self._microbatches, self._reports = microbatches, reports
        self._counts: Optional[torch.Tensor] = None
        self._seen, self._interval = 0, 0
        self.warned = False
        self.measured: Optional[float] = None  # the last interval's share, once read

    def observe(self, n_digits: torch.Tensor, n_tokens: torch.Tensor) -> None:
        """Add one training micro-batch's digit targets and loss tokens (tensors [])."""
        if self.warned:
            return
        if self._seen == 0:
            self._interval = max(1, int(self._microbatches()))
        counts = torch.stack([n_digits.detach().double(), n_tokens.detach().double()])
        self._counts = counts if self._counts is None else self._counts + counts
        self._seen += 1
        if self._seen >= self._interval:
            self._check()

    def _check(self) -> None:
        digits, tokens = self._counts.tolist()  # the one host read of an interval
        seen = self._seen
        self._counts, self._seen = None, 0
        if tokens < 1:
            return
        self.measured = digits / tokens
        if self.given / FACTOR <= self.measured <= self.given * FACTOR:
            return
        self.warned = True
        if self._reports():
            effective = self.alpha * self.measured / self.given
            reg.logger.warning(
                MISMATCH,
                self.given,
                self.measured,
                seen,
                self.measured,
                self.given,
                effective,
                self.alpha,
                self.measured,
            )


def _evaluating(model: Any) -> bool:
    inner = groups.unwrapped_model(model)
    return isinstance(inner, torch.nn.Module) and not inner.training


def _current_accounting(registration: reg.Registration, model: Any) -> Optional[DigitAccounting]:
    """The registration's step accounting, made on first use and made again when the model's
    process groups are no longer the ones it holds (an in-process restart destroys and remakes
    them; the iterators counted with the old ones are forgotten)."""
    if registration.make_accounting is None:
        return registration.accounting
    current = groups.process_groups(model)
    held = registration.accounting_groups
    same = len(held) == len(current) and all(a is b for a, b in zip(held, current, strict=True))
    if registration.accounting is None or not same:
        registration.accounting = registration.make_accounting(model)
        registration.accounting_groups = current
        registration.counted.clear()
        registration.produced.clear()
    return registration.accounting


def counted(
    data_iterator: Optional[Iterator],
    model: Any = None,
    eval_microbatches: Union[None, int, Callable[[], int]] = None,
) -> Optional[Iterator]:
    """forward_step's data iterator, counted a step at a time when a step-wide "digit"
    reduction is registered (one wrapper per iterator, for every micro-batch of the step; an
    evaluation iterator by the evaluation step's micro-batch count); unchanged otherwise. The
    accounting is made on the first call (all ranks, with or without an iterator:
    tensor-parallel ranks without data receive the counts), and checked against the model's
    process groups when an iterator or a model is new, not on every micro-batch.
    eval_microbatches: an evaluation step's micro-batch count (an int or a function), when the
    accounting does not know it (Bridge's is in its state). An iterator this function returned
    comes back unchanged, so stacked calls (the drop-in over a patched pretrain_gpt.py) count a
    step once."""
    registration = reg.current()
    if registration is None:
        return data_iterator
    if data_iterator is not None and registration.produced.get(id(data_iterator)) is data_iterator:
        # Already counted: the drop-in's forward_step wrapper around a patched forward_step.
        return data_iterator
    key = id(data_iterator)
    known = registration.counted.get(key)
    new_iterator = data_iterator is not None and (known is None or known[0] is not data_iterator)
    new_model = registration.counted_models.get(id(model)) is not model
    if new_iterator or new_model or registration.accounting is None:
        registration.counted_models[id(model)] = model
        accounting = _current_accounting(registration, model)
        known = registration.counted.get(key)
    else:
        accounting = registration.accounting
    if accounting is None or data_iterator is None:
        return data_iterator
    if known is None or known[0] is not data_iterator:
        microbatches = None
        if _evaluating(model):
            microbatches = eval_microbatches or getattr(accounting, "eval_microbatches", None)
        known = (data_iterator, accounting.wrap(data_iterator, microbatches))
        registration.counted[key] = known
        registration.produced[id(known[1])] = known[1]
    return known[1]
