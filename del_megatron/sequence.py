"""Where a rank's sequence positions sit in the whole sequence: context parallelism and packing.

Megatron's load-balanced context parallelism cuts a sequence of S positions into 2 * cp chunks
and gives rank r chunks r and 2 * cp - 1 - r, in that order ("sequence" balancing). With packed
(THD) sequences it does so per document, over the padded document offsets cu_seqlens_padded
("document" balancing, the default for packed sequences), unless the run balances the whole
packed sequence (core 0.19's hybrid context parallelism and inter-document masking do). Numbers
are found on the whole sequence: the labels (small) are all-gathered over the CP group, and each
rank keeps the layout at its own positions.

Everything here runs on the labels' device, vectorised (no Python loop over documents), and
reads no value on the host: offsets are checked there (check_on_device).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .device import check_on_device

BALANCINGS = ("document", "sequence")


def check_balancing(balancing: str) -> str:
    if balancing not in BALANCINGS:
        raise ValueError(f"cp_balancing must be one of {BALANCINGS}, got {balancing!r}")
    return balancing


def _offsets(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """int64 document offsets [d + 1] on `device`, checked (on the device) to rise from 0 to
    `total`."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be a 1-D tensor of document offsets [0, ..., total] (as in "
            "PackedSeqParams.cu_seqlens_q)"
        )
    offsets = cu_seqlens.to(device=device, dtype=torch.long)
    rises = (offsets[1:] >= offsets[:-1]).all() & (offsets[0] == 0) & (offsets[-1] == total)
    check_on_device(
        rises,
        f"cu_seqlens must rise from 0 to the packed length {total}",
        lambda: f", got {cu_seqlens.tolist()}",
    )
    return offsets


def doc_starts(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """bool [total]: True at the first position of every packed document."""
    offsets = _offsets(cu_seqlens, total, device)
    starts = torch.zeros(total + 1, dtype=torch.bool, device=device)
    return starts.index_fill_(0, offsets, True)[:total]


def _not_divisible(length: Union[int, str], cp_size: int) -> str:
    return (
        f"a sequence of {length} positions cannot be cut into 2 * cp = {2 * cp_size} equal "
        "chunks: pad every (packed) sequence to a multiple of 2 * cp, as Megatron requires for "
        "context parallelism (cu_seqlens_padded)"
    )


def _positions(
    local_len: int,
    cp_size: int,
    cp_rank: Union[int, torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    balancing: str,
    device: torch.device,
) -> torch.Tensor:
    """[..., local_len] whole-sequence positions of CP rank(s) cp_rank (an int, or int64
    [r, 1] for several ranks at once)."""
    total = local_len * cp_size
    local = torch.arange(local_len, device=device)
    if cu_seqlens is None or check_balancing(balancing) == "sequence":
        if total % (2 * cp_size):
            raise ValueError(_not_divisible(total, cp_size))
        if cu_seqlens is not None:  # checked all the same: it cuts numbers at documents
            _offsets(cu_seqlens, total, device)
        start, chunk, within = 0, total // (2 * cp_size), local
    else:
        offsets = _offsets(cu_seqlens, total, device)
        lengths = offsets[1:] - offsets[:-1]
        check_on_device((lengths % (2 * cp_size) == 0).all(), _not_divisible("some", cp_size))
        # Every document gives each rank length / cp positions, so rank-local offsets are
        # offsets / cp; a local position's document is the last one starting at or before it
        # (empty documents are skipped).
        local_offsets = offsets // cp_size
        document = torch.searchsorted(local_offsets, local, right=True) - 1
        start, chunk = offsets[document], lengths[document] // (2 * cp_size)
        within = local - local_offsets[document]
    second = within >= chunk  # the rank's second chunk: 2 * cp - 1 - rank
    index = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
    return start + index * chunk + within - second * chunk


def cp_positions(
    local_len: int,
    cp_size: int,
    cp_rank: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    balancing: str = "document",
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """int64 [local_len]: the whole-sequence position of each of this CP rank's positions, on
    `device` (default: cu_seqlens', else the CPU).

    Without cu_seqlens, or with balancing "sequence": chunks cp_rank and 2 * cp_size - 1 -
    cp_rank of 2 * cp_size. With cu_seqlens (padded document offsets of the whole packed
    sequence) and balancing "document": the same per document.
    """
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    return _positions(local_len, cp_size, cp_rank, cu_seqlens, balancing, device)


def gather_sequence(
    labels: torch.Tensor,
    cp_group: dist.ProcessGroup,
    cu_seqlens: Optional[torch.Tensor] = None,
    balancing: str = "document",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(whole labels [b, S], this rank's positions [s_local]) from local labels [b, s_local].

    One all-gather of the labels over the CP group (b * S int64: 8 bytes a position); the
    positions of all ranks are computed at once on the labels' device.
    """
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    b, local_len = labels.shape
    pieces = [torch.empty_like(labels) for _ in range(cp_size)]
    dist.all_gather(pieces, labels.contiguous(), group=cp_group)
    ranks = torch.arange(cp_size, device=labels.device).unsqueeze(-1)
    positions = _positions(local_len, cp_size, ranks, cu_seqlens, balancing, labels.device)
    whole = torch.empty(b, local_len * cp_size, dtype=labels.dtype, device=labels.device)
    whole.index_copy_(1, positions.reshape(-1), torch.cat(pieces, dim=1))
    return whole, positions[cp_rank]
