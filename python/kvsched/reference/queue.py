"""The waiting queue, in policy order. Mirrors ``rust/kvsched-core/src/queue.rs`` (and the keys of
``order.rs``).

fcfs: one deque per tier (``order_key``, 0 when not given), tiers ascending; new requests at the back of their
tier, preempted ones (and those an admission pass skipped, or made ready) at its front. priority, sjf, slo: a
heap on ``(tier, rank, deadline, arrival_time, req_id)`` with lazy removal, where rank is the effective priority
(priority), the residual prompt blocks beyond the prefix hit (sjf) or 0 (slo) and deadline the slo deadline (0
otherwise); under sjf and slo what fcfs puts at the front gets a *front key*: the front of its tier, the most
recently pushed first. fair: one tiered FIFO per tenant (``fair.py``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import TypeAlias

from .fair import _FairQueue, _Tenant
from .order import Key, _front_key, _order_key, _TierQueue
from .request import _Request

_FcfsQueue = _TierQueue  # fcfs: FCFS within tiers
_QUEUE_SEQ = itertools.count(1)  # entry numbers of every keyed queue (see _KeyedQueue)


class _KeyedQueue:
    """priority, sjf and slo waiting queue: a heap on the policy's key; removal is lazy. With ``fronts`` (sjf,
    slo) a push to the front gets a front key; under priority a preempted request is pushed by its key.

    With ``priority_aging_steps = A > 0`` the effective priority is ``priority * A + arrival_step``: ordering by it
    is ordering by ``priority - age / A`` at any common step (one level per ``A`` steps of age), a static key.

    Live requests have distinct ids, so the key orders them totally; the sequence number only keeps heapq from
    comparing request objects when a stale entry shares a key with a live one. Sequence numbers come from one
    counter for every queue: a request moves between ``waiting`` and ``kv_waiting``, and a stale entry it left in
    one queue must never match the number its entry in the other got.
    """

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self._fronts = policy != "priority"
        self._heap: list[tuple[Key, int, _Request]] = []
        self._num_front_pushes = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Request]:
        return (r for _, seq, r in self._heap if r.queue_seq == seq)

    def _push(self, r: _Request, key: Key) -> None:
        if r.queue_seq < 0:
            self._len += 1
        r.queue_seq = next(_QUEUE_SEQ)
        heapq.heappush(self._heap, (key, r.queue_seq, r))

    def add(self, r: _Request) -> None:
        self._push(r, _order_key(self._policy, r))

    def add_preempted(self, r: _Request) -> None:
        if self._fronts:
            self._num_front_pushes += 1
            self._push(r, _front_key(r, self._num_front_pushes))
        else:
            self.add(r)

    def rekey(self, r: _Request) -> None:
        """``r`` (in the queue) goes back in by its key as it is now."""
        self.add(r)

    def _drop_stale(self) -> None:
        while self._heap and self._heap[0][2].queue_seq != self._heap[0][1]:
            heapq.heappop(self._heap)

    def peek(self) -> _Request:
        self._drop_stale()
        return self._heap[0][2]

    def peek_key(self) -> Key:
        self._drop_stale()
        return self._heap[0][0]

    def pop(self) -> _Request:
        self._drop_stale()
        r = heapq.heappop(self._heap)[2]
        r.queue_seq = -1
        self._len -= 1
        return r

    def remove(self, r: _Request) -> None:
        r.queue_seq = -1
        self._len -= 1

    def in_order(self) -> list[_Request]:
        return [r for _, seq, r in sorted(self._heap, key=lambda e: (e[0], e[1])) if r.queue_seq == seq]


_WaitingQueue: TypeAlias = _FcfsQueue | _KeyedQueue | _FairQueue


def _new_waiting_queue(policy: str, tenants: dict[str, _Tenant]) -> _WaitingQueue:
    """An empty waiting queue for ``policy``."""
    if policy == "fcfs":
        return _FcfsQueue()
    if policy == "fair":
        return _FairQueue(tenants)
    return _KeyedQueue(policy)
