"""JSON Lines input shared by the benchmark traces (:mod:`kvsched.bench.trace`) and the simulator's traces
(:mod:`kvsched.sim.workload`): one error type, and one reader that names the file and line of every problem."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["TraceFormatError", "iter_json_objects"]


class TraceFormatError(ValueError):
    """A trace file (or a workload option) is malformed; the message says where (``path:line``)."""


def iter_json_objects(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, obj)`` for each non-blank line of the JSONL file at ``path``; ``where`` is ``"path:line"``.

    Raises :class:`TraceFormatError` if the file cannot be read, or a line is not JSON or not a JSON object.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc}") from exc
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: each line must be a JSON object")
        yield where, obj
