"""Tenants and weighted fair share: the Virtual Token Counter (VTC). Mirrors ``rust/kvsched-core/src/fair.rs``.

Each tenant has a weight and a virtual counter of the weighted service it received: ``fair_prefill_weight /
weight`` per prompt token computed for the first time (cached prefix tokens and recomputation after a preemption
are free) and ``fair_decode_weight / weight`` per output token. A tenant whose waiting queue goes from empty to
non-empty is lifted to the smallest counter among the other tenants with waiting requests, so idling earns no
credit. The fair waiting queue keeps one FIFO per tenant (per tier within it) and serves the tenant whose head
has the smallest tier, then the smallest counter.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ..config import SchedulerConfig
from .order import _TierQueue
from .request import _Request


class _Tenant:
    """A tenant's weight, virtual counter (VTC), service received and number of waiting requests."""

    __slots__ = (
        "counter",
        "decode_rate",
        "name",
        "num_decode_tokens",
        "num_prefill_tokens",
        "num_waiting",
        "prefill_rate",
        "weight",
    )

    def __init__(self, name: str, weight: float, config: SchedulerConfig) -> None:
        self.name = name
        self.counter = 0.0
        self.num_prefill_tokens = self.num_decode_tokens = self.num_waiting = 0
        self.set_weight(weight, config)

    def set_weight(self, weight: float, config: SchedulerConfig) -> None:
        """The charge per token is ``rate * tokens`` with ``rate = w / weight`` (the Rust core's expression)."""
        self.weight = weight
        self.prefill_rate = config.fair_prefill_weight / weight
        self.decode_rate = config.fair_decode_weight / weight

    def charge(self, tokens: int, decode: bool) -> None:
        """Count ``tokens`` of prefill (or decode) service; the counter grows by ``rate * tokens``."""
        if tokens > 0:
            self.counter += (self.decode_rate if decode else self.prefill_rate) * tokens  # as the Rust core computes it
            if decode:
                self.num_decode_tokens += tokens
            else:
                self.num_prefill_tokens += tokens


class _Tenants(dict[str, _Tenant]):
    """Every tenant seen so far, by name, in registration order (the configured weights first), and the virtual
    counters' bookkeeping on them."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__((t, _Tenant(t, w, config)) for t, w in config.tenant_weights.items())
        self._config = config

    def intern(self, name: str) -> _Tenant:
        """The tenant ``name``, registered (weight 1.0, counter 0) on first sight."""
        t = self.get(name)
        if t is None:
            t = self[name] = _Tenant(name, 1.0, self._config)
        return t

    def on_arrival(self, t: _Tenant) -> None:
        """A new request of ``t`` is waiting: lift an idle tenant to the smallest counter of the others waiting."""
        if t.num_waiting == 0:
            others = [u.counter for u in self.values() if u is not t and u.num_waiting > 0]
            if others:
                t.counter = max(t.counter, min(others))
        t.num_waiting += 1

    def charge_prompt(self, r: _Request, start: int, n: int) -> None:
        """Charge the prompt positions in ``start..start + n`` not charged before (recompute is free)."""
        end = min(start + n, r.num_prompt_tokens)
        self[r.tenant].charge(max(0, end - max(start, r.num_charged_prompt_tokens)), False)
        r.num_charged_prompt_tokens = max(r.num_charged_prompt_tokens, end)


class _FairQueue:
    """fair waiting queue: one tiered FIFO per tenant (``order._TierQueue``); the next request is the head of the
    tenant with the smallest ``(head tier, counter, head arrival_time, name)``. Preempted requests return to the
    front of their tenant's tier."""

    def __init__(self, tenants: dict[str, _Tenant]) -> None:
        self._tenants = tenants
        self._queues: dict[str, _TierQueue] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Request]:
        return itertools.chain.from_iterable(self._queues.values())

    def add(self, r: _Request) -> None:
        self._queues.setdefault(r.tenant, _TierQueue()).add(r)
        self._len += 1

    def add_preempted(self, r: _Request) -> None:
        self._queues.setdefault(r.tenant, _TierQueue()).add_preempted(r)
        self._len += 1

    def _pick(self) -> _TierQueue:
        keys = []
        for t, q in self._queues.items():
            if len(q):
                head = q.peek()
                keys.append((head.order_key, self._tenants[t].counter, head.arrival_time, t))
        return self._queues[min(keys)[3]]

    def peek(self) -> _Request:
        return self._pick().peek()

    def pop(self) -> _Request:
        self._len -= 1
        return self._pick().pop()

    def remove(self, r: _Request) -> None:
        self._queues[r.tenant].remove(r)
        self._len -= 1

    def in_order(self) -> list[_Request]:
        """The order of repeated pops if the counters stayed as they are."""
        copy = self.copy()
        return [copy.pop() for _ in range(len(copy))]

    def copy(self) -> _FairQueue:
        copy = _FairQueue(self._tenants)
        copy._queues = {t: q.copy() for t, q in self._queues.items()}
        copy._len = self._len
        return copy
