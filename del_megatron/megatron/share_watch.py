"""The token reduction's digit share, checked against the one the run measures.

With --del-reduction token the weight on the mean digit term is alpha only while the share of
loss tokens that are digit targets is the --del-digit-share the run was given: it is in effect
alpha x measured / given. ShareWatch sums the measured counts on the device, a micro-batch at
a time (no host sync), reads them once per log interval, and warns once when the interval's
share differs from the given one by more than FACTOR either way.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

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
            logger.warning(
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
