"""Cache-aware admission (fcfs only): warm requests before cold ones inside a bounded window. Mirrors
``rust/kvsched-core/src/admission.rs``.

When ``cache_aware_admission_window`` is set and the KV usage is at or above
``cache_aware_admission_threshold``, phase B sees the first ``window`` waiting requests reordered for this step:
among the plain new requests those with a cached prefix go first, then the cold ones, each group in queue order.
After phase B the requests it did not admit return to their original order.
"""

from __future__ import annotations

import itertools

from .._errors import InternalError
from .._types import RequestStatus
from .kv_cache_manager import _KVCacheManagerMixin
from .queue import _FcfsQueue
from .request import _Request


class _AdmissionMixin(_KVCacheManagerMixin):
    """The admission window's reordering and its undoing."""

    def _begin_admission(self) -> list[_Request] | None:
        """Reorder the first ``window`` waiting requests for this step: warm peers, then cold peers, in the
        positions peers hold. Returns the original front, or None when nothing moved."""
        c = self._config
        usage = 1.0 - len(self._free) / c.num_usable_blocks
        if not c.cache_aware_admission_window or usage < c.cache_aware_admission_threshold:
            return None
        q = self._waiting
        assert isinstance(q, _FcfsQueue)  # the config allows a window with fcfs only
        original = list(itertools.islice(q, c.cache_aware_admission_window))
        peers = [k for k, r in enumerate(original) if r.status == RequestStatus.WAITING]
        warm = [k for k in peers if self._has_cached_prefix(original[k])]
        cold = [k for k in peers if k not in warm]
        source = list(range(len(original)))
        for slot, k in zip(peers, warm + cold, strict=True):
            source[slot] = k
        if source == sorted(source):
            return None
        q.replace_front([original[k] for k in source])
        return original

    def _has_cached_prefix(self, r: _Request) -> bool:
        """The admission probe: would at least one block hit? Reads the cache map only."""
        return not r.skip_reading_prefix_cache and bool(self._lookup(r.block_hashes, r.num_tokens)[:1])

    def _end_admission(self, original: list[_Request] | None) -> None:
        """Put the window's requests that are still in the waiting queue back in their original order (at its
        front: phase B puts the ones it skipped back there). Those it admitted left the queue, and so did those
        it admitted with an asynchronous KV load (to the KV-waiting queue, under ``park_kv_loads=False``)."""
        if original is None:
            return
        q = self._waiting
        assert isinstance(q, _FcfsQueue)
        in_queue = {id(r) for r in q}
        left = [r for r in original if id(r) in in_queue]
        if {id(r) for r in itertools.islice(q, len(left))} != {id(r) for r in left}:
            raise InternalError("the admission window's requests are not at the front of the queue")
        q.replace_front(left)
