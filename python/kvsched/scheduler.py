"""The public :class:`Scheduler`: the Rust core with a Python-built config.

The hot path (``schedule``, ``update_from_output``, ``prepare_model_inputs``) goes straight to Rust; this
subclass only builds the config, wraps statuses and stats in Python types, and owns the rate-limited
preemption warning that the core reports after a step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import _core
from ._errors import SchedulerTypeError
from ._types import RequestStatus, SchedulerStats, TenantStats
from .config import SchedulerConfig
from .kv_events import KVCacheEvents

__all__ = ["Scheduler", "SchedulerStats"]

logger = logging.getLogger("kvsched")

# At most one preemption warning per this many seconds (per process), as vLLM does for its operators.
PREEMPTION_WARNING_INTERVAL_S = 60.0
_last_warning = [float("-inf"), 0]  # [time of the last warning, preemptions since]


def _on_preemption(num_preempted: int, total_preemptions: int) -> None:
    """Called by the core after a step that preempted requests for lack of KV blocks."""
    _last_warning[1] += num_preempted
    now = time.monotonic()
    if now - _last_warning[0] < PREEMPTION_WARNING_INTERVAL_S:
        return
    logger.warning(
        "%d request(s) preempted for lack of KV cache blocks since the last warning (%d in total for this "
        "scheduler); preempted requests recompute their KV when resumed (or, with preemption_mode 'swap' or "
        "'auto', copy it out to the CPU pool and back), which costs throughput. Consider "
        "more num_blocks, a smaller max_num_seqs or a smaller max_num_batched_tokens.",
        _last_warning[1],
        total_preemptions,
    )
    _last_warning[0] = now
    _last_warning[1] = 0


class Scheduler(_core.Scheduler):
    """The kvsched scheduler (Rust core). See ``docs/api.md`` and ``docs/semantics.md``.

    >>> from kvsched import Scheduler
    >>> sched = Scheduler(block_size=4, num_blocks=16, max_model_len=32)
    >>> sched.add_request("r0", [1, 2, 3, 4, 5], max_tokens=2)
    >>> out = sched.schedule()
    >>> out.req_ids, out.num_scheduled_tokens.tolist()
    (['r0'], [5])
    >>> res = sched.update_from_output(out, [[9]])
    >>> sched.get_output_token_ids("r0")
    [9]
    """

    def __new__(cls, config: SchedulerConfig | None = None, *, kv_connector: Any = None, **fields: Any) -> Scheduler:
        if config is None:
            try:
                config = SchedulerConfig(**fields)
            except TypeError as e:  # an unknown field name
                raise SchedulerTypeError(f"bad SchedulerConfig field: {e}") from None
        elif fields:
            raise SchedulerTypeError("pass either a SchedulerConfig or keyword fields, not both")
        elif not isinstance(config, SchedulerConfig):
            raise SchedulerTypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        return super().__new__(cls, config, kv_connector)

    def __init__(self, config: SchedulerConfig | None = None, *, kv_connector: Any = None, **fields: Any) -> None:
        # All state is built in __new__ (the Rust constructor).
        pass

    def get_request_status(self, req_id: str) -> RequestStatus:
        return RequestStatus(super().get_request_status(req_id))

    def take_kv_cache_events(self) -> KVCacheEvents:
        """The KV cache events since the last call, in the order they happened (none unless
        ``enable_kv_cache_events``; see :mod:`kvsched.kv_events`)."""
        return KVCacheEvents(*self._take_kv_cache_events(), block_size=self.config.kv_block_size)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(**self._stats_dict())

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Every tenant seen so far, in registration order: weight, virtual counter, service received."""
        return {name: TenantStats(*fields) for name, fields in self._tenant_stats()}

    def __repr__(self) -> str:
        return (
            f"Scheduler(policy={self.config.policy!r}, num_blocks={self.config.num_blocks}, "
            f"num_unfinished_requests={self.num_unfinished_requests}, num_free_blocks={self.num_free_blocks})"
        )
