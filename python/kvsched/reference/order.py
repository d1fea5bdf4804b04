"""Waiting-queue keys and FCFS within tiers. Mirrors ``rust/kvsched-core/src/order.rs``.

A key compares ``(tier, rank, deadline, arrival_time, req_id)``, smallest first: ``tier`` is the request's
``order_key`` (0 when not given); rank the effective priority (priority), the residual prompt blocks beyond the
prefix hit (sjf) or 0 (slo); deadline the slo deadline (0 under the other policies). A *front key* (sjf, slo:
what fcfs puts at the front) has the same tier and a rank below every policy rank, the most recent push first.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import TypeAlias

from .request import _Request

Key: TypeAlias = tuple[int, int, float, float, str]


def _order_key(policy: str, r: _Request) -> Key:
    """The key ``r`` is queued by under ``policy`` (the Rust core's ``Scheduler::order_key``)."""
    rank = r.effective_priority if policy == "priority" else r.sjf_residual if policy == "sjf" else 0
    return (r.order_key, rank, r.deadline if policy == "slo" else 0.0, r.arrival_time, r.req_id)


def _front_key(r: _Request, seq: int) -> Key:
    """The ``seq``-th push to the front: below every policy rank, the later the smaller (``front_rank``)."""
    return (r.order_key, -(2**100) - seq, 0.0, 0.0, r.req_id)


def _is_front(key: Key) -> bool:
    return key[1] < -(2**99)


class _TierQueue:
    """FCFS within tiers (fcfs, and each tenant of fair): per tier, new requests at the back, preempted ones at
    the front; tiers ascending."""

    def __init__(self) -> None:
        self._tiers: dict[int, deque[_Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Request]:
        return itertools.chain.from_iterable(self._tiers[t] for t in sorted(self._tiers))

    def add(self, r: _Request) -> None:
        self._tiers.setdefault(r.order_key, deque()).append(r)
        self._len += 1

    def add_preempted(self, r: _Request) -> None:
        self._tiers.setdefault(r.order_key, deque()).appendleft(r)
        self._len += 1

    def first_tier(self) -> deque[_Request]:
        """The deque of the smallest tier (the admission window reorders its front)."""
        return self._tiers[min(self._tiers)]

    def peek(self) -> _Request:
        return self.first_tier()[0]

    def pop(self) -> _Request:
        t = min(self._tiers)
        r = self._tiers[t].popleft()
        if not self._tiers[t]:
            del self._tiers[t]
        self._len -= 1
        return r

    def remove(self, r: _Request) -> None:
        q = self._tiers[r.order_key]
        q.remove(r)  # O(n), but only on abort / stop-while-preempted / aging
        if not q:
            del self._tiers[r.order_key]
        self._len -= 1

    def in_order(self) -> list[_Request]:
        return list(self)

    def copy(self) -> _TierQueue:
        copy = _TierQueue()
        copy._tiers = {t: deque(q) for t, q in self._tiers.items()}
        copy._len = self._len
        return copy
