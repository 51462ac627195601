"""The process groups the loss and the step accounting run over, found from the model.

A model built with decentralized process groups carries them (its tp_group, cp_group,
pg_collection); otherwise they are Megatron's parallel_state's. megatron-core is imported at
call time, so this module imports with torch alone.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from . import registration as reg


def unwrapped_model(model: Any) -> Any:
    """The model inside DDP / Float16Module / a virtual-pipeline list."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def process_groups(model: Any = None) -> Tuple[Any, Any, Any]:
    """(data-parallel, data-parallel x context-parallel, tensor-parallel) groups of `model`:
    its pg_collection (decentralized process groups) when it has one, else parallel_state."""
    groups = getattr(unwrapped_model(model), "pg_collection", None) if model is not None else None
    if groups is not None and all(hasattr(groups, name) for name in ("dp", "dp_cp", "tp")):
        return groups.dp, groups.dp_cp, groups.tp
    from megatron.core import parallel_state as ps

    return (
        ps.get_data_parallel_group(),
        ps.get_data_parallel_group(with_context_parallel=True),
        ps.get_tensor_model_parallel_group(),
    )


def model_tp_group(module: Any) -> dist.ProcessGroup:
    """The model's tensor-parallel group (its own, its pg_collection's, else parallel_state's)."""
    from megatron.core import parallel_state

    pg_collection = getattr(module, "pg_collection", None)
    group = getattr(module, "tp_group", None) or getattr(pg_collection, "tp", None)
    return group or parallel_state.get_tensor_model_parallel_group()


def logits_tp_group(module: Any, logits: torch.Tensor) -> Optional[dist.ProcessGroup]:
    """The TP group the logits are sharded over, or None when they hold the whole vocab
    (parallel_output=False, or runtime_gather_output: the output layer gathered them)."""
    group = model_tp_group(module)
    world = dist.get_world_size(group)
    if world == 1:
        return None
    columns = logits.size(-1)
    vocab_size = getattr(module, "vocab_size", None)
    if vocab_size is None:
        return group if getattr(module, "parallel_output", True) else None
    if columns * world == vocab_size:
        return group
    if columns == vocab_size:
        return None
    raise ValueError(
        f"logits have {columns} vocab columns, neither the model's vocab of {vocab_size} nor "
        f"its 1/{world} tensor-parallel shard: they are not what the output layer gives"
    )


def model_cp_group(module: Any) -> Optional[dist.ProcessGroup]:
    """Megatron's context-parallel group when the sequence is split over more than one rank."""
    from megatron.core import parallel_state

    group = getattr(module, "cp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def cp_split(module: Any, params: Any) -> Tuple[Optional[dist.ProcessGroup], str]:
    """(context-parallel group or None, cp_balancing): how the sequences of the forward in
    progress, whose PackedSeqParams are `params` (None: none, capture.packed_seq_params), are
    split over context-parallel ranks. Hybrid context parallelism (core 0.19:
    PackedSeqParams.local_cp_size set) cuts each micro-batch's whole packed sequence in
    2 * local_cp_size chunks over that micro-batch's own group (PackedSeqParams.cp_group; none
    when local_cp_size is 1); otherwise the model's CP group, balanced as the registration says
    (register's cp_balancing)."""
    local_cp_size = getattr(params, "local_cp_size", None)
    if local_cp_size is None:
        registration = reg.current()
        balancing = registration.cp_balancing if registration is not None else "document"
        return model_cp_group(module), balancing
    group = getattr(params, "cp_group", None) if local_cp_size > 1 else None
    if local_cp_size > 1 and (group is None or dist.get_world_size(group) != local_cp_size):
        raise ValueError(
            f"PackedSeqParams.local_cp_size is {local_cp_size} but its cp_group is "
            f"{'missing' if group is None else f'of {dist.get_world_size(group)} ranks'}: "
            "hybrid context parallelism hands each micro-batch's CP group with it"
        )
    return group, "sequence"
