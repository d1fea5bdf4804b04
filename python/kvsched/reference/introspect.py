"""What hosts that mirror the scheduler's state read of it (the vLLM adapter, a router), and tests: views of its
queues and of the prefix cache, each a fresh list, and the KV cache events recorded since the last take. Mirrors
``rust/kvsched-core/src/introspect.rs``.
"""

from __future__ import annotations

from ..kv_events import KVCacheEvents
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

    def take_kv_cache_events(self) -> KVCacheEvents:
        """The KV cache events since the last call, in the order they happened (none unless
        ``enable_kv_cache_events``)."""
        width = 32 if self._config.prefix_hash_algo == "sha256" else 16
        if self._events is None:
            return KVCacheEvents.empty(self._bs, width)
        return self._events.take(self._bs, width)

    def cached_block_hashes(self) -> list[bytes]:
        """The hash of every block in the prefix cache, in block id order (one entry per block)."""
        return [h for h in self._block_hash if h is not None]
