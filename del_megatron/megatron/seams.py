"""Wrapping a Megatron-LM module-level function in place, and restoring it (resume.py's
check_checkpoint_args, interval_means.py's training_log): Megatron-LM's own code calls these by
their module's global name, so the wrapper replaces that name."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def _marker(function: str) -> str:
    return f"_del_megatron_original_{function}"


Wrapper = Callable[[Callable, Any], Callable]  # (the original, its module) -> the wrapper


def wrap(module_name: str, function: str, make_wrapper: Wrapper) -> None:
    """Replace `module_name.function` by make_wrapper(the original, the module), once (a no-op
    when the module does not import, i.e. without Megatron-LM). Idempotent."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    marker = _marker(function)
    if hasattr(module, marker):
        return
    setattr(module, marker, getattr(module, function))
    setattr(module, function, make_wrapper(getattr(module, marker), module))


def unwrap(module_name: str, function: str) -> None:
    """Restore `module_name.function` as it was before wrap(). Idempotent."""
    module = sys.modules.get(module_name)
    marker = _marker(function)
    if module is not None and hasattr(module, marker):
        setattr(module, function, getattr(module, marker))
        delattr(module, marker)
