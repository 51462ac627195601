"""What keeps the host out of the per-step path: small constant tensors made once per device,
and input checks made on the device.

On CUDA a host sync (.item(), bool(), .tolist(), a Python list used as an index, a blocking
host-to-device copy) drains the stream, so the CPU can no longer queue work ahead of the GPU,
and it cannot be captured into a CUDA graph. The loss path keeps its index tensors on the
device (on_device) and checks values there (check_on_device).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

# (key, device) -> the tensor on_device made for it.
_MADE: Dict[Tuple, torch.Tensor] = {}


def on_device(
    key: Tuple, device: torch.device, make: Callable[[torch.device], torch.Tensor]
) -> torch.Tensor:
    """make(device), made once per (key, device) and kept; callers must not write into it.
    `make` should fill its tensor on the device with scalar fills (int_tensor), which copy
    nothing from the host, so even the first call does not sync. Not kept while traced by
    torch.compile or captured into a CUDA graph: each call makes its own there. Fake tensors
    (FakeTensorMode) are kept by their mode, for as long as it lives (a chunked kernel asks for
    the same index tensors once a chunk)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    made = _store(device)
    if made is None:
        return make(device)
    tensor = made.get((key, device))
    if tensor is None:
        tensor = made[(key, device)] = make(device)
    return tensor


def _store(device: torch.device) -> Optional[Dict[Tuple, torch.Tensor]]:
    """Where tensors made for `device` now are kept: _MADE, the active FakeTensorMode's own
    dict (its fake tensors are valid only inside it), or None (compiling, capturing)."""
    from torch._guards import detect_fake_mode

    if torch.compiler.is_compiling():
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    mode = detect_fake_mode()
    if mode is None:
        return _MADE
    return vars(mode).setdefault("_del_megatron_made", {})


def int_tensor(values: Tuple[int, ...]) -> Callable[[torch.device], torch.Tensor]:
    """make(device) for on_device: int64 [len(values)] holding values, filled on the device
    with one fill or arange per run of equal or consecutive values (a vocab's 1,110 number
    tokens are often one run)."""

    def make(device: torch.device) -> torch.Tensor:
        tensor = torch.empty(len(values), dtype=torch.long, device=device)
        for start, length, step in _runs(values):
            first, part = values[start], tensor.narrow(0, start, length)
            if step == 0:
                part.fill_(first)
            else:
                part.copy_(torch.arange(first, first + length, dtype=torch.long, device=device))
        return tensor

    return make


def _runs(values: Tuple[int, ...]) -> List[Tuple[int, int, int]]:
    """(start, length, step) of the maximal runs of `values` with step 0 or 1, in order."""
    runs: List[Tuple[int, int, int]] = []
    start = 0
    while start < len(values):
        step = 1 if start + 1 < len(values) and values[start + 1] == values[start] + 1 else 0
        end = start + 1
        while end < len(values) and values[end] == values[end - 1] + step:
            end += 1
        runs.append((start, end - start, step))
        start = end
    return runs


# CUDA's torch._assert_async refuses, on the host, a message of this many characters or more.
CUDA_ASSERT_MESSAGE_LIMIT = 255


def check_on_device(
    ok: torch.Tensor, message: str, details: Optional[Callable[[], str]] = None
) -> None:
    """Refuse unless the bool tensor `ok` [] holds, without a host sync (torch._assert_async).
    On a CPU the check runs at once and raises ValueError(message, with details() when given);
    on CUDA a failing check stops the step with a device-side assert carrying `message` (so it
    must be shorter than CUDA_ASSERT_MESSAGE_LIMIT characters, checked here on every device)."""
    if len(message) >= CUDA_ASSERT_MESSAGE_LIMIT:
        raise AssertionError(f"check_on_device message of {len(message)} characters: {message}")
    if ok.device.type != "cpu":
        torch._assert_async(ok, message)
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        extra = details() if details is not None else ""
        raise ValueError(message + extra) from None
