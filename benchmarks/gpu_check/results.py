"""The results file: one JSON line a row, written as each row comes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import List, Optional

import torch


class Results:
    """Rows written as they come: printed, and appended to the JSON lines file."""

    def __init__(self, path: Path, fresh: bool = True) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh or not path.exists():
            path.write_text("")
        self.rows: List[dict] = []

    def add(self, stage: str, check: str, ok: Optional[bool], **fields) -> dict:
        row = {"stage": stage, "check": check, "ok": ok, **fields}
        self.rows.append(row)
        line = json.dumps(row, default=_jsonable)
        print(line, flush=True)
        with self.path.open("a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell():  # after a stage killed mid-line, the row starts a line of its own
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write(line.encode() + b"\n")
        return row


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    return repr(value)


def read_rows(path: Path) -> List[dict]:
    """The rows of a results file; a line cut short by a kill is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return rows
