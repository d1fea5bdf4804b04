"""kvsched: a microsecond LLM inference scheduler core in Rust, with a typed Python API.

The public names below are loaded lazily, so ``import kvsched`` is cheap and never imports torch; the native
extension is loaded on first use of :class:`Scheduler`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import (
    ClientAttributeError,
    DuplicateRequestError,
    InternalError,
    InvalidConfigError,
    InvalidOutputError,
    InvalidRequestError,
    KVConnectorError,
    QueueFullError,
    SchedulerError,
    SchedulerTypeError,
    UnknownRequestError,
)
from ._types import FinishReason, RequestStatus, SchedulerStats, TenantStats
from .config import SchedulerConfig

if TYPE_CHECKING:
    from ._core import ModelInputs, SchedulerOutput, UpdateResult
    from .engine import LLM, CompletionOutput, RequestOutput, SamplingParams
    from .scheduler import Scheduler

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "ClientAttributeError",
    "CompletionOutput",
    "DuplicateRequestError",
    "FinishReason",
    "InternalError",
    "InvalidConfigError",
    "InvalidOutputError",
    "InvalidRequestError",
    "KVConnectorError",
    "ModelInputs",
    "QueueFullError",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulerTypeError",
    "TenantStats",
    "UnknownRequestError",
    "UpdateResult",
    "__version__",
]

_LAZY = {
    "Scheduler": "scheduler",
    "SchedulerOutput": "_core",
    "UpdateResult": "_core",
    "ModelInputs": "_core",
    "LLM": "engine",
    "SamplingParams": "engine",
    "RequestOutput": "engine",
    "CompletionOutput": "engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsched' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
