"""What the benchmark loop needs from a scheduler implementation: the :class:`Driver` protocol, its
:class:`Counters`, and :class:`ImplUnavailableError`.

It sits below both :mod:`kvsched.bench.harness` (the loop) and the drivers that wrap other implementations
(:mod:`kvsched.bench.vllm_impl`), so a driver never imports the harness that loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .workloads import TraceRequest

__all__ = ["Counters", "Driver", "ImplUnavailableError", "IntArray"]

IntArray = npt.NDArray[np.int64]


class ImplUnavailableError(RuntimeError):
    """The requested scheduler implementation cannot be loaded here (the message says why)."""


@dataclass
class Counters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    # preemption modes (docs/semantics.md, "Preemption modes"); 0 for implementations without them
    num_recomputed_tokens: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_swap_fallbacks: int = 0


class Driver(Protocol):
    """What the loop needs from an implementation. Only ``schedule_fn``/``update_fn`` results are timed."""

    impl: str

    def add(self, req: TraceRequest, rid: str) -> None: ...
    def schedule_fn(self) -> Callable[[], Any]: ...
    def update_fn(self) -> Callable[[Any, Any], Any]: ...
    def view(self, out: Any) -> tuple[Sequence[str], npt.NDArray[Any], npt.NDArray[Any]]: ...
    def model_output(self, out: Any, req_ids: Sequence[str], values: IntArray, indptr: IntArray) -> Any: ...
    def after_update(self, result: Any) -> None: ...
    def has_unfinished(self) -> bool: ...
    def num_unfinished(self) -> int: ...
    def num_running(self) -> int: ...
    def counters(self) -> Counters: ...
