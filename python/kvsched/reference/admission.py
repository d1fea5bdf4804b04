"""What phase B takes next from ``waiting`` beyond the queue's own order: aging, the sjf re-keying, and the fcfs
admission window's one-step reorderings (warm before cold, session affinity). Mirrors
``rust/kvsched-core/src/admission.rs`` (whose module doc states the rules).

- Aging (``max_wait_steps = N``): the policy's next request goes first if it was preempted; otherwise the oldest
  request of ``waiting`` (in the order requests entered it) that has waited ``N`` steps goes first.
- sjf: the head's residual is probed again at each pass; if it grew, the head goes back with the larger residual
  (at most ``SJF_MAX_REKEYS_PER_PASS`` times per pass).
- The window (fcfs): warm peers before cold ones among the first ``window`` requests of the first tier (at or
  above the threshold), then the first warm continuation of a recently active session moves to just behind the
  last preempted request ahead of it (at any KV usage). After phase B the window's requests return to their
  original relative order.
"""

from __future__ import annotations

from .._errors import InternalError
from .._types import RequestStatus
from .fair import _FairQueue
from .kv_cache_manager import _KVCacheManagerMixin
from .order import _is_front
from .queue import _FcfsQueue, _KeyedQueue
from .request import _Request

SJF_MAX_REKEYS_PER_PASS = 8


class _AdmissionMixin(_KVCacheManagerMixin):
    """Aging, the sjf re-keying, the admission window's reorderings and their undoing."""

    # -- aging and sjf ------------------------------------------------------------------------------------

    def _sjf_residual(self, r: _Request) -> int:
        """Prompt blocks beyond the prefix hit (the probe reads the cache map only)."""
        blocks = -(-r.num_tokens // self._bs)
        if r.skip_reading_prefix_cache:
            return blocks
        return blocks - len(self._lookup(r.block_hashes, r.num_tokens))

    def _oldest_aged(self, n: int, skipped: list[_Request]) -> _Request | None:
        """The oldest request of ``waiting`` (not among ``skipped``) if it has waited ``n`` steps."""
        now = self._next_step_id
        while self._aging and self._aging[0][2].wait_seq != self._aging[0][1]:
            self._aging.popleft()  # its request left waiting
        for since, seq, r in self._aging:
            if r.wait_seq != seq or any(x is r for x in skipped):
                continue
            return r if now - since >= n else None
        return None

    def _peek_waiting(self, skipped: list[_Request], rekeys: list[int]) -> tuple[_Request, bool] | None:
        """The request phase B tries next from ``waiting``, and whether aging took it out of its place.
        ``rekeys``: a one-item list, the pass's sjf re-keys so far."""
        c, q = self._config, self._waiting
        while len(q):
            h = q.peek()
            if c.max_wait_steps is not None and h.status != RequestStatus.PREEMPTED:
                a = self._oldest_aged(c.max_wait_steps, skipped)
                if a is not None:
                    return a, a is not h
            if c.policy == "sjf" and rekeys[0] < SJF_MAX_REKEYS_PER_PASS:
                assert isinstance(q, _KeyedQueue)
                if not _is_front(q.peek_key()):
                    residual = self._sjf_residual(h)
                    if residual > h.sjf_residual:
                        h.sjf_residual = residual
                        q.rekey(h)
                        rekeys[0] += 1
                        continue
            return h, False
        return None

    def _waiting_in_order(self) -> list[_Request]:
        """The order phase B would take ``waiting`` in at the next step, aging included (sjf residuals as they
        stand, without the window's reorderings)."""
        q, n = self._waiting, self._config.max_wait_steps
        if n is None:
            return q.in_order()
        now = self._next_step_id
        aged = [r for since, seq, r in self._aging if r.wait_seq == seq and now - since >= n]
        out: list[_Request] = []
        if isinstance(q, _FairQueue):
            copy = q.copy()
            while len(copy):
                h = copy.peek()
                if aged and h.status != RequestStatus.PREEMPTED:
                    a = aged.pop(0)
                    copy.remove(a)
                    out.append(a)
                else:
                    copy.pop()
                    aged = [x for x in aged if x is not h]
                    out.append(h)
            return out
        rest = q.in_order()
        while rest:
            h = rest[0]
            if aged and h.status != RequestStatus.PREEMPTED:
                a = aged.pop(0)
                rest = [x for x in rest if x is not a]
                out.append(a)
            else:
                rest.pop(0)
                aged = [x for x in aged if x is not h]
                out.append(h)
        return out

    # -- the window ---------------------------------------------------------------------------------------

    def _head_has_aged(self) -> bool:
        n = self._config.max_wait_steps
        if n is None or not len(self._waiting):
            return False
        h = self._waiting.peek()
        return h.wait_seq != 0 and self._next_step_id - h.wait_since >= n

    def _session_is_recent(self, session_id: str) -> bool:
        s = self._sessions.get(session_id)
        if s is None:
            return False
        num_running, active_until = s
        return num_running > 0 or (
            active_until is not None and self._next_step_id - active_until <= self._config.session_ttl_steps
        )

    def _begin_admission(self) -> list[_Request] | None:
        """Reorder the first ``window`` requests of the first tier for this step. Returns the original front, or
        None when nothing moved."""
        c = self._config
        if not c.cache_aware_admission_window:
            return None
        usage = 1.0 - len(self._free) / c.num_usable_blocks
        reorder = usage >= c.cache_aware_admission_threshold
        promote = bool(self._sessions) and not self._head_has_aged()
        if not (reorder or promote):
            return None
        q = self._waiting
        assert isinstance(q, _FcfsQueue)  # the config allows a window with fcfs only
        if not len(q):
            return None
        tier = q.first_tier()
        original = list(tier)[: c.cache_aware_admission_window]
        order = list(original)
        if reorder:
            peers = [k for k, r in enumerate(original) if r.status == RequestStatus.WAITING]
            warm = [k for k in peers if self._has_cached_prefix(original[k])]
            cold = [k for k in peers if k not in warm]
            for slot, k in zip(peers, warm + cold, strict=True):
                order[slot] = original[k]
        if promote:
            behind = 0
            for i, r in enumerate(order):
                if r.status == RequestStatus.PREEMPTED:
                    behind = i + 1
                elif (
                    r.status == RequestStatus.WAITING
                    and r.session_id is not None
                    and self._session_is_recent(r.session_id)
                    and self._has_cached_prefix(r)
                ):
                    order[behind : i + 1] = [r, *order[behind:i]]
                    break
        if all(a is b for a, b in zip(order, original, strict=True)):
            return None
        for k, r in enumerate(order):
            tier[k] = r
        return original

    def _has_cached_prefix(self, r: _Request) -> bool:
        """The admission probe: would at least one block hit? Reads the cache map only."""
        return not r.skip_reading_prefix_cache and bool(self._lookup(r.block_hashes, r.num_tokens)[:1])

    def _end_admission(self, original: list[_Request] | None) -> None:
        """Put the window's requests that are still in the waiting queue back in their original relative order,
        in the places they hold. Those it admitted left the queue, and so did those it admitted with an
        asynchronous KV load (to the KV-waiting queue, under ``park_kv_loads=False``)."""
        if original is None:
            return
        q = self._waiting
        assert isinstance(q, _FcfsQueue)
        tiers = q._tiers
        tier_key = original[0].order_key
        if tier_key not in tiers:
            return
        tier = tiers[tier_key]
        window = {id(r) for r in original}
        places = [k for k, r in enumerate(tier) if id(r) in window]
        here = {id(tier[k]) for k in places}
        left = [r for r in original if id(r) in here]
        if len(left) != len(places):
            raise InternalError("the admission window's requests are in the queue twice")
        for k, r in zip(places, left, strict=True):
            tier[k] = r
