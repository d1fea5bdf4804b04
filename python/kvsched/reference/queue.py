"""The waiting queue, in policy order. Mirrors ``rust/kvsched-core/src/queue.rs``.

fcfs: a deque (preempted requests go back to the front); priority: a heap on ``(effective priority,
arrival_time, req_id)`` with lazy removal; fair: one FIFO per tenant (``fair.py``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TypeAlias

from .fair import _FairQueue, _Tenant
from .request import _Request


class _FcfsQueue:
    """fcfs waiting queue: new requests at the back, preempted ones at the front."""

    def __init__(self) -> None:
        self._q: deque[_Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[_Request]:
        return iter(self._q)

    def add(self, r: _Request) -> None:
        self._q.append(r)

    def add_preempted(self, r: _Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> _Request:
        return self._q[0]

    def pop(self) -> _Request:
        return self._q.popleft()

    def remove(self, r: _Request) -> None:
        self._q.remove(r)  # O(n), but only on abort / stop-while-preempted

    def replace_front(self, reqs: list[_Request]) -> None:
        """Overwrite the first ``len(reqs)`` entries (the admission window's reordering)."""
        for k, r in enumerate(reqs):
            self._q[k] = r


class _PriorityQueue:
    """priority waiting queue: a heap on ``(effective priority, arrival_time, req_id)``; removal is lazy.

    With ``priority_aging_steps = A > 0`` the effective priority is ``priority * A + arrival_step``: ordering by it
    is ordering by ``priority - age / A`` at any common step (one level per ``A`` steps of age), a static key.

    Live requests have distinct ids, so the key orders them totally; the sequence number only keeps heapq from
    comparing request objects when a stale entry shares a key with a live one.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], int, _Request]] = []
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Request]:
        return (r for _, seq, r in self._heap if r.queue_seq == seq)

    def add(self, r: _Request) -> None:
        r.queue_seq = next(self._seq)
        heapq.heappush(self._heap, (r.priority_key(), r.queue_seq, r))
        self._len += 1

    add_preempted = add

    def _drop_stale(self) -> None:
        while self._heap and self._heap[0][2].queue_seq != self._heap[0][1]:
            heapq.heappop(self._heap)

    def peek(self) -> _Request:
        self._drop_stale()
        return self._heap[0][2]

    def pop(self) -> _Request:
        self._drop_stale()
        r = heapq.heappop(self._heap)[2]
        r.queue_seq = -1
        self._len -= 1
        return r

    def remove(self, r: _Request) -> None:
        r.queue_seq = -1
        self._len -= 1


_WaitingQueue: TypeAlias = _FcfsQueue | _PriorityQueue | _FairQueue


def _new_waiting_queue(policy: str, tenants: dict[str, _Tenant]) -> _WaitingQueue:
    """An empty waiting queue for ``policy`` ("fcfs", "priority" or "fair")."""
    return _FcfsQueue() if policy == "fcfs" else _PriorityQueue() if policy == "priority" else _FairQueue(tenants)
