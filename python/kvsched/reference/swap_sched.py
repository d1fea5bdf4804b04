"""Preemption that keeps work: a victim's KV is copied to the CPU block pool and back on resume, instead of being
dropped and recomputed (``preemption_mode``: ``recompute``, ``swap``, or ``auto``, which chooses per victim by
cost). Mirrors ``rust/kvsched-core/src/swap_sched.rs`` (the CPU pool's type lives in ``swap.rs`` there, its
state in ``state.py`` here).

The CPU pool is ``_cpu_free`` (a deque: allocate from the left, release to the right). Every CPU block is free
once or held by exactly one PREEMPTED waiting request, which holds no GPU blocks.
"""

from __future__ import annotations

import numpy as np

from .._errors import InvalidRequestError, SchedulerTypeError
from ..config import check_preemption_costs
from .request import _Request
from .state import _SchedulerState


class _SwapMixin(_SchedulerState):
    """Swapping victims out, resuming them, and the auto mode's costs."""

    def _preempt_victim(self, r: _Request, computed_before: int | None, swap_out: list[int]) -> None:
        """Phase A's preemption: swap ``r``'s KV out (pairs appended to ``swap_out``) when the mode says so and
        the CPU pool can hold it, else recompute. ``computed_before``: its computed tokens before this step when
        it had been scheduled earlier in the step."""
        c, bs = self._config, self._bs
        computed = r.num_computed_tokens if computed_before is None else computed_before
        saved = min(computed, r.num_tokens - 1)  # never the last known token: it is computed next
        k = -(-saved // bs)
        wants = saved > 0 and r.num_in_flight_tokens == 0 and c.preemption_mode != "recompute"
        if wants and c.preemption_mode == "auto":
            # swap when copying out and back costs strictly less than recomputing the uncached context
            shared = sum(1 for b in r.block_ids[:k] if self._ref_cnt[b] > 1)  # stay resident: come back as hits
            uncached = max(0, saved - shared * bs)
            wants = self._swap_cost_per_block * (2 * k) < self._recompute_cost_per_token * uncached
        cpu: list[int] | None = None
        if wants:
            if k <= len(self._cpu_free):
                cpu = [self._cpu_free.popleft() for _ in range(k)]
                for g, cb in zip(r.block_ids[:k], cpu, strict=True):
                    swap_out += [g, cb]
            else:
                self._stats["swap_fallbacks"] += 1
        self._preempt(r)
        r.num_lost_tokens = computed
        if cpu is not None:
            r.cpu_blocks, r.num_swapped_tokens = cpu, saved
            self._stats["swapped_out_reqs"] += 1
            self._stats["swapped_out_blocks"] += k

    def _complete_resume(self, r: _Request, num_hits: int, restored: int, swap_in: list[int]) -> None:
        """After ``r``'s admission: swap-in pairs for its swapped blocks past the prefix hits (when the swapped
        tokens reach further), CPU blocks released, lost tokens not recovered counted as recomputed."""
        self._stats["recomputed_tokens"] += max(0, r.num_lost_tokens - restored)
        r.num_lost_tokens = 0
        if not r.cpu_blocks:
            return
        if r.num_swapped_tokens == restored:
            for i in range(num_hits, len(r.cpu_blocks)):
                swap_in += [r.cpu_blocks[i], r.block_ids[i]]
                self._stats["swapped_in_blocks"] += 1
        self._stats["swapped_in_reqs"] += 1
        self._cpu_free.extend(r.cpu_blocks)
        r.cpu_blocks, r.num_swapped_tokens = [], 0

    def set_preemption_costs(self, recompute_cost_per_token: float, swap_cost_per_block: float) -> None:
        """The auto mode's cost constants from now on (finite, >= 0). On error nothing changes."""
        costs = check_preemption_costs(
            recompute_cost_per_token, swap_cost_per_block, InvalidRequestError, SchedulerTypeError
        )
        self._recompute_cost_per_token, self._swap_cost_per_block = costs

    @property
    def preemption_costs(self) -> tuple[float, float]:
        return (self._recompute_cost_per_token, self._swap_cost_per_block)

    def get_cpu_block_ids(self, req_id: str) -> np.ndarray:
        return np.array(self._get(req_id).cpu_blocks, dtype=np.int32)
