"""The KV connector, scheduler side (vLLM's ``KVConnectorBase_V1`` scheduler-role hooks), and the bookkeeping of
KV transfers: asynchronous loads (requests parked in WAITING_FOR_REMOTE_KVS while their blocks fill) and delayed
frees (blocks of a finished request kept while the engine still receives into them or sends them). Mirrors
``rust/kvsched-core/src/connector_sched.rs`` (the held-block types live in ``connector.rs`` there, in ``state.py``
here).

An exception raised by a hook is kept and raised once the call is over; the hook then answers "nothing external,
no delayed free", as the Rust binding does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import InvalidRequestError, KVConnectorError, SchedulerTypeError, UnknownRequestError
from .._types import RequestStatus
from ..kv_connector import claim_invalid_blocks
from .block_pool import _BlockPoolMixin
from .convert import _as_sequence, _is_int
from .request import _Request


class _ConnectorMixin(_BlockPoolMixin):
    """The connector's hooks, the engine's transfer reports, and the blocks held for transfers."""

    @property
    def kv_connector(self) -> Any:
        return self._connector

    def _keep(self, e: BaseException) -> None:
        if self._hook_error is None:
            self._hook_error = e

    def _after_hooks(self) -> None:
        e, self._hook_error = self._hook_error, None
        if e is not None:
            raise e

    @property
    def cache_hit_cap(self) -> Any:
        """The cache-hit cap set with :meth:`set_cache_hit_cap`, or None."""
        return self._hit_cap

    def set_cache_hit_cap(self, cap: Any) -> None:
        """Sets (None: removes) the cache-hit cap (``max_cache_hit(req_id, cached)`` and
        ``cap_external_hit(req_id, cached, num_local, num_external)``); it applies from the next admission."""
        if cap is not None:
            for hook in ("max_cache_hit", "cap_external_hit"):
                if not hasattr(cap, hook):
                    raise SchedulerTypeError(f"cache_hit_cap must have a {hook}() method, got {type(cap).__name__}")
        self._hit_cap = cap
        self._last_out_fresh = False

    def _cap_ask(self, hook: str, *args: Any) -> int:
        """A cache-hit cap hook's answer; an exception or an answer that is not an int >= 0 is kept (raised after
        the call) and the conservative answer 0 (no hit) stands."""
        try:
            res = getattr(self._hit_cap, hook)(*args)
            if not _is_int(res) or res < 0:
                shown = res if _is_int(res) else type(res).__name__
                raise SchedulerTypeError(f"cache_hit_cap.{hook} must return an int >= 0, got {shown}")
            return int(res)
        except Exception as e:  # kept and raised once the scheduler is consistent
            if self._hit_cap_error is None:
                self._hit_cap_error = e
            return 0

    def _cap_after_hooks(self) -> None:
        e, self._hit_cap_error = self._hit_cap_error, None
        if e is not None:
            raise e

    def _hook_matched(self, r: _Request, num_computed: int) -> tuple[int, bool] | None:
        try:
            res = self._connector.get_num_new_matched_tokens(r.req_id, num_computed)
            what = "kv_connector.get_num_new_matched_tokens"
            if not isinstance(res, tuple) or len(res) != 2:
                raise KVConnectorError(f"{what}: must return a pair (int | None, bool), got {res!r}")
            n, load_async = res
            if not isinstance(load_async, bool):
                raise KVConnectorError(f"{what}: async flag must be a bool, got {type(load_async).__name__}")
            if n is None:
                return None
            if not _is_int(n):
                raise KVConnectorError(f"{what}: token count must be an int or None, got {type(n).__name__}")
            if not 0 <= n < 2**32:
                raise KVConnectorError(f"{what}: token count must be >= 0, got {n}")
            return int(n), load_async
        except Exception as e:
            self._keep(e)
            return None

    def _all_tables(self, r: _Request) -> list[list[int]]:
        """Every group's table in group order (one table without groups): ``block_ids`` is the primary group's,
        the others' are ``group_block_ids`` in order."""
        p = self._config.primary_group
        return [*r.group_block_ids[:p], r.block_ids, *r.group_block_ids[p:]]

    def _take_tables(self, r: _Request) -> list[list[int]]:
        """Takes every group's table out of ``r`` in group order (one without groups), leaving them empty."""
        tables = [list(t) for t in self._all_tables(r)]
        r.group_block_ids = [[] for _ in r.group_block_ids]
        r.group_num_cached = [0] * len(r.group_num_cached)
        r.mamba_allocated.clear()
        r.mamba_appended.clear()
        r.mamba_checkpoint.clear()
        r.partial_hits.clear()
        r.block_ids = []
        r.num_cached_blocks = 0
        return tables

    def _hook_blocks(self, r: _Request) -> list[Any]:
        """The blocks argument of the allocation hooks: the primary table, or (``kv_connector_groups``) one list
        per group in group order."""
        if self._config.kv_connector_groups:
            return [list(t) for t in self._all_tables(r)]
        return list(r.block_ids)

    def _hook_after_alloc(self, r: _Request, num_external: int) -> None:
        try:
            blocks = self._hook_blocks(r)
            if not self._pass_cached_blocks:
                self._connector.update_state_after_alloc(r.req_id, blocks, num_external)
                return
            # The fourth argument: the number of leading blocks in the prefix cache, or (kv_connector_groups) per
            # group the tokens of each block's cache key, 0 for a block not cached (sparse retention and windows
            # among groups of different block sizes leave blocks out anywhere in a table).
            cached: Any = r.num_cached_blocks
            if self._config.kv_connector_groups:
                cached = [self._key_tokens(r, g, t) for g, t in enumerate(blocks)]
            self._connector.update_state_after_alloc(r.req_id, blocks, num_external, cached)
        except Exception as e:
            self._keep(e)

    def _hook_loaded_groups(self, r: _Request) -> set[int] | None:
        """The optional ``get_loaded_kv_cache_group_ids(req_id)``: the KV cache groups an asynchronous load writes
        (their loaded tokens' blocks are not zeroed); None (no hook, or it failed): every group."""
        hook = getattr(self._connector, "get_loaded_kv_cache_group_ids", None)
        if hook is None:
            return None
        try:
            res = hook(r.req_id)
            groups = list(res)
            if any(isinstance(g, bool) or not _is_int(g) or g < 0 for g in groups):
                raise KVConnectorError(
                    f"kv_connector.get_loaded_kv_cache_group_ids: must return an iterable of int >= 0, got {res!r}"
                )
            return {int(g) for g in groups}
        except Exception as e:
            self._keep(e)
            return None

    def _load_restores_replay(self, r: _Request) -> bool:
        """Bounded replay: whether the connector's load for ``r`` restores every replay group (the groups
        ``get_loaded_kv_cache_group_ids`` names; every group without the hook), as a transfer of the request's own
        blocks does; a prefix-cache store holds no window."""
        loaded = self._hook_loaded_groups(r)
        return loaded is None or set(self._config.prefix_replay_groups) <= loaded

    def _hook_local_hit_replaced(self, r: _Request, num_local: int) -> None:
        """The optional ``local_hit_replaced(req_id, num_local_tokens)``: a diverged local hit the connector added no
        tokens to was replaced by the hit every group agrees on (``divergent_local_hits``)."""
        hook = getattr(self._connector, "local_hit_replaced", None)
        if hook is None:
            return
        try:
            hook(r.req_id, num_local)
        except Exception as e:
            self._keep(e)

    def _hook_load_deferred(self, r: _Request, num_external: int) -> None:
        hook = getattr(self._connector, "load_deferred", None)
        if hook is None:
            return
        try:
            hook(r.req_id, self._hook_blocks(r), num_external)
        except Exception as e:
            self._keep(e)

    def _count_connector_lookup(self, queries: tuple[int, int] | None) -> None:
        if queries is not None:
            self._stats["connector_queries"] += queries[0]
            self._stats["connector_hits"] += queries[1]

    def _hook_finished(self, r: _Request, block_ids: list[Any]) -> bool:
        try:
            res = self._connector.request_finished(r.req_id, list(block_ids))
            delay, params = res if isinstance(res, tuple) and len(res) == 2 else (res, None)
            if not isinstance(delay, bool):
                raise KVConnectorError(
                    f"kv_connector.request_finished: must return bool or (bool, params), got {res!r}"
                )
            if params is not None:
                self._transfer_params[r.req_id] = params
            return delay
        except Exception as e:
            self._keep(e)
            return False

    def _queue_newly_ready(self) -> None:
        """Queue the parked requests that became ready since the last step, in the order they were added:
        grammar-ready ones at the front of waiting, loaded ones into the loaded queue."""
        ready = sorted(self._newly_ready, key=lambda r: r.add_seq)
        self._newly_ready = []
        for r in reversed(ready):
            if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and r.parked:
                r.parked = False
                self._waiting.add_preempted(r)
                self._enter_waiting(r)
        for r in ready:
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.parked:
                r.parked = False
                self._kv_waiting.add(r)

    def update_kv_transfers(
        self,
        finished_recving: Iterable[str] | None = None,
        finished_sending: Iterable[str] | None = None,
        failed_recving: Iterable[str] | None = None,
        invalid_block_ids: Iterable[int] | None = None,
    ) -> list[str]:
        """Apply what the engine reports about KV transfers (vLLM's ``KVConnectorOutput``), in vLLM 0.33's
        order: failed loads, invalid blocks, then finished loads and sends. Validates everything first (nothing
        changes on error). Returns the requests finished because their load failed (policy ``fail``)."""
        recv = self._id_list(finished_recving, "finished_recving")
        send = self._id_list(finished_sending, "finished_sending")
        failed_ids = self._id_list(failed_recving, "failed_recving")
        invalid = [] if invalid_block_ids is None else self._block_id_list(invalid_block_ids, "invalid_block_ids")
        if invalid and self._config.kv_cache_groups is not None:
            # vLLM refuses them too: a block id names a block of one group, not a request's tokens.
            raise InvalidRequestError(
                "invalid_block_ids are not supported with kv_cache_groups (report the requests in failed_recving)"
            )

        def loading(req_id: str, what: str) -> None:
            r = self._requests.get(req_id)
            if r is not None:
                if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or (what == "finished_recving" and r.kv_load_done):
                    raise InvalidRequestError(f"{what}: request {req_id!r} has no KV load in progress")
                return
            h = self._held.get(req_id)
            if h is None:
                raise UnknownRequestError(f"{what}: unknown request id {req_id!r}")
            if not h[1]:
                raise InvalidRequestError(f"{what}: finished request {req_id!r} has no such transfer in progress")

        for i in recv:
            loading(i, "finished_recving")
        for i in failed_ids:
            loading(i, "failed_recving")
        for i in send:
            h = self._held.get(i)
            if h is None:
                if i in self._requests:
                    raise InvalidRequestError(f"finished_sending: request {i!r} has not finished")
                raise UnknownRequestError(f"finished_sending: unknown request id {i!r}")
            if not h[2]:
                raise InvalidRequestError(f"finished_sending: request {i!r} is not being sent")

        self._last_out_fresh = False
        fail = self._config.kv_load_failure_policy == "fail"
        failed: list[_Request] = []
        for i in failed_ids:
            r = self._requests.get(i)
            if r is None:
                continue
            if fail:
                if r not in failed:
                    failed.append(r)
            else:
                r.num_computed_tokens = 0
                r.kv_load_failed = True
        # Each request's tokens in the oldest step in flight (the step these blocks are reported with): vLLM scans
        # the blocks of the computed tokens less those, for loading and running requests alike.
        front = self._outs_in_flight[0] if self._outs_in_flight else None
        in_step: dict[int, int] = {}
        if invalid and front is not None:
            for (r, _, _), n in zip(front._entries, front.num_scheduled_tokens.tolist(), strict=True):
                in_step[id(r)] = n
        if invalid:
            bad = set(invalid)
            loading_reqs = [r for r in self._requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
            for r in loading_reqs:
                n = math.ceil(max(0, r.num_computed_tokens - in_step.get(id(r), 0)) / self._bs)
                idx = next((k for k, b in enumerate(r.block_ids[:n]) if b in bad), None)
                if idx is None:
                    continue
                if fail:
                    if r not in failed:
                        failed.append(r)
                else:
                    r.num_computed_tokens = idx * self._bs
                    r.kv_load_failed = True
        if invalid:
            self._roll_back_synchronous_loads(set(invalid), in_step, fail, failed)
        for r in failed:
            self._finish(r, RequestStatus.FINISHED_ERROR)
        for i in recv:
            r = self._requests.get(i)
            if r is not None:
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not r.kv_load_done:
                    r.kv_load_done = True
                    if r.parked:  # in kv_waiting already (park_kv_loads=False): it keeps its place
                        self._newly_ready.append(r)
            else:
                self._release_held(i, recv=True)
        for i in send:
            self._release_held(i, recv=False)
        self._transfer_params = {}
        self._after_hooks()
        return [r.req_id for r in failed]

    def _roll_back_synchronous_loads(
        self, bad: set[int], in_step: dict[int, int], fail: bool, failed: list[_Request]
    ) -> None:
        """Invalid blocks among the computed blocks of running requests (vLLM's synchronous loads): see
        ``Scheduler::roll_back_synchronous_loads`` in ``connector_sched.rs``."""
        front = self._outs_in_flight[0] if self._outs_in_flight else None
        done = {id(r): max(0, r.num_computed_tokens - in_step.get(id(r), 0)) for r in self._running}
        evict: list[int] = []
        for r, idx in claim_invalid_blocks(((r, r.block_ids, done[id(r)]) for r in self._running), bad, self._bs):
            r.num_computed_tokens = done[id(r)] if idx is None else idx * self._bs
            if fail and idx is not None:
                evict.extend(r.block_ids[idx:])
            if front is not None:
                r.kv_skip_step = front.step_id
            if fail and r not in failed:
                failed.append(r)
        for b in evict:
            h = self._block_hash[b]
            if h is not None:
                self._uncache(b, h)

    def evict_cached_blocks(self, block_ids: Iterable[int]) -> None:
        """Takes each listed block that carries a hash out of the prefix cache, in the order given (vLLM's
        ``KVCacheManager.evict_blocks``); the blocks stay with their holders. Nothing changes on error."""
        blocks = self._block_id_list(block_ids, "block_ids", "evict_cached_blocks")
        if blocks and self._config.kv_cache_groups is not None:
            raise InvalidRequestError(
                "evict_cached_blocks is not supported with kv_cache_groups (a block id names a block of one group)"
            )
        self._last_out_fresh = False
        for b in blocks:
            h = self._block_hash[b]
            if h is not None:
                self._uncache(b, h)

    def _block_id_list(self, ids: Iterable[int], what: str, where: str | None = None) -> list[int]:
        """``ids`` as a list of block ids in ``[1, num_blocks)`` (errors name ``where``, default ``what``)."""
        out: list[int] = []
        for b in _as_sequence(ids, what):
            if not _is_int(b):
                raise SchedulerTypeError(f"{what} must hold ints, got {type(b).__name__}")
            if not 1 <= b < self._config.num_blocks:
                raise InvalidRequestError(
                    f"{where or what}: block ids must be in [1, {self._config.num_blocks}), got {b}"
                )
            out.append(int(b))
        return out

    def _id_list(self, ids: Iterable[str] | None, what: str) -> list[str]:
        if ids is None:
            return []
        out = _as_sequence(ids, what)
        for i in out:
            if not isinstance(i, str):
                raise SchedulerTypeError(f"{what} must hold str ids, got {type(i).__name__}")
        return out

    def _release_held(self, req_id: str, recv: bool) -> None:
        h = self._held.get(req_id)
        if h is None:
            return
        h[1 if recv else 2] = False
        if not h[1] and not h[2]:
            del self._held[req_id]
            self._drop_boundary_offers(req_id)
            for w in h[4]:
                self._free_block_list(w)
            if self._config.defer_block_free and h[3] > self._processed_step_seq:
                self._defer_free([b for t in h[0] for b in t])
            else:
                for t in h[0]:
                    self._free_block_list(t)

    def free_held_window_blocks(self, req_id: str) -> None:
        """With ``kv_connector_groups``: frees now, group by group, the blocks that left a window at the finish of
        the held request ``req_id`` (they otherwise go back with its held blocks)."""
        if not isinstance(req_id, str):
            raise SchedulerTypeError(f"req_id must be a str, got {type(req_id).__name__}")
        h = self._held.get(req_id)
        if h is None:
            raise UnknownRequestError(f"unknown held request id {req_id!r}")
        window, h[4] = h[4], []
        for w in window:
            self._free_block_list(w)
        self._last_out_fresh = False

    # -- deferred block frees and loads (defer_block_free, defer_async_loads; vLLM 0.33's names) ----------------

    def _request_blocks_can_be_freed(self, r: _Request) -> bool:
        return not self._config.defer_block_free or r.last_sched_seq <= self._processed_step_seq

    def _free_request_blocks(self, r: _Request) -> None:
        """Free ``r``'s blocks now, or (``defer_block_free``, a step in flight scheduled it) once every step
        scheduled so far is applied."""
        self._drop_boundary_offers(r.req_id)
        if self._request_blocks_can_be_freed(r):
            # Several KV cache groups: table by table in group order; block_ids is the primary group's table, the
            # others' are group_block_ids in order.
            for table in self._all_tables(r):
                self._free_block_list(table)
            r.group_block_ids = [[] for _ in r.group_block_ids]
            r.group_num_cached = [0] * len(r.group_num_cached)
            r.mamba_allocated.clear()
            r.mamba_appended.clear()
            r.mamba_checkpoint.clear()
            r.partial_hits.clear()
        else:
            # Every group's table, in group order, as one list (vLLM's pop_blocks_for_free).
            self._defer_free([b for t in self._take_tables(r) for b in t])
        r.block_ids = []
        r.num_cached_blocks = 0

    def _defer_free(self, blocks: list[int]) -> None:
        if blocks:
            self._deferred_frees.append((self._sched_step_seq, blocks))

    def _step_applied(self) -> None:
        """A non-empty step was applied: deferred frees whose fence it reaches go back, in order."""
        self._processed_step_seq += 1
        while self._deferred_frees and self._deferred_frees[0][0] <= self._processed_step_seq:
            self._free_block_list(self._deferred_frees.popleft()[1])
        # Deferred loads whose fence it reaches are registered with the connector, in admission order.
        for req_id, (fence, ext, queries) in list(self._deferred_loads.items()):
            if fence > self._processed_step_seq:
                break
            del self._deferred_loads[req_id]
            self._hook_after_alloc(self._requests[req_id], ext)
            self._count_connector_lookup(queries)

    def _connector_has_pending_block_frees(self) -> bool:
        hook = getattr(self._connector, "has_pending_block_frees", None)
        if hook is None:
            return False
        try:
            res = hook()
            if not isinstance(res, bool):
                raise KVConnectorError(f"kv_connector.has_pending_block_frees: must return a bool, got {res!r}")
            return res
        except Exception as e:
            self._keep(e)
            return False

    def set_defer_block_free(self, on: bool) -> None:
        """Turn ``defer_block_free`` on or off from now on (frees already deferred keep their fence)."""
        if not isinstance(on, bool):
            raise SchedulerTypeError(f"defer_block_free must be a bool, got {type(on).__name__}")
        self._config = dataclasses.replace(self._config, defer_block_free=on)
        self._last_out_fresh = False

    def set_defer_async_loads(self, on: bool) -> None:
        """Turn ``defer_async_loads`` on or off from now on (loads already deferred keep their fence)."""
        if not isinstance(on, bool):
            raise SchedulerTypeError(f"defer_async_loads must be a bool, got {type(on).__name__}")
        self._config = dataclasses.replace(self._config, defer_async_loads=on)
        self._last_out_fresh = False

    def deferred_load_ids(self) -> list[str]:
        """Requests whose asynchronous load waits for the steps in flight before the connector is told of it,
        in the order they will be registered."""
        return list(self._deferred_loads)

    def deferred_frees(self) -> list[tuple[int, list[int]]]:
        """Each deferred free's fence with its blocks in the order they go back, oldest first."""
        return [(fence, list(reversed(blocks))) for fence, blocks in self._deferred_frees]

    @property
    def step_seqs(self) -> tuple[int, int]:
        """``(scheduled, applied)``: the non-empty steps scheduled and applied so far."""
        return self._sched_step_seq, self._processed_step_seq

    def deferred_free_block_ids(self) -> np.ndarray:
        """Blocks whose free waits for steps in flight, in the order they go back to the pool."""
        return np.array([b for _, blocks in self._deferred_frees for b in reversed(blocks)], dtype=np.int32)

    def get_held_block_ids(self, req_id: str, group: int = 0) -> np.ndarray:
        """The blocks the finished request ``req_id`` holds for a transfer in KV cache group ``group`` (blocks
        that left a window at the finish are null blocks)."""
        if not isinstance(req_id, str):
            raise SchedulerTypeError(f"req_id must be a str, got {type(req_id).__name__}")
        h = self._held.get(req_id)
        if h is None:
            raise UnknownRequestError(f"unknown held request id {req_id!r}")
        if not 0 <= group < len(h[0]):
            raise InvalidRequestError(f"group must be in [0, {len(h[0])}), got {group}")
        return np.array(h[0][group], dtype=np.int32)

    @property
    def num_held_kv_requests(self) -> int:
        """Finished requests whose blocks are still held for a KV transfer."""
        return len(self._held)
