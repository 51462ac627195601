"""One key space per torchrun restart attempt in the rendezvous store.

With a static rendezvous, torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True)
and keeps it when it restarts the workers. The killed round's keys are still there: a restarted
gloo rank can read its peer's old address before the peer writes the new one, and dials a dead
process ("Gloo connectFullMesh failed ... Connection refused"). Each attempt's process group
gets its own prefix (TORCHELASTIC_RESTART_COUNT), so it reads only its own round's keys.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
from typing import Callable, Optional

import torch.distributed as dist

PREFIX = "del_megatron/attempt_"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def attempt_store(timeout: Optional[datetime.timedelta] = None) -> Optional[dist.Store]:
    """A client of the agent's store with this attempt's prefix, or None when this process does
    not run under a torchrun agent that hosts the store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout or DEFAULT_TIMEOUT,
    )
    return dist.PrefixStore(f"{PREFIX}{attempt}", store)


def per_attempt(init_process_group: Callable) -> Callable:
    """`init_process_group` that rendezvouses in this attempt's key space when it would use
    the agent's store (no store, env:// or no init_method); unchanged otherwise."""
    signature = inspect.signature(init_process_group)

    @functools.wraps(init_process_group)
    def init_in_this_attempt(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        call = bound.arguments
        if call.get("store") is None and call.get("init_method") in (None, "env://"):
            store = attempt_store(call.get("timeout"))
            if store is not None:
                call.pop("init_method", None)
                call["store"] = store
                if call.get("rank", -1) < 0:
                    call["rank"] = int(os.environ["RANK"])
                if call.get("world_size", -1) < 0:
                    call["world_size"] = int(os.environ["WORLD_SIZE"])
        return init_process_group(*bound.args, **bound.kwargs)

    init_in_this_attempt.del_megatron_per_attempt = True
    return init_in_this_attempt


def install() -> None:
    """torch.distributed.init_process_group rendezvouses per attempt in this process."""
    if not getattr(dist.init_process_group, "del_megatron_per_attempt", False):
        dist.init_process_group = per_attempt(dist.init_process_group)
