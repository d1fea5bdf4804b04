"""A vLLM 0.33 KV connector (scheduler role) behind kvsched's core connector hooks.

The core calls its hooks with request ids and block id lists (``kvsched.kv_connector.KVConnector``); vLLM's
``KVConnectorBase_V1`` wants vLLM ``Request`` objects and ``KVCacheBlocks``. :class:`ConnectorBridge` translates
one into the other and keeps the bookkeeping vLLM's scheduler does around those calls (prefill, prefix-cache and
connector stats, the KV-fetch stages, the status of a request whose load runs asynchronously).

``request_finished`` is the one hook vLLM calls with the request already in its finished state (status set,
last tokens appended), which the core cannot provide from inside its own call. So the bridge answers the core
"hold the blocks" for every finished request and remembers its blocks; once the core call has returned and the
adapter has mirrored the finish onto the request, :meth:`ConnectorBridge.finish` asks vLLM's connector, and the
adapter releases the blocks at once (``update_kv_transfers(finished_sending=...)``) unless the connector keeps
them for a send. The blocks of several requests are released in the order they finished, so the free order (and
with it every later block id) is the one vLLM's scheduler produces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.metrics.stats import (
    KV_FETCH_COMPLETED_WAITING,
    KV_FETCH_IN_PROGRESS,
    KV_FETCH_WAITING_TO_START,
    PrefixCacheStats,
)
from vllm.v1.request import Request, RequestStatus

__all__ = ["ConnectorBridge"]


class ConnectorBridge:
    """Core-side KV connector hooks (keyed by request id) calling a vLLM scheduler-role connector."""

    def __init__(
        self,
        connector: Any,
        *,
        get_request: Callable[[str], Request],
        record_prefix_lookup: Callable[[Request, int], None],
        connector_prefix_cache_stats: Callable[[], PrefixCacheStats | None],
        mark_slow: Callable[[str], None],
        log_stats: bool,
        windows: tuple[Any, ...] = (None,),
        looking_up: Callable[[Request, int], AbstractContextManager[None]] | None = None,
        replay_groups: tuple[int, ...] = (),
        replay_window: int = 0,
        block_size: int = 1,
        hash_block_size: int = 1,
        drop_trailing_hit_block: bool = False,
    ) -> None:
        """``connector``: vLLM's scheduler-role connector. What the bridge needs of the adapter, all reading its
        state when called: ``get_request``, the vLLM request of a live id; ``record_prefix_lookup(request,
        num_local_hit_tokens)``, the adapter's prefix-cache stats of an admission's lookup;
        ``connector_prefix_cache_stats()``, the connector's prefix-cache stats being collected (None without
        stats; the adapter starts new ones each time it reports them); ``mark_slow(req_id)``, the request's state
        is no longer a plain decode's (the adapter's update takes its general path for it); ``log_stats``,
        whether stats are collected; ``windows``, each KV cache group's window (None: full attention);
        ``looking_up(request, num_local_hit_tokens)``, a context the connector's lookup runs in (the block pins'
        answers to lookups of the request's local hit while the core is inside its call); ``replay_groups`` and
        ``replay_window``, the groups bounded prefix replay rebuilds and their window (the core's
        ``prefix_replay_groups``), with ``block_size`` the scheduler block a load that does not restore them is cut
        to; ``hash_block_size``, the tokens of one of the requests' block hashes; ``drop_trailing_hit_block``, the
        core's (a window of one token then caches its blocks)."""
        self.connector = connector
        self._looking_up = looking_up or (lambda request, num_local: contextlib.nullcontext())
        self._get_request = get_request
        self._record_prefix_lookup = record_prefix_lookup
        self._connector_prefix_cache_stats = connector_prefix_cache_stats
        self._mark_slow = mark_slow
        self._hma = isinstance(connector, SupportsHMA)
        # Groups whose blocks never enter the prefix cache (a window of one token, but under the trailing-block drop).
        self._drop = drop_trailing_hit_block
        self._uncached_groups = {g for g, w in enumerate(windows) if w == 1 and not self._drop} | set(replay_groups)
        self._replay_groups = set(replay_groups)
        self._replay_window = replay_window
        self._block_size = block_size
        self._hash_block_size = hash_block_size
        # A lookup's local hit when bounded prefix replay dropped it (the connector's stats count its queries
        # from it): req_id -> local hit tokens.
        self._query_local: dict[str, int] = {}
        # Lookups of this step that may end in an admission: req_id -> (local hit tokens, external tokens, async).
        self._asked: dict[str, tuple[int, int, bool]] = {}
        # The KV-fetch stage each request of this step's lookups had before it (ec_deferred puts it back).
        self._stage_before: dict[str, str | None] = {}
        # Requests admitted by the step being scheduled whose prefill/prefix stats the bridge already recorded.
        self.recorded: set[str] = set()
        # A request of this step loads its external tokens synchronously (SchedulerOutput.has_sync_kv_loads).
        self.has_sync_kv_loads = False
        # Requests the core finished inside its last call: req_id -> the blocks of their computed tokens (one
        # table per KV cache group with the core's kv_connector_groups).
        self.finished: dict[str, list[Any]] = {}
        # Asynchronous loads: not reported over yet / reported over, not admitted yet.
        self.loading: set[str] = set()
        # Asynchronous loads admitted by the step being scheduled, in admission order.
        self.started_loading: list[str] = []
        self.loaded: set[str] = set()
        # Those requests in the order their loads began (a dict kept for its insertion order): vLLM keeps them in
        # its kv_holding_waiting queue, whose FCFS order is that one (each admission pass visits the whole queue
        # and puts back the requests it skips in order, new loads after them).
        self.load_order: dict[str, None] = {}
        # Asynchronous loads admitted but not yet registered with the connector (the core's deferred loads):
        # req_id -> their lookup (local hit tokens, external tokens, async).
        self.deferred: dict[str, tuple[int, int, bool] | None] = {}
        # KV-fetch stage of each request that has one (vLLM's num_kv_fetch_reqs_by_stage), when stats are on.
        self.stages: dict[str, str] | None = {} if log_stats else None

    # ---- hooks the core calls -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        request = self._get_request(req_id)
        with self._looking_up(request, num_computed_tokens):
            ext, load_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if request.skip_reading_prefix_cache:
            ext, load_async = 0, False
        if ext is None:
            return None, False
        # The core's cap (docs/semantics.md, KV connector): never more than the request has, and a synchronous
        # load leaves one token to compute.
        room = request.num_tokens - num_computed_tokens
        n = min(int(ext), room)
        is_async = bool(load_async) and n > 0
        if not is_async and n == room:
            n = room - 1
        local = num_computed_tokens
        if self._replay_window and not (n > 0 and self.restores_window(request)):
            # Bounded prefix replay (the core's rules): a load that does not restore the replayed windows is taken
            # in whole blocks, and a hit no longer than the window is dropped.
            n -= n % self._block_size
            is_async = is_async and n > 0
            if 0 < local + n <= self._replay_window:
                self._query_local[req_id] = local
                local, n, is_async = 0, 0, False
        self._asked[req_id] = (local, n, is_async)
        if self.stages is not None:
            self._stage_before[req_id] = self.stages.get(req_id)
        self._record_lookup(req_id, request, local, n, is_async)
        return int(ext), bool(load_async)

    def restores_window(self, request: Request) -> bool:
        """Whether the connector's load restores every window bounded prefix replay rebuilds (vLLM's
        ``_load_restores_replay_window``: a transfer of the request's own blocks does, a prefix store does not)."""
        return self._replay_groups.issubset(self.connector.get_loaded_kv_cache_group_ids(request))

    def cap_external(self, req_id: str, num_external: int) -> None:
        """The cache-hit cap (vLLM's auxiliary output connector) cut the lookup's external tokens to
        ``num_external`` right after the connector's answer: the prefill stats and KV-fetch stage vLLM sets after
        the cap, set again with it."""
        asked = self._asked.get(req_id)
        if asked is None or asked[1] == num_external:
            return
        local, _, is_async = asked
        is_async = is_async and num_external > 0
        self._asked[req_id] = (local, num_external, is_async)
        self._record_lookup(req_id, self._get_request(req_id), local, num_external, is_async)

    def local_hit_replaced(self, req_id: str, num_local_tokens: int) -> None:
        """A diverged local hit the connector added no tokens to gave way to the hit every group agrees on (vLLM's
        fallback to ``get_computed_blocks``): the prefill stats and the lookup's counts take that hit."""
        if req_id not in self._asked:
            return
        request = self._get_request(req_id)
        self._asked[req_id] = (num_local_tokens, 0, False)
        self._record_lookup(req_id, request, num_local_tokens, 0, False)

    def _record_lookup(self, req_id: str, request: Any, num_local: int, num_external: int, is_async: bool) -> None:
        """What vLLM sets at a lookup: the first admission's prefill stats (a failed allocation redoes them
        later) and the request's KV-fetch stage."""
        if request.prefill_stats is not None and request.num_preemptions <= 0:
            request.prefill_stats.set(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=num_local,
                num_external_cached_tokens=num_external,
            )
        self._set_stage(req_id, KV_FETCH_WAITING_TO_START if is_async else None)

    # The core passes update_state_after_alloc the number of leading blocks in the prefix cache.
    wants_num_cached_blocks = True

    def update_state_after_alloc(
        self, req_id: str, block_ids: list[Any], num_external_tokens: int, num_cached_blocks: Any = 0
    ) -> None:
        request = self._get_request(req_id)
        deferred = req_id in self.deferred
        asked = self.deferred.pop(req_id) if deferred else self._asked.pop(req_id, None)
        # vLLM hands the connector its block objects: those in the prefix cache carry their hash.
        blocks = self._blocks(request, block_ids, num_cached_blocks)
        self.connector.update_state_after_alloc(request, blocks, num_external_tokens)
        if asked is None:
            return  # a loaded request admitted for the rest of its prompt: no lookup, no stats
        # The connector attributes cache-hit tiers once the load is registered: a deferred load records now.
        self._record_connector_lookup(request, self._query_local.pop(req_id, asked[0]), num_external_tokens)
        if not deferred:
            self._admitted(req_id, request, asked, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, req_id: str) -> tuple[int, ...]:
        # Asked at an asynchronous load's allocation with Mamba groups (vLLM then zeroes new attention blocks): the
        # groups the load writes keep its tokens' blocks out of new_block_ids_to_zero.
        return tuple(self.connector.get_loaded_kv_cache_group_ids(self._get_request(req_id)))

    def load_deferred(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        # An asynchronous load admitted while a step is in flight (vLLM's deferred_loads): admitted now, registered
        # with the connector (update_state_after_alloc) once the steps in flight are applied.
        request = self._get_request(req_id)
        asked = self._asked.pop(req_id, None)
        self.deferred[req_id] = asked
        if asked is not None:
            self._admitted(req_id, request, asked, num_external_tokens)

    def _record_connector_lookup(self, request: Request, local: int, num_external_tokens: int) -> None:
        preempted = request.num_preemptions > 0
        queries = request.num_tokens - local
        stats = self._connector_prefix_cache_stats()
        if stats is not None and queries != 0:
            stats.record(
                num_tokens=queries,
                num_hits=num_external_tokens,
                preempted=preempted,
                hits_by_source=(
                    self.connector.get_external_cache_hit_sources(request, num_external_tokens)
                    if num_external_tokens and not preempted
                    else None
                ),
            )

    def _admitted(self, req_id: str, request: Request, asked: tuple[int, int, bool], num_external_tokens: int) -> None:
        local, n, is_async = asked
        self._record_prefix_lookup(request, local)
        self.recorded.add(req_id)
        if is_async:
            # vLLM's WAITING_FOR_REMOTE_KVS: blocks allocated, computed count set, nothing scheduled.
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = local + n
            self.loading.add(req_id)
            self.load_order.setdefault(req_id)
            self.started_loading.append(req_id)
            self.loaded.discard(req_id)
            self._mark_slow(req_id)
            self._set_stage(req_id, KV_FETCH_IN_PROGRESS)
        elif num_external_tokens > 0:
            self.has_sync_kv_loads = True

    def request_finished(self, req_id: str, block_ids: list[Any]) -> bool:
        # Hold the blocks; finish() asks vLLM's connector once the request is in its finished state.
        self.finished[req_id] = block_ids
        return True

    def has_pending_block_frees(self) -> bool:
        # Asked before a preemption: transfers that will free blocks make vLLM give up the allocation instead.
        return bool(self.connector.has_pending_block_frees())

    # ---- the adapter's side ---------------------------------------------------------------------------

    def _blocks(self, request: Request, block_ids: list[Any], num_hashed: Any) -> KVCacheBlocks:
        """vLLM's ``KVCacheBlocks`` of a request: ``block_ids`` is one table, or (the core's
        ``kv_connector_groups``) one table per KV cache group; ``num_hashed`` the number of leading blocks in the
        prefix cache, or with tables one list per group of the tokens of each block's cache key (0: not cached;
        sparse retention and windows among groups of different block sizes leave blocks out of the cache anywhere,
        and a block's key can be a hash below its own end: a larger block keyed by the prompt's tail inside it, a
        Mamba checkpoint keyed one block below its entry). A block in the cache carries its group's hash (the
        request's hash block its key ends at), block 0 is vLLM's null block."""
        hashes = request.block_hashes
        hbs = self._hash_block_size
        if block_ids and isinstance(block_ids[0], list):
            tables, keys = block_ids, num_hashed
        else:
            tables = [block_ids]
            keys = [[(i + 1) * hbs if i < num_hashed else 0 for i in range(len(block_ids))]]
        groups = []
        for g, table in enumerate(tables):
            blocks = [KVCacheBlock(b) for b in table]
            if g not in self._uncached_groups:
                for block, key_tokens in zip(blocks, keys[g], strict=True):
                    if block.block_id == 0:
                        block.is_null = True
                    elif 0 < key_tokens <= len(hashes) * hbs:
                        block._block_hash = make_block_hash_with_group_id(hashes[key_tokens // hbs - 1], g)
            else:
                for block in blocks:
                    block.is_null = block.block_id == 0
            groups.append(blocks)
        return KVCacheBlocks(tuple(groups))

    def _set_stage(self, req_id: str, stage: str | None) -> None:
        stages = self.stages
        if stages is None:
            return
        if stage is None:
            stages.pop(req_id, None)
        else:
            stages[req_id] = stage

    def stage_counts(self) -> dict[str, int]:
        counts = dict.fromkeys((KV_FETCH_WAITING_TO_START, KV_FETCH_IN_PROGRESS, KV_FETCH_COMPLETED_WAITING), 0)
        for stage in (self.stages or {}).values():
            counts[stage] += 1
        return counts

    def ec_deferred(self, req_id: str) -> None:
        """The encoder-cache connector deferred a request right after its lookup: vLLM sets the KV-fetch stage
        only past that gate, so the stage the lookup set is put back."""
        if req_id in self._stage_before:
            self._set_stage(req_id, self._stage_before.pop(req_id))

    def begin_step(self) -> None:
        self._asked.clear()
        self._query_local.clear()
        self._stage_before.clear()
        self.recorded.clear()
        self.has_sync_kv_loads = False
        self.started_loading.clear()

    def load_reported(self, req_id: str) -> None:
        self.loading.discard(req_id)
        self.loaded.add(req_id)
        self._set_stage(req_id, KV_FETCH_COMPLETED_WAITING)

    def loads_in_queue_order(self, requests: dict[str, Any], priority: bool) -> list[str]:
        """The known requests loading or loaded and not admitted yet, in vLLM's kv_holding_waiting order: the
        order their loads began, or under the priority policy the queue's heap order (priority, arrival time,
        request id)."""
        ids = [r for r in self.load_order if r in requests and (r in self.loading or r in self.loaded)]
        if priority:
            ids.sort(key=lambda r: (requests[r].priority, requests[r].arrival_time, r))
        return ids

    def finish(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``_connector_finished`` for a request the core finished (its status already set): whether the
        connector keeps its blocks for a send, and the transfer parameters for its output."""
        req_id = request.request_id
        block_ids = self.finished.pop(req_id)
        self.deferred.pop(req_id, None)
        self.loading.discard(req_id)
        self.loaded.discard(req_id)
        self.load_order.pop(req_id, None)
        self._set_stage(req_id, None)
        # One table, or (the core's kv_connector_groups) one per KV cache group.
        tables = block_ids if block_ids and isinstance(block_ids[0], list) else [block_ids]
        if self._hma:
            delay, params = self.connector.request_finished_all_groups(request, tuple(tables))
        else:
            delay, params = self.connector.request_finished(request, tables[0])
        return bool(delay), params
