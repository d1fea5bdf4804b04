"""A vLLM encoder-cache (EC) connector (scheduler role) behind kvsched's core EC hooks, and a read-only view of
the core's encoder cache in the shape of vLLM's ``EncoderCacheManager``.

The core calls three hooks while it schedules (docs/semantics.md, "Encoder-cache connector"): ``has_cache_item``
with its 64-bit hash of an encoder input, ``ensure_cache_available`` and ``update_state_after_alloc`` with a
request id (the latter once the request is scheduled, for each input it computes, then each it loads).
:class:`EcBridge` turns them into vLLM's calls with the input's identifier and the vLLM ``Request``, on the
scheduler's ``ec_connector`` as it is at the call (a test may replace its methods). The rest of vLLM's EC
connector interface is called by the adapter itself, at the points vLLM's scheduler calls it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EcBridge", "EncoderCacheView"]


class EcBridge:
    """Core-side EC hooks (hash / request id keyed) calling the adapter's vLLM EC connector."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def has_cache_item(self, mm_hash: int) -> bool:
        s = self._scheduler
        return bool(s.ec_connector.has_cache_item(s._mm.identifier(mm_hash)))

    def ensure_cache_available(self, req_id: str, num_computed_tokens: int) -> bool:
        s = self._scheduler
        available = bool(s.ec_connector.ensure_cache_available(s.requests[req_id], num_computed_tokens))
        if not available and s._bridge is not None:
            s._bridge.ec_deferred(req_id)
        return available

    def update_state_after_alloc(self, req_id: str, input_index: int) -> None:
        s = self._scheduler
        s.ec_connector.update_state_after_alloc(s.requests[req_id], input_index)


class EncoderCacheView:
    """The core's encoder cache as vLLM's tests and tools read ``Scheduler.encoder_cache_manager``: ``cached``
    (identifier -> ids of the requests referencing it; an empty set for an entry kept only for reuse) and
    ``cache_size``. Read-only: the core owns the cache."""

    def __init__(self, scheduler: Any) -> None:
        object.__setattr__(self, "_scheduler", scheduler)

    @property
    def cached(self) -> dict[str, set[str]]:
        s = self._scheduler
        if s._mm is None:
            return {}
        return {s._mm.identifier(h): set(ids) for h, ids in s._core.encoder_cache_entries().items()}

    @property
    def cache_size(self) -> int:
        return int(self._scheduler._core.config.encoder_cache_size)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"EncoderCacheView is a read-only view of kvsched's encoder cache: it has no {name!r} (it shows cached "
            "and cache_size; kvsched's core allocates and frees the entries itself)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"EncoderCacheView is a read-only view of kvsched's encoder cache: {name!r} cannot be set (kvsched's "
            "core allocates and frees the entries itself)"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)
