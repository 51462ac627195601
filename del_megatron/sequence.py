"""Where a rank's sequence positions sit in the whole sequence: context parallelism and packing.

Megatron's load-balanced context parallelism cuts a sequence of S positions into 2 * cp chunks
and gives rank r chunks r and 2 * cp - 1 - r, in that order. With packed (THD) sequences it does
so per document, over the padded document offsets cu_seqlens_padded. Numbers are found on the
whole sequence: the labels (small) are all-gathered over the CP group, and each rank keeps the
layout at its own positions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be a 1-D tensor of document offsets [0, ..., total] (as in "
            "PackedSeqParams.cu_seqlens_q)"
        )
    offsets = cu_seqlens.long()
    if (
        int(offsets[0]) != 0
        or int(offsets[-1]) != total
        or bool((offsets[1:] < offsets[:-1]).any())
    ):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the packed length {total}, got {cu_seqlens.tolist()}"
        )
    return offsets


def doc_starts(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """bool [total]: True at the first position of every packed document."""
    offsets = _check_cu_seqlens(cu_seqlens, total).to(device)
    starts = torch.zeros(total + 1, dtype=torch.bool, device=device)
    starts[offsets] = True
    return starts[:total]


def cp_positions(
    local_len: int, cp_size: int, cp_rank: int, cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """int64 [local_len]: the whole-sequence position of each of this CP rank's positions.

    Without cu_seqlens: chunks cp_rank and 2 * cp_size - 1 - cp_rank of 2 * cp_size. With
    cu_seqlens (padded document offsets of the whole packed sequence): the same per document.
    """
    total = local_len * cp_size
    if cu_seqlens is None:
        offsets = torch.tensor([0, total])
    else:
        offsets = _check_cu_seqlens(cu_seqlens, total).cpu()
    pieces = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"a sequence of {length} positions cannot be cut into 2 * cp = {2 * cp_size} "
                "equal chunks: pad every (packed) sequence to a multiple of 2 * cp, as Megatron "
                "requires for context parallelism (cu_seqlens_padded)"
            )
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    positions = torch.cat(pieces)
    if positions.numel() != local_len:
        raise ValueError(
            f"labels hold {local_len} positions on this CP rank, but the layout gives "
            f"{positions.numel()}: cu_seqlens must describe the whole packed sequence"
        )
    return positions


def gather_sequence(
    labels: torch.Tensor,
    cp_group: dist.ProcessGroup,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(whole labels [b, S], this rank's positions [s_local]) from local labels [b, s_local].

    One all-gather of the labels over the CP group (b * S int64: 8 bytes a position).
    """
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    b, local_len = labels.shape
    pieces = [torch.empty_like(labels) for _ in range(cp_size)]
    dist.all_gather(pieces, labels.contiguous(), group=cp_group)
    whole = torch.empty(b, local_len * cp_size, dtype=labels.dtype, device=labels.device)
    for rank, piece in enumerate(pieces):
        positions = cp_positions(local_len, cp_size, rank, cu_seqlens).to(labels.device)
        whole[:, positions] = piece
    local = cp_positions(local_len, cp_size, cp_rank, cu_seqlens).to(labels.device)
    return whole, local
