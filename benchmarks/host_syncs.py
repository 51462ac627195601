"""Find what would make a CUDA host wait, on any device (a CPU included).

    with HostSyncs() as syncs:
        loss = numerical_lm_loss(...); loss.sum().backward()
    assert not syncs.events, syncs.report()

On CUDA a host sync drains the stream: the CPU stops queueing work ahead of the GPU, and the
step cannot be captured into a CUDA graph. torch.cuda.set_sync_debug_mode finds them on a GPU
only; HostSyncs finds their causes on a CPU as well:

- "item":        a value read on the host (.item(), bool(), int(), float() of a tensor:
                 aten._local_scalar_dense, and .tolist() / .numpy());
- "host data":   a tensor made from Python data (torch.tensor, torch.as_tensor of a list, a
                 Python list used as an index, a Python number set into a tensor by indexing:
                 aten.lift_fresh), which on CUDA is a host-to-device copy;
- "device copy": a copy between devices (aten._to_copy / copy_ across devices), and .cpu() /
                 .cuda() even where the tensor is there already;
- "data-dependent shape": an output whose size depends on values (nonzero, masked_select,
                 boolean-mask indexing, unique, repeat_interleave without output_size).

Each event keeps the innermost frame outside torch that caused it (file:line).
Only torch is needed (benchmarks/gpu_check/ and the tests use it).
"""

from __future__ import annotations

import collections
import os
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

KINDS = ("item", "host data", "device copy", "data-dependent shape")
_VALUE_READS = {aten._local_scalar_dense.default}
_HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
# Tensor methods that never dispatch on a CPU tensor (or move data by design).
_METHODS = ("tolist", "numpy", "cpu", "cuda")


@dataclass(frozen=True)
class Event:
    """One cause of a host sync: its kind, the operation and where it was called (file:line)."""

    kind: str
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


# Paths under the repository are shown from its root.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames of torch's own machinery are not where a sync is caused.
_TORCH_FRAMES = (f"{os.sep}torch{os.sep}", "<frozen ", f"{os.sep}contextlib.py")


def _where() -> str:
    """file:line of the innermost frame outside torch and this file (paths from the package
    down: del_megatron/..., megatron/...)."""
    frames = [
        f
        for f in traceback.extract_stack()
        if f.filename != __file__ and not any(s in f.filename for s in _TORCH_FRAMES)
    ]
    if not frames:
        return "?"
    path = frames[-1].filename
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}del_megatron{os.sep}"):
        if marker in path:
            path = path[path.index(marker) + len(marker) :]
            path = ("del_megatron" + os.sep + path) if "del_megatron" in marker else path
            break
    else:
        if path.startswith(_ROOT):
            path = path[len(_ROOT) :]
    return f"{path}:{frames[-1].lineno}"


class _Mode(TorchDispatchMode):
    def __init__(self, record: Callable[[str, str], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS:
            self.record("item", str(func))
        elif func in _HOST_DATA:
            self.record("host data", str(func))
        elif func in _DATA_DEPENDENT:
            self.record("data-dependent shape", str(func))
        elif func is aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        ):
            self.record("data-dependent shape", "boolean-mask index")
        elif func in _COPIES:
            devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if "device" in kwargs and kwargs["device"] is not None:
                devices.add(torch.device(kwargs["device"]))
            if len(devices) > 1:
                self.record("device copy", str(func))
        return func(*args, **kwargs)


class HostSyncs:
    """Context manager that records every cause of a host sync in its span (module docstring)
    into `events`, from any thread that runs under it (autograd's CPU backward included)."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self._saved: Dict[str, Callable] = {}
        self._mode: Optional[_Mode] = None

    def _record(self, kind: str, op: str) -> None:
        self.events.append(Event(kind, op, _where()))

    def __enter__(self) -> HostSyncs:
        self._mode = _Mode(self._record)
        self._mode.__enter__()
        for name in _METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._method(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        self._mode.__exit__(*exc)

    def _method(self, name: str, original: Callable) -> Callable:
        syncs = self

        def method(tensor, *args, **kwargs):
            syncs._record("item" if name in ("tolist", "numpy") else "device copy", f".{name}()")
            return original(tensor, *args, **kwargs)

        return method

    def in_files(self, prefix: str) -> List[Event]:
        """The events caused in files whose path starts with prefix ("del_megatron/...")."""
        return [e for e in self.events if e.where.startswith(prefix)]

    def counts(self) -> Dict[str, int]:
        return dict(collections.Counter(e.kind for e in self.events))

    def report(self) -> str:
        """One line per distinct event, with how often it happened."""
        lines = collections.Counter(str(e) for e in self.events)
        return "\n".join(f"{n} x {line}" for line, n in lines.most_common()) or "no host syncs"
