"""VocabParallelLayout: how a loss's tensors are split over ranks, one object beside
NumericalLossConfig (what the run means) and the execution keywords (how it is computed).

numerical_lm_loss, loss_parts and numerical_linear_loss take it as `layout=`; their loose
keywords (tp_group=, cp_group=, cu_seqlens=, cp_balancing=, sequence_parallel=) still work in
0.2, each with one FutureWarning line, and go in 0.3.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .sequence import BALANCINGS, check_balancing

ProcessGroup = Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class VocabParallelLayout:
    """How the loss's inputs sit on this rank.

    tp_group:          the tensor-parallel group the vocabulary is sharded over: each rank's
                       logits (or output weight) are its contiguous shard, as Megatron's
                       ColumnParallelLinear gives them. None MEANS THE WHOLE VOCABULARY IS HERE
                       (not "the default TP group", as in Megatron-Core's CE).
    cp_group:          the context-parallel group, when labels and logits hold this rank's
                       load-balanced chunks of the sequence (Megatron's layout); None: the whole
                       sequence is here.
    cu_seqlens:        int offsets [D + 1] of packed documents in the whole sequence (THD,
                       labels [1, T]; under CP Megatron's cu_seqlens_padded), or None.
    cp_balancing:      how CP cut packed sequences: "document" (each document in 2 * cp chunks,
                       Megatron's default for THD) or "sequence" (the whole packed sequence in
                       2 * cp chunks: core 0.19's hybrid context parallelism).
    sequence_parallel: numerical_linear_loss only: hidden is this rank's slice of the positions
                       [s/tp, b, h], as Megatron's --sequence-parallel hands it to the output
                       layer (gathered over tp_group inside).
    """

    tp_group: ProcessGroup = None
    cp_group: ProcessGroup = None
    cu_seqlens: Optional[torch.Tensor] = None
    cp_balancing: str = "document"
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        check_balancing(self.cp_balancing)
        if self.cu_seqlens is not None and not isinstance(self.cu_seqlens, torch.Tensor):
            raise TypeError(
                f"cu_seqlens must be a tensor of document offsets, got {type(self.cu_seqlens)}"
            )
        if not isinstance(self.sequence_parallel, bool):
            got = self.sequence_parallel
            raise TypeError(f"sequence_parallel must be True or False, got {got!r}")


LOOSE = tuple(f.name for f in fields(VocabParallelLayout))
DEPRECATED = (
    "del_megatron: {function}({names}) is deprecated and goes in 0.3: pass "
    "layout=VocabParallelLayout({names})"
)


def layout_of(
    function: str, layout: Any, loose: Dict[str, Any], allowed: tuple = LOOSE
) -> VocabParallelLayout:
    """The VocabParallelLayout of a call to `function`: `layout` itself, or built from the
    loose keywords `loose` (and a process group or None given where `layout` stands, the old
    positional tp_group), with one FutureWarning naming them. TypeError for a keyword
    `function` does not take, or for both ways at once."""
    unknown = sorted(set(loose) - set(allowed))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    if isinstance(layout, VocabParallelLayout):
        if loose:
            raise TypeError(
                f"{function}() got layout= and {', '.join(sorted(loose))}: give the layout only"
            )
        return layout
    if layout is not None:  # the old positional tp_group
        if "tp_group" in loose:
            raise TypeError(f"{function}() got tp_group twice (positional and keyword)")
        loose = {"tp_group": layout, **loose}
    if loose:
        names = ", ".join(f"{name}=" for name in sorted(loose))
        warnings.warn(DEPRECATED.format(function=function, names=names), FutureWarning, 3)
    return VocabParallelLayout(**loose)


__all__ = ["BALANCINGS", "LOOSE", "VocabParallelLayout", "layout_of"]
