"""Run a test body on several real processes joined by a gloo process group."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, megatron_tp, megatron_pp, megatron_cp, megatron_vp, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        if megatron_tp:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=megatron_tp,
                pipeline_model_parallel_size=megatron_pp,
                context_parallel_size=megatron_cp,
                virtual_pipeline_model_parallel_size=megatron_vp,
            )
        fn(*args)
    finally:
        if megatron_tp:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    megatron_tp: int = 0,
    megatron_pp: int = 1,
    megatron_cp: int = 1,
    megatron_vp: Optional[int] = None,
):
    """Call fn(*args) on `world_size` spawned processes (gloo). With megatron_tp, Megatron-Core's
    parallel_state is initialised with that tensor- (and megatron_pp pipeline-, megatron_cp
    context-, megatron_vp virtual-pipeline-) parallel size.
    A failing rank fails the caller with its traceback."""
    mp.spawn(
        _entry,
        args=(
            world_size,
            free_port(),
            megatron_tp,
            megatron_pp,
            megatron_cp,
            megatron_vp,
            fn,
            args,
        ),
        nprocs=world_size,
    )
