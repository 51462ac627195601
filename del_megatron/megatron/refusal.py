"""A refusal on Megatron-LM's command line: one line on rank 0, a non-zero exit, no traceback.

The checks themselves raise ValueError (or RuntimeError) with the cause and the fix, so that the
Python API and Bridge's and NeMo's entries get an exception to catch. On Megatron-LM's command
line (the patched pretrain_gpt.py and the drop-in), `one_line` turns an error raised by
del_megatron's own code into that one line, printed by rank 0 to stderr, and an exit with
EXIT_CODE on every rank; the other ranks exit quietly. Errors raised elsewhere (Megatron-LM's,
torch's) keep their traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from typing import Any, Callable, NoReturn, TypeVar

import torch.distributed as dist

from .state import is_rank_zero

EXIT_CODE = 2
GRACE_S = 10.0
PREFIX = "del_megatron: "
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFUSALS = (ValueError, RuntimeError)

T = TypeVar("T")


def raised_by_del_megatron(error: BaseException) -> bool:
    """Whether `error` was raised in del_megatron's own code (its innermost frame)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep)


def refusal_line(error: BaseException) -> str:
    """The refusal as one line: 'del_megatron: refused: <cause and fix>'."""
    message = " ".join(str(error).split())
    if message.startswith(PREFIX):
        message = message[len(PREFIX) :]
    return f"{PREFIX}refused: {message}"


def exit_refused(error: BaseException) -> NoReturn:
    """Print `error` as one line on rank 0 (stderr), take down the process groups (gloo aborts
    a process that exits with them alive) and exit with EXIT_CODE, without a traceback. The
    other ranks refuse the same flags at the same point: they wait up to GRACE_S first, so that
    torchrun, which stops every rank once one has failed, does not stop rank 0 before its line
    (it reports rank 0 as the failure)."""
    rank_zero = is_rank_zero()
    if rank_zero:
        sys.stdout.flush()
        print(refusal_line(error), file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if not rank_zero:
        time.sleep(GRACE_S)
    raise SystemExit(EXIT_CODE) from None


def one_line(function: Callable[..., T]) -> Callable[..., T]:
    """`function`, with a refusal raised by del_megatron's code turned into exit_refused."""

    @functools.wraps(function)
    def refusing(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except REFUSALS as error:
            if not raised_by_del_megatron(error):
                raise
            exit_refused(error)

    return refusing


def check_when_parsed(parser: argparse.ArgumentParser, check: Callable[[Any], None]) -> None:
    """Run `check(namespace)` on what `parser` parses, as soon as it has parsed it (before
    Megatron-LM validates and prints its arguments), a refusal as one line. argparse's
    parse_args goes through parse_known_args, which is wrapped on this parser only."""
    parse_known_args = parser.parse_known_args

    @functools.wraps(parse_known_args)
    def parse_and_check(*args: Any, **kwargs: Any):
        namespace, rest = parse_known_args(*args, **kwargs)
        one_line(check)(namespace)
        return namespace, rest

    parser.parse_known_args = parse_and_check
