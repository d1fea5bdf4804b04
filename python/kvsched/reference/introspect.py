"""Read-only views of the scheduler's queues, for hosts that mirror its state (the vLLM adapter) and for tests.
Mirrors ``rust/kvsched-core/src/introspect.rs``. Each call builds a fresh list.
"""

from __future__ import annotations

from .admission import _AdmissionMixin


class _IntrospectMixin(_AdmissionMixin):
    """The running and waiting ids, and a request's cached blocks."""

    def running_req_ids(self) -> list[str]:
        return [r.req_id for r in self._running]

    def waiting_req_ids(self) -> list[str]:
        """Requests not running in the order admission would consider them (fair: at the current counters, as
        if admitting charged nothing; aging included; sjf residuals as they stand; fcfs: before the admission
        window's one-step reorderings): loaded requests first, then waiting, then the parked ones (blocked, or
        ready since the last step) in the order added."""
        ids = [r.req_id for r in self._kv_waiting.in_order()]
        ids += [r.req_id for r in self._waiting_in_order()]
        parked = sorted((r for r in self._requests.values() if r.parked), key=lambda r: r.add_seq)
        return ids + [r.req_id for r in parked]

    def get_num_cached_blocks(self, req_id: str) -> int:
        return self._get(req_id).num_cached_blocks
