"""Workload traces as JSON Lines, so a run can be replayed exactly (by kvsched, the reference, or vLLM).

Format: the first line is a header ``{"scenario": {...}, "vocab": 32000}`` (the scenario's fields, see
:class:`~kvsched.bench.workloads.Scenario`); then one line per request, in arrival order::

    {"idx": 0, "arrival_step": 0, "priority": 0, "max_tokens": 256, "prompt_token_ids": [17, 4242, ...]}

A request line may also carry ``"tenant": k`` (an int, default 0).

The fake model's sampled tokens are not stored: they are a pure function of ``(idx, output position)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .._jsonl import TraceFormatError, iter_json_objects
from .workloads import VOCAB_SIZE, Scenario, TraceRequest, Workload

__all__ = ["TraceFormatError", "dump_trace", "load_trace"]

_REQUEST_KEYS = ("idx", "arrival_step", "priority", "max_tokens", "prompt_token_ids")


def dump_trace(workload: Workload, path: str | Path) -> Path:
    """Write ``workload`` to ``path`` (parent directories are created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"scenario": workload.scenario.to_dict(), "vocab": workload.vocab}) + "\n")
        for r in workload.requests:
            line = {
                "idx": r.idx,
                "arrival_step": r.arrival_step,
                "priority": r.priority,
                "max_tokens": r.max_tokens,
                "prompt_token_ids": r.prompt_token_ids.tolist(),
            }
            if r.tenant:
                line["tenant"] = r.tenant
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


def _parse_request(obj: Any, where: str) -> TraceRequest:
    if not isinstance(obj, dict) or any(k not in obj for k in _REQUEST_KEYS):
        raise TraceFormatError(f"{where}: a request line needs the keys {', '.join(_REQUEST_KEYS)}")
    prompt = obj["prompt_token_ids"]
    if not isinstance(prompt, list) or not prompt:
        raise TraceFormatError(f"{where}: prompt_token_ids must be a non-empty list of ints")
    try:
        return TraceRequest(
            idx=int(obj["idx"]),
            arrival_step=int(obj["arrival_step"]),
            priority=int(obj["priority"]),
            max_tokens=int(obj["max_tokens"]),
            prompt_token_ids=np.asarray(prompt, dtype=np.int32),
            tenant=int(obj.get("tenant", 0)),
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def load_trace(path: str | Path) -> Workload:
    """Read a trace written by :func:`dump_trace` (or by hand, in the same format)."""
    path = Path(path)
    requests: list[TraceRequest] = []
    header: dict[str, Any] | None = None
    for where, obj in iter_json_objects(path):
        if header is None:
            if not isinstance(obj.get("scenario"), dict):
                raise TraceFormatError(f"{where}: the first line must be a header with a 'scenario' object")
            header = obj
            continue
        requests.append(_parse_request(obj, where))
    if header is None:
        raise TraceFormatError(f"{path}: empty trace")
    try:
        scenario = Scenario.from_dict(header["scenario"])
    except TypeError as exc:
        raise TraceFormatError(f"{path}: bad scenario header ({exc})") from exc
    if len({r.idx for r in requests}) != len(requests):
        raise TraceFormatError(f"{path}: duplicate request idx")
    requests.sort(key=lambda r: (r.arrival_step, r.idx))
    vocab = int(header.get("vocab", VOCAB_SIZE))
    return Workload(scenario=scenario, requests=requests, vocab=vocab, source=str(path))
