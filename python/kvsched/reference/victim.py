"""Victim selection: which running request phase A preempts when a request's KV slots cannot be allocated
(``preemption_victim``). Mirrors ``rust/kvsched-core/src/victim.rs``.

The policy narrows the candidates to its lowest level (every running request under fcfs; the largest effective
priority under priority; the tenants with the largest counter under fair), then the rule chooses inside it:
``default`` is vLLM's choice; ``lcf`` the fewest computed tokens before this step; ``cost`` the largest
``R / max(1, num_tokens) * (1 - min(O, M) / M)`` (``R``: blocks with ref count 1, ``O``: output tokens,
``M = max(1, max_tokens)``), compared exactly as fractions. ``lcf`` and ``cost`` break ties by taking the later
request in running order.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from .request import _Request
from .state import _SchedulerState


class _VictimMixin(_SchedulerState):
    """The preemption victim of phase A."""

    def _pick_victim(self, scheduled: list[list[Any]]) -> int:
        """Index in running of the request to preempt; ``scheduled`` holds the step's entries so far, each
        ``[request, num_new_tokens, computed_before, ...]``."""
        rule, policy, running = self._config.preemption_victim, self._config.policy, self._running
        if rule == "default":
            if policy == "priority":
                keys = [(r.effective_priority, r.arrival_time) for r in running]
                return keys.index(max(keys))  # first in running order on ties
            if policy == "fair":
                counters = [self._tenants[r.tenant].counter for r in running]
                top = max(counters)
                return max(j for j, x in enumerate(counters) if x == top)
            return len(running) - 1
        level: list[int] = list(range(len(running)))
        if policy == "priority":
            top_priority = max(r.effective_priority for r in running)
            level = [j for j in level if running[j].effective_priority == top_priority]
        elif policy == "fair":
            top_counter = max(self._tenants[r.tenant].counter for r in running)
            level = [j for j in level if self._tenants[running[j].tenant].counter == top_counter]
        if rule == "lcf":
            before = {id(e[0]): e[2] for e in scheduled}  # a request scheduled earlier counts its tokens before
            computed = [before.get(id(r), r.num_computed_tokens) for r in running]
            return max(level, key=lambda j: (-computed[j], j))
        scores = {j: self._cost_score(running[j]) for j in level}
        return max(level, key=lambda j: (scores[j], j))

    def _cost_score(self, r: _Request) -> Fraction:
        """Blocks only ``r`` holds per token, times the share of its output budget left."""
        own = sum(1 for b in r.block_ids if self._ref_cnt[b] == 1)
        m = max(1, r.max_tokens)
        return Fraction(own, max(1, r.num_tokens)) * (1 - Fraction(min(r.num_output_tokens, m), m))
