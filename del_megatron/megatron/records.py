"""The parts behind each loss the hook returns, kept for the loss function.

The model hands the framework's loss function only the [b, s] loss tensor; the loss function
needs the CE and the term apart (the "digit" reduction, the telemetry). The hook records them,
per micro-batch, on the current Registration, and the loss function finds them by the tensor.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch

from ..loss import LossParts, NumericalLossConfig
from . import state


class Record(NamedTuple):
    """output: the [b, s] loss the hook returned; parts: the pieces behind it; cfg: the
    settings it was computed with (settings.of_model); cp_size: the
    context-parallel ranks its sequences are split over; mtp: report entries of the MTP heads
    of the same forward (telemetry.mtp_entries)."""

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
        registration.records.append(Record(output, parts, cfg, cp_size, mtp))


def find(output: torch.Tensor) -> Optional[Record]:
    registration = state.current()
    for rec in reversed(registration.records if registration is not None else ()):
        if rec.output is output:
            return rec
    return None
