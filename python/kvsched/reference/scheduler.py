"""The reference scheduler: request intake, aborts, failed steps, queries, stats and the invariant check, and
:class:`ReferenceScheduler`, which composes the parts. Mirrors ``rust/kvsched-core/src/scheduler.rs``.

The parts, each a mixin in the module named after its counterpart in ``rust/kvsched-core/src``:
``block_pool.py``, ``kv_cache_manager.py``, ``encoder_sched.py``, ``admission.py``, ``connector.py``,
``swap.py``, ``step.py`` (``schedule()``), ``update.py`` (``update_from_output()``), ``model_inputs.py`` and
``introspect.py``; the state they share is in ``state.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import (
    DuplicateRequestError,
    InternalError,
    InvalidOutputError,
    InvalidRequestError,
    QueueFullError,
    SchedulerTypeError,
)
from .._types import RequestStatus, SchedulerStats, TenantStats
from ..config import CROSS_ATTENTION, MAMBA, RING, SchedulerConfig, check_tenant_weight, tenant_cache_salt
from .convert import (
    _I64_MAX,
    _I64_MIN,
    _TOKEN_LIMIT,
    _as_sequence,
    _check_tokens,
    _encoder_inputs,
    _int_array,
    _is_int,
    _is_utf8,
    _opt_str,
    _to_float,
)
from .introspect import _IntrospectMixin
from .model_inputs import _ModelInputsMixin
from .output import SchedulerOutput
from .pins import _PinsMixin
from .request import _Request
from .step import _StepMixin
from .update import _UpdateMixin

__all__ = ["ReferenceScheduler"]


class ReferenceScheduler(_PinsMixin, _StepMixin, _UpdateMixin, _ModelInputsMixin, _IntrospectMixin):
    """Pure-Python twin of :class:`kvsched.Scheduler` (same constructor, methods, results and errors)."""

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Any,
        max_tokens: int | None = None,
        min_tokens: int | None = 0,
        eos_token_id: int | None = None,
        ignore_eos: bool | None = False,
        stop_token_ids: Iterable[int] | None = (),
        priority: int | None = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        tenant: str | None = None,
        ready: bool | None = True,
        skip_reading_prefix_cache: bool | None = False,
        encoder_inputs: Any = None,
        session_id: str | None = None,
        ttft_slo_s: float | None = None,
        order_key: int | None = None,
        resumable: bool | None = False,
        cross_attention_tokens: int | None = None,
    ) -> None:
        """Queue a new request (status WAITING, or WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR with ``ready=False``
        until :meth:`set_ready`). Validates every argument first; on error nothing changes."""
        c = self._config
        if not isinstance(req_id, str):
            raise SchedulerTypeError(f"req_id must be a str, got {type(req_id).__name__}")
        if not req_id or not _is_utf8(req_id):
            raise InvalidRequestError("req_id must be a non-empty, valid unicode str")
        if req_id in self._requests or req_id in self._held:
            raise DuplicateRequestError(f"request {req_id!r} already exists")
        prompt = _int_array(prompt_token_ids, "prompt_token_ids")
        if len(prompt) == 0:
            raise InvalidRequestError("prompt_token_ids must not be empty")
        _check_tokens(prompt, "prompt_token_ids", InvalidRequestError)
        if len(prompt) >= c.max_model_len:
            raise InvalidRequestError(f"prompt of {len(prompt)} tokens leaves no room in {c.max_model_len}")
        min_tokens = 0 if min_tokens is None else min_tokens
        for name, value, lo in (("max_tokens", max_tokens, 1), ("min_tokens", min_tokens, 0)):
            if value is not None and not _is_int(value):
                raise SchedulerTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value is not None and value < lo:
                raise InvalidRequestError(f"{name} must be >= {lo}, got {value}")
        room = c.max_model_len - len(prompt)
        effective_max = room if max_tokens is None else min(int(max_tokens), room)
        if int(min_tokens) > effective_max:
            raise InvalidRequestError(f"min_tokens ({min_tokens}) > effective max_tokens ({effective_max})")
        if eos_token_id is not None:
            if not _is_int(eos_token_id):
                raise SchedulerTypeError("eos_token_id must be None or an int")
            if not 0 <= eos_token_id < _TOKEN_LIMIT:
                raise InvalidRequestError(f"eos_token_id {eos_token_id} out of [0, 2**31)")
        ignore_eos = False if ignore_eos is None else ignore_eos  # None means the default, as in Scheduler
        priority = 0 if priority is None else priority
        if not isinstance(ignore_eos, bool):
            raise SchedulerTypeError("ignore_eos must be a bool")
        stops = _int_array([] if stop_token_ids is None else stop_token_ids, "stop_token_ids")
        _check_tokens(stops, "stop_token_ids", InvalidRequestError)
        if not _is_int(priority):
            raise SchedulerTypeError(f"priority must be an int, got {type(priority).__name__}")
        if not _I64_MIN <= priority <= _I64_MAX:
            raise InvalidRequestError(f"priority {priority} is outside the int64 range")
        if arrival_time is None:
            arrival_time = time.monotonic()
        elif not isinstance(arrival_time, (int, float, np.integer, np.floating)) or isinstance(
            arrival_time, (bool, np.bool_)
        ):
            raise SchedulerTypeError(f"arrival_time must be a float, got {type(arrival_time).__name__}")
        elif not math.isfinite(_to_float(arrival_time)):
            raise InvalidRequestError(f"arrival_time must be finite, got {arrival_time}")
        cache_salt = _opt_str(cache_salt, "cache_salt")
        lora_name = _opt_str(lora_name, "lora_name")
        tenant = "default" if tenant is None else tenant
        check_tenant_weight(tenant, 1.0, InvalidRequestError)
        ready = True if ready is None else ready
        if not isinstance(ready, bool):
            raise SchedulerTypeError(f"ready must be a bool, got {type(ready).__name__}")
        skip = False if skip_reading_prefix_cache is None else skip_reading_prefix_cache
        if not isinstance(skip, bool):
            raise SchedulerTypeError(f"skip_reading_prefix_cache must be a bool, got {type(skip).__name__}")
        session_id = _opt_str(session_id, "session_id")
        if session_id == "":
            raise InvalidRequestError("session_id must be a non-empty string")
        if ttft_slo_s is not None:
            if not isinstance(ttft_slo_s, (int, float, np.integer, np.floating)) or isinstance(
                ttft_slo_s, (bool, np.bool_)
            ):
                raise SchedulerTypeError(f"ttft_slo_s must be a float, got {type(ttft_slo_s).__name__}")
            ttft_slo_s = _to_float(ttft_slo_s)
            if not (math.isfinite(ttft_slo_s) and ttft_slo_s > 0):
                raise InvalidRequestError(f"ttft_slo_s must be finite and > 0, got {ttft_slo_s!r}")
        if order_key is not None:
            if not _is_int(order_key):
                raise SchedulerTypeError(f"order_key must be an int, got {type(order_key).__name__}")
            if not _I64_MIN <= order_key <= _I64_MAX:
                raise InvalidRequestError(f"order_key {order_key} is outside the int64 range")
        inputs = _encoder_inputs(encoder_inputs)
        self._check_encoder_inputs(req_id, len(prompt), inputs)
        resumable = False if resumable is None else resumable
        if not isinstance(resumable, bool):
            raise SchedulerTypeError(f"resumable must be a bool, got {type(resumable).__name__}")
        cross = self._check_cross_attention_tokens(req_id, cross_attention_tokens, resumable)
        self._check_encoder_decoder_request(req_id, inputs, cross)
        if resumable:
            self._check_resumable(req_id, inputs, ready)
        # The most KV slots it ever holds (all its tokens but the last sampled one) must fit the whole cache, and,
        # without chunked prefill, one step's budget (a preempted request recomputes them in one step).
        longest = len(prompt) + effective_max - 1
        if longest > c.kv_capacity_tokens:
            raise InvalidRequestError(
                f"prompt ({len(prompt)}) + max_tokens ({effective_max}) - 1 = {longest} tokens do not fit the KV "
                f"cache ({c.num_usable_blocks} usable blocks of {c.kv_block_size} tokens = {c.kv_capacity_tokens})"
            )
        if not c.enable_chunked_prefill and longest > c.max_chunk_tokens:
            raise InvalidRequestError(
                f"prompt ({len(prompt)}) + max_tokens ({effective_max}) - 1 = {longest} tokens exceed "
                f"{c.max_chunk_tokens} tokens, the most one step gives a request, without chunked prefill"
            )
        # Last of the checks: a valid request of a tenant at its waiting limit is refused, changing nothing.
        t = self._tenants.get(tenant)
        if t is not None and t.num_waiting >= t.max_waiting:
            raise QueueFullError(
                f"request {req_id!r}: the waiting queue of tenant {tenant!r} is full: {t.num_waiting} requests "
                "waiting, its limit (tenant_max_waiting, else max_waiting_per_tenant)"
            )
        if c.isolate_tenant_cache:
            cache_salt = tenant_cache_salt(tenant, cache_salt)

        r = _Request(
            req_id,
            prompt.tolist(),
            max_tokens=effective_max,
            requested_max_tokens=effective_max if max_tokens is None else int(max_tokens),
            min_tokens=int(min_tokens),
            eos_token_id=None if eos_token_id is None else int(eos_token_id),
            ignore_eos=bool(ignore_eos),
            stop_token_ids=frozenset(stops.tolist()),
            priority=int(priority),
            arrival_time=_to_float(arrival_time),
            cache_salt=cache_salt,
            lora_name=lora_name,
            tenant=tenant,
            skip_reading_prefix_cache=skip,
            arrival_step=self._next_step_id,
            encoder_inputs=inputs,
            session_id=session_id,
            ttft_slo_s=ttft_slo_s,
            order_key=0 if order_key is None else int(order_key),
            resumable=resumable,
            cross_attention_tokens=cross,
        )
        if c.kv_cache_groups is not None:
            r.group_block_ids = [[] for _ in c.kv_cache_groups[1:]]
            r.group_num_cached = [0] * (len(c.kv_cache_groups) - 1)
        slo = c.default_ttft_slo_s if ttft_slo_s is None else ttft_slo_s
        r.deadline = math.inf if slo is None else r.arrival_time + slo
        aging = c.priority_aging_steps
        r.effective_priority = r.priority * aging + r.arrival_step if aging else r.priority
        r.add_seq = self._next_add_seq
        self._next_add_seq += 1
        if not ready:  # vLLM enqueues a request in a blocked status straight into deferred_waiting
            r.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            r.deferred = True
            # In no queue until set_ready, or (vLLM 0.33) in `waiting`, skipped by admission passes that reach it.
            r.parked = c.park_grammar_waits
        self._update_block_hashes(r)
        if c.policy == "sjf":
            r.sjf_residual = self._sjf_residual(r)
        if session_id is not None:
            self._sessions.setdefault(session_id, [0, None])
        self._requests[req_id] = r
        if not r.parked:
            self._waiting.add(r)
            self._enter_waiting(r)
        self._tenants.on_arrival(self._tenants.intern(tenant))
        self._last_out_fresh = False

    def _finish(self, r: _Request, status: RequestStatus) -> None:
        """Free ``r`` (or keep its blocks for a KV transfer in progress), take it out of its queue, remember it
        for the next output, and forget it."""
        # A deferred load was never registered: no transfer will report it over.
        load_deferred = self._deferred_loads.pop(r.req_id, None) is not None
        was_loading = r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not r.kv_load_done and not load_deferred
        r.wait_seq = 0
        if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self._num_waiting_for_input -= 1
        if r.status == RequestStatus.RUNNING:
            self._running.remove(r)
            self._session_leaves_running(r)
            self._tenants[r.tenant].num_running -= 1
        else:
            if r.parked:
                if r in self._newly_ready:
                    self._newly_ready.remove(r)
            elif any(x is r for x in self._kv_waiting):
                self._kv_waiting.remove(r)
            else:
                self._waiting.remove(r)
            self._tenants[r.tenant].num_waiting -= 1
        r.parked = False
        r.status = status
        delay = False
        window: list[list[int]] = []
        if self._connector is not None and self._config.kv_connector_groups:
            # vLLM's _connector_finished: the blocks that left a window of the processed tokens leave the tables
            # first (freed below unless the request's blocks are held).
            window = self._take_all_skipped(r, max(0, r.num_computed_tokens - r.num_in_flight_tokens))
            delay = self._hook_finished(r, self._computed_tables(r, r.num_computed_tokens))
        elif self._connector is not None:
            # counted in the spec's block size, as vLLM clips them (a block id covers dcp_world_size times that)
            delay = self._hook_finished(r, r.block_ids[: math.ceil(r.num_computed_tokens / self._config.block_size)])
        if delay or was_loading:
            self._held[r.req_id] = [self._take_tables(r), was_loading, delay, r.last_sched_seq, window]
        else:
            for w in window:
                self._free_block_list(w)
            self._free_request_blocks(r)
        self._release_all_encoder(r)
        if self._config.encoder_decoder:  # vLLM's EncoderDecoderCacheManager frees a finished request's inputs
            self._enc_dec_free_slots += r.cross_attention_tokens
        self._cpu_free.extend(r.cpu_blocks)  # a swapped-out request aborted while waiting
        r.cpu_blocks, r.num_swapped_tokens = [], 0
        r.drafts = []
        r.deferred = False
        del self._requests[r.req_id]
        self._finished_since_schedule.append(r.req_id)
        self._stats["finished"] += 1

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort requests in any state, in the given order. Every id must be known; duplicates count once.

        A bare ``str`` is refused (it would otherwise be taken as an iterable of one-character ids)."""
        ids = _as_sequence(req_ids, "req_ids")
        reqs = {id(r): r for r in (self._get(i) for i in ids)}  # validates all before aborting any
        for r in reqs.values():
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        if reqs:
            self._last_out_fresh = False
        self._transfer_params = {}  # vLLM returns no transfer parameters for aborted requests either
        self._after_hooks()

    def fail_step(self, out: SchedulerOutput) -> list[str]:
        """The runner could not execute step ``out``, which must be the only step in flight. The blocks it entered
        into the prefix cache leave it (their KV was never computed), its live requests are aborted in step order,
        the victims it swapped out give their CPU blocks back (they recompute), and the step counts as applied.
        Returns the aborted ids."""
        out = self._check_output(out)
        if out.step_id < self._next_update_step:
            raise InvalidOutputError(f"step {out.step_id} was already applied")
        if out.step_id > self._next_update_step:
            raise InvalidOutputError(
                f"step {self._next_update_step} is in flight before step {out.step_id}: apply or fail it first"
            )
        if self._next_step_id != out.step_id + 1:
            raise InvalidOutputError(
                f"step {out.step_id} can only fail while it is the only step in flight "
                f"({self._next_step_id - out.step_id} are): the later steps were scheduled on its results"
            )
        # A live request outside the step holds blocks this step cached only when schedule() promoted its
        # finished KV load without scheduling it: their KV arrived from the connector, they stay cached.
        in_step = {id(r) for r, _, _ in out._entries}
        kept = {
            b
            for r in self._requests.values()
            if id(r) not in in_step
            for table in [r.block_ids, *r.group_block_ids]
            for b in table
        }
        for b, h in out._cached_blocks:
            if self._block_hash[b] == h and b not in kept:
                self._uncache(b, h)
        if out._entries:  # nothing runs any more: frees deferred behind the step go back
            self._step_applied()
        failed = [r for r, _, _ in out._entries if not r.status.is_finished]
        for r in failed:
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        for mm_hash in out._encoder_hashes:  # the encoder outputs it was to compute may not exist
            self._encoder.drop(mm_hash, True)
        for r in out._swapped_out:  # their swap_out copy may never have run: they recompute when resumed
            if not r.status.is_finished and r.cpu_blocks:
                self._cpu_free.extend(r.cpu_blocks)
                r.cpu_blocks, r.num_swapped_tokens = [], 0
        self._next_update_step += 1
        self._outs_in_flight.popleft()
        self._last_out_fresh = False
        self._transfer_params = {}  # aborted, as by abort_requests: no transfer parameters for them
        self._after_hooks()
        return [r.req_id for r in failed]

    # -- queries -----------------------------------------------------------------------------------------

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def num_unfinished_requests(self) -> int:
        """vLLM's get_num_unfinished_requests: 0 when paused for all, the running requests when paused for new."""
        if self._pause_state == "paused_all":
            return 0
        if self._pause_state == "paused_new":  # requests holding KV blocks (loading or loaded) still drain
            loading = sum(1 for r in self._requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
            loaded = sum(1 for r in self._kv_waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS)
            return max(0, len(self._running) + loading + loaded - self._num_waiting_for_input)
        return len(self._requests) - self._num_waiting_for_input  # sessions waiting for input do not count

    @property
    def pause_state(self) -> str:
        return self._pause_state

    def set_pause_state(self, state: str) -> None:
        """ "unpaused", "paused_new" (no admissions) or "paused_all" (nothing scheduled), from the next step."""
        if not isinstance(state, str):
            raise SchedulerTypeError(f"pause state must be a str, got {type(state).__name__}")
        if state not in ("unpaused", "paused_new", "paused_all"):
            raise InvalidRequestError(
                f"pause state must be one of ('unpaused', 'paused_new', 'paused_all'), got {state!r}"
            )
        if state != self._pause_state:
            self._pause_state = state
            self._last_out_fresh = False

    def set_ready(self, req_id: str) -> None:
        """The grammar of a request added with ``ready=False`` is ready; it stays WAITING_FOR_STRUCTURED_OUTPUT_
        GRAMMAR until an admission pass reaches it. No effect on a request that does not wait for a grammar."""
        r = self._get(req_id)
        if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and not r.grammar_ready:
            r.grammar_ready = True
            if r.parked:
                self._newly_ready.append(r)
            self._last_out_fresh = False

    def get_num_output_placeholders(self, req_id: str) -> int:
        return self._get(req_id).num_output_placeholders

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def get_block_ids(self, req_id: str, group: int = 0) -> np.ndarray:
        r = self._get(req_id)
        if not 0 <= group <= len(r.group_block_ids):
            raise InvalidRequestError(f"group must be in [0, {len(r.group_block_ids) + 1}), got {group}")
        return np.array(self._group_table(r, group), dtype=np.int32)

    def get_block_hashes(self, req_id: str) -> list[bytes]:
        return list(self._get(req_id).block_hashes)

    def get_block_hash_num_tokens(self, req_id: str, group: int = 0) -> np.ndarray:
        """For each block of KV cache group ``group``'s table, the tokens the hash it is cached under covers
        (vLLM's ``block_hash_num_tokens``; 0 for a null block or one not cached): the end of the request's block
        of that hash, one block below the entry for a Mamba prefill checkpoint keyed there by the trailing-block
        drop; with prefix hits inside a block, a partial entry's own tokens; in a group of larger blocks than
        ``block_size``, the prompt's tail entry's tokens when it is the block's key."""
        r = self._get(req_id)
        counts = self._key_tokens(r, group, self.get_block_ids(req_id, group).tolist())
        return np.array(counts, dtype=np.int64)

    def get_request_status(self, req_id: str) -> RequestStatus:
        return self._get(req_id).status

    def get_num_computed_tokens(self, req_id: str) -> int:
        return self._get(req_id).num_computed_tokens

    def get_replay_start(self, req_id: str) -> int:
        """Where the bounded replay of the request's last prefix hit starts (``prefix_replay_groups``; vLLM's
        ``replay_start``): the hit's tokens less its last window, 0 when its load carried the window; 0 until set."""
        return self._get(req_id).replay_start

    def get_output_token_ids(self, req_id: str) -> list[int]:
        r = self._get(req_id)
        return r.token_ids[r.num_prompt_tokens :]

    def get_num_cached_tokens(
        self,
        prompt_token_ids: Any,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        tenant: str | None = None,
    ) -> int:
        """Tokens a new request of ``tenant`` (None: ``"default"``) with this prompt would hit now; changes nothing
        (ref counts, LRU, stats). The tenant keys the lookup under ``isolate_tenant_cache`` only."""
        prompt = _int_array(prompt_token_ids, "prompt_token_ids")
        _check_tokens(prompt, "prompt_token_ids", InvalidRequestError)
        salt, lora = _opt_str(cache_salt, "cache_salt"), _opt_str(lora_name, "lora_name")
        tenant = _opt_str(tenant, "tenant")
        if tenant == "":
            raise InvalidRequestError("a tenant name must be a non-empty string")
        if not self._config.enable_prefix_caching:
            return 0
        if self._config.isolate_tenant_cache:
            salt = tenant_cache_salt("default" if tenant is None else tenant, salt)
        tokens = prompt.tolist()
        return len(self._lookup(self._hasher.block_hashes_of(tokens, salt, lora), len(tokens))) * self._bs

    def reset_prefix_cache(self, reset_running_requests: bool | None = False) -> bool:
        """Forget every cached block, but only when no usable block is in use. With ``reset_running_requests``
        every running request is first preempted from the tail (they resume in running order) and its in-flight
        output is dropped, so the reset succeeds."""
        reset_running_requests = (
            bool(reset_running_requests) if reset_running_requests is None else reset_running_requests
        )
        if not isinstance(reset_running_requests, bool):
            raise SchedulerTypeError("reset_running_requests must be a bool")
        if reset_running_requests and self._running:
            while self._running:
                r = self._running.pop()
                self._preempt(r, drop_stale_output=True)
                self._preempted_since_schedule.append(r.req_id)
            self._last_out_fresh = False
        if len(self._free) != self._config.num_usable_blocks:
            if reset_running_requests:
                if (
                    self._held
                    or self._deferred_frees
                    or self._pins
                    or any(r.block_ids for r in self._requests.values())
                ):
                    return False  # KV transfers hold blocks (vLLM raises: not supported yet), deferred frees, pins
                raise InternalError("the prefix cache is in use with no request running")
            return False
        self._cached.clear()
        self._second_keys.clear()
        self._extra_keys.clear()
        self._partial_tokens.clear()
        self._block_hash = [None] * self._config.num_blocks
        if self._events is not None:
            self._events.push_cleared()
        self._last_out_fresh = False
        return True

    def preempt_request(self, req_id: str, drop_stale_output: bool | None = None) -> None:
        """Preempt the running request ``req_id`` now, as a step preempts a victim in recompute mode (vLLM's
        ``_preempt_request`` called by hand): its blocks are freed (or wait for the steps in flight), its in-flight
        output becomes stale (dropped with ``drop_stale_output``), it goes back to the front of the waiting queue,
        and the next step lists it in ``preempted_req_ids``."""
        r = self._get(req_id)
        drop = False if drop_stale_output is None else drop_stale_output
        if not isinstance(drop, bool):
            raise SchedulerTypeError(f"drop_stale_output must be a bool, got {type(drop).__name__}")
        if r not in self._running:
            raise InvalidRequestError(f"request {req_id!r} is not running: only a running request can be preempted")
        self._running.remove(r)
        self._preempt(r, drop_stale_output=drop)
        self._preempted_since_schedule.append(r.req_id)
        self._last_out_fresh = False

    def stats(self) -> SchedulerStats:
        s, usable, c = self._stats, self._config.num_usable_blocks, self._config
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=sum(
                1 for r in self._requests.values() if r.status != RequestStatus.RUNNING and not r.deferred
            ),
            num_skipped_waiting_reqs=sum(1 for r in self._requests.values() if r.deferred),
            kv_cache_usage=1.0 - len(self._free) / usable,
            num_free_blocks=len(self._free),
            prefix_cache_queries=s["queries"],
            prefix_cache_hits=s["hits"],
            prefix_cache_preempted_queries=s["preempted_queries"],
            prefix_cache_preempted_hits=s["preempted_hits"],
            num_preemptions=s["preemptions"],
            num_finished_reqs=s["finished"],
            step_id=self._next_step_id,
            num_swapped_out_reqs=s["swapped_out_reqs"],
            num_swapped_out_blocks=s["swapped_out_blocks"],
            num_swapped_in_reqs=s["swapped_in_reqs"],
            num_swapped_in_blocks=s["swapped_in_blocks"],
            num_swap_fallbacks=s["swap_fallbacks"],
            num_recomputed_tokens=s["recomputed_tokens"],
            num_free_cpu_blocks=len(self._cpu_free),
            cpu_kv_cache_usage=1.0 - len(self._cpu_free) / c.num_cpu_blocks if c.num_cpu_blocks else 0.0,
            connector_prefix_cache_queries=s["connector_queries"],
            connector_prefix_cache_hits=s["connector_hits"],
            encoder_cache_usage=(
                (c.encoder_cache_size - self._encoder.num_free) / c.encoder_cache_size if c.encoder_cache_size else 0.0
            ),
            num_encoder_cache_entries=len(self._encoder.entries),
            num_encoder_inputs_computed=s["encoder_inputs"],
            num_encoder_tokens_computed=s["encoder_tokens"],
            encoder_cache_hits=s["encoder_hits"],
        )

    # -- tenants -----------------------------------------------------------------------------------------

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Change ``tenant``'s weight from now on (registering it if new); earlier charges stand."""
        check_tenant_weight(tenant, weight, InvalidRequestError)
        self._tenants.intern(tenant).set_weight(float(weight), self._config)

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Every tenant seen so far, in registration order: weight, virtual counter, service received."""
        return {
            t.name: TenantStats(
                t.weight, t.counter, t.num_prefill_tokens, t.num_decode_tokens, t.num_waiting, t.num_running
            )
            for t in self._tenants.values()
        }

    # -- invariants --------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise :class:`InternalError` if any internal invariant is broken. O(state); for tests."""

        def require(cond: bool, what: str) -> None:
            if not cond:
                raise InternalError(f"invariant broken: {what}")

        c, bs = self._config, self._bs
        free = list(self._free)
        require(len(free) == len(self._free) == len(set(free)), "free queue length / duplicates")
        require(all(1 <= b < c.num_blocks and b in self._free for b in free), "free queue ids")
        holders = [0] * c.num_blocks
        windows = c.kv_cache_groups or (c.sliding_window,)
        for r in self._requests.values():
            require(len(r.group_block_ids) + 1 == len(windows), f"{r.req_id}: one table per group")
            for g in range(len(windows)):
                table = self._group_table(r, g) if c.kv_cache_groups is not None else r.block_ids
                if windows[g] == MAMBA and c.mamba_align:  # the states' entries, null blocks between them
                    least = 0 if not r.block_ids else 1 + c.mamba_speculative_blocks
                    most_cached = len(table) if c.enable_prefix_caching else 0  # cached states with prefix caching
                    num_cached = self._group_cached(r, g)
                    require(
                        len(table) >= least and bool(table) == bool(r.block_ids) and num_cached <= most_cached,
                        f"{r.req_id}: group {g}'s blocks",
                    )
                    sparse = c.prefix_cache_retention_interval is not None  # states it did not cache: no hash
                    # with the drop (or look-ahead hashes of several tokens) a prefill checkpoint one block below
                    # the chunk's last full block sits in the entry above it, keyed there
                    shifted = (
                        c.drop_trailing_hit_block or c.hash_lookahead_tokens > 1
                    ) and c.mamba_prefill_checkpoint_alignment is not None
                    require(
                        all(
                            self._block_hash[b] == self._group_key(r.block_hashes[i], g)
                            or (sparse and self._block_hash[b] is None)
                            or (shifted and i > 0 and self._block_hash[b] == self._group_key(r.block_hashes[i - 1], g))
                            # with prefix hits inside a block, a prefill checkpoint keyed at its unit boundary (or
                            # taken out of the cache as a transient state)
                            or (self._partial_unit and (self._block_hash[b] is None or b in self._partial_tokens))
                            for i, b in enumerate(table[:num_cached])
                            if b != 0
                        ),
                        f"{r.req_id}: group {g}'s cached states' hashes",
                    )
                    live = [b for b in table if b != 0]
                    require(len(set(live)) == len(live), f"{r.req_id}: a block twice in one table")
                    for b in live:
                        holders[b] += 1
                    continue
                if windows[g] in (CROSS_ATTENTION, MAMBA, RING):  # the encoder output's, the state's or the ring's
                    want = (
                        0
                        if not r.block_ids
                        else math.ceil(r.cross_attention_tokens / bs)
                        if windows[g] == CROSS_ATTENTION
                        else 1
                        if windows[g] == RING
                        else 1 + c.mamba_speculative_blocks
                    )
                    require(len(table) == want and self._group_cached(r, g) == 0, f"{r.req_id}: group {g}'s blocks")
                    for b in table:
                        holders[b] += 1
                    continue
                # the slots the primary's covers at the group's own block size (as many entries as some slot count in
                # the primary's last block needs)
                gbs = self._group_bs(g) if c.kv_cache_groups is not None else bs
                p = len(r.block_ids)
                lo = -(-((p - 1) * bs + 1) // gbs) if p else 0
                require(lo <= len(table) <= -(-p * bs // gbs), f"{r.req_id}: group {g}'s table covers the primary's")
                # A sliding window's table starts with the null blocks of the blocks that left the window.
                live = table[next((k for k, b in enumerate(table) if b != 0), len(table)) :]
                require(windows[g] is not None or len(live) == len(table), f"{r.req_id}: null block")
                require(len(set(live)) == len(live) and 0 not in live, f"{r.req_id}: a block twice in one table")
                require(
                    g not in c.prefix_replay_groups or all(self._block_hash[b] is None for b in live),
                    f"{r.req_id}: a replay group's block cached",
                )
                for b in live:
                    holders[b] += 1
        for req_id, (tables, awaiting_recv, awaiting_send, _, window) in self._held.items():
            require(awaiting_recv or awaiting_send, f"{req_id}: held blocks for no transfer")
            require(req_id not in self._requests, f"{req_id}: live and held")
            for b in (b for t in [*tables, *window] for b in t):
                holders[b] += b != 0
        fences = [fence for fence, _ in self._deferred_frees]
        require(fences == sorted(fences) and all(f <= self._sched_step_seq for f in fences), "deferred fences")
        for _, blocks in self._deferred_frees:
            for b in blocks:
                holders[b] += b != 0
        for b, n in self._pins.items():
            require(0 < b < c.num_blocks and n > 0, f"block {b} pinned {n} times")
            holders[b] += n
        load_fences = [fence for fence, _, _ in self._deferred_loads.values()]
        require(
            load_fences == sorted(load_fences)
            and all(self._processed_step_seq < f <= self._sched_step_seq for f in load_fences),
            "deferred load fences",
        )
        for req_id in self._deferred_loads:
            q = self._requests.get(req_id)
            require(
                q is not None and q.status == RequestStatus.WAITING_FOR_REMOTE_KVS,
                f"{req_id}: a deferred load's request is not waiting for its load",
            )
        require(self._ref_cnt == holders, "ref_cnt == number of block tables holding the block")
        require(holders[0] == 0 and 0 not in self._free and self._block_hash[0] is None, "null block")
        for b in range(1, c.num_blocks):
            require((b in self._free) == (self._ref_cnt[b] == 0), f"block {b}: free xor referenced")
        require(len(free) + sum(1 for h in holders if h) == c.num_usable_blocks, "blocks conserved")
        hashed = {b for b in range(c.num_blocks) if self._block_hash[b] is not None}
        in_map = [(h, b) for h, blocks in self._cached.items() for b in blocks]
        require(all(blocks for blocks in self._cached.values()), "no empty cache-map entries")
        extra = {(k, b) for b, keys in self._extra_keys.items() for k in keys}
        require(all(self._block_hash[b] is not None for b in self._extra_keys), "extra keys on hashed blocks")
        require(all(b in hashed for b in self._partial_tokens), "partial-entry lengths of hashed blocks")
        require(
            all(self._block_hash[b] == h or (h, b) in extra for h, b in in_map),
            "cache map entry matches one of the block's keys",
        )
        require(len(in_map) == len(hashed) + len(extra), "every key of every hashed block is in the map once")
        require({b for _, b in in_map} == hashed, "every hashed block is in the map")

        waiting = list(self._waiting)
        require(len(waiting) == len(self._waiting), "waiting count")
        kv_waiting = list(self._kv_waiting)
        require(len(kv_waiting) == len(self._kv_waiting), "kv_waiting count")
        parked = [r for r in self._requests.values() if r.parked]
        not_running = [r for r in self._requests.values() if r.status != RequestStatus.RUNNING]
        for t in self._tenants.values():
            n = sum(r.tenant == t.name for r in not_running)
            require(t.num_waiting == n, f"tenant {t.name}: waiting count")
            n = sum(r.tenant == t.name for r in self._running)
            require(t.num_running == n, f"tenant {t.name}: running count")
            require(n <= t.max_running, f"tenant {t.name}: above its running limit")
            require(t.counter >= 0, f"tenant {t.name}: counter")
        require(all(r.parked for r in self._newly_ready), "newly ready requests are parked")
        for r in parked:
            blocked = (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS)
            require(r.status in blocked, f"{r.req_id}: parked with status {r.status!r}")
        for r in kv_waiting:
            require(r.status != RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, f"{r.req_id}: kv_waiting")
            require(
                r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or r.kv_load_done or not self._config.park_kv_loads,
                f"{r.req_id}: loading",
            )
            require(r.num_computed_tokens <= len(r.block_ids) * bs, f"{r.req_id}: computed tokens without KV")
        num_wfi = sum(r.status == RequestStatus.WAITING_FOR_STREAMING_REQ for r in self._requests.values())
        require(num_wfi == self._num_waiting_for_input, "sessions waiting for input count")
        placed = [id(r) for r in self._running + waiting + kv_waiting + parked]
        require(len(placed) == len(set(placed)), "a request in two places")
        require(set(placed) == {id(r) for r in self._requests.values()}, "every request in exactly one place")
        require(len(self._running) <= c.max_num_seqs, "len(running) <= max_num_seqs")
        for r in self._running:
            require(r.status == RequestStatus.RUNNING, f"{r.req_id} in running with status {r.status!r}")
            require(r.num_computed_tokens <= len(r.block_ids) * bs, f"{r.req_id}: computed tokens without KV")
            for g in range(len(windows)):
                table = self._group_table(r, g) if c.kv_cache_groups is not None else r.block_ids
                num_cached = self._group_cached(r, g) if c.kv_cache_groups is not None else r.num_cached_blocks
                # sparse retention: the Mamba states and window blocks it did not cache have no hash
                w = windows[g]
                window = isinstance(w, int) and not isinstance(w, bool) and w > 0
                # (a window among groups of different block sizes keeps the blocks an aligned hit can use, retention
                # or not)
                sized = len(set(c.group_block_sizes())) > 1
                sparse = (w == MAMBA or window) and (c.prefix_cache_retention_interval is not None or sized)
                # a Mamba prefill checkpoint with the drop (or look-ahead hashes of several tokens): keyed one block
                # below its entry
                shifted = (
                    w == MAMBA
                    and (c.drop_trailing_hit_block or c.hash_lookahead_tokens > 1)
                    and c.mamba_prefill_checkpoint_alignment is not None
                )
                k = self._group_bs(g) // bs if c.kv_cache_groups is not None else 1
                for i in range(num_cached):
                    if table[i] != 0 and windows[g] != 1:  # a window of one token caches nothing
                        h = r.block_hashes[(i + 1) * k - 1]  # a block is keyed by the hash of its last hash block
                        key = h if g == 0 else h + bytes([g])
                        got = self._block_hash[table[i]]
                        below = shifted and i > 0 and got == self._group_key(r.block_hashes[i - 1], g)
                        # with prefix hits inside a block, a Mamba prefill checkpoint keyed at its unit boundary (or
                        # taken out of the cache as a transient state)
                        unit_key = (
                            w == MAMBA
                            and bool(self._partial_unit)
                            and (got is None or table[i] in self._partial_tokens)
                        )
                        require(
                            got == key or (sparse and got is None) or below or unit_key,
                            f"{r.req_id}: group {g} block {i} hash",
                        )
        waiting_statuses = (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
            RequestStatus.WAITING_FOR_STREAMING_REQ,  # stopped by its stale output while preempted
        )
        for r in waiting:
            require(r.status in waiting_statuses, f"{r.req_id}: status")
            require(not r.block_ids and r.num_computed_tokens == 0, f"{r.req_id} waiting with KV")
            require(r.num_output_placeholders == 0, f"{r.req_id} waiting with output placeholders")
        for r in self._running:
            require(not r.deferred, f"{r.req_id} running but deferred")
        cpu_held = [b for r in self._requests.values() for b in r.cpu_blocks]
        require(sorted(cpu_held + list(self._cpu_free)) == list(range(c.num_cpu_blocks)), "CPU blocks: each once")
        for r in self._requests.values():
            require(bool(r.cpu_blocks) == (r.num_swapped_tokens > 0), f"{r.req_id}: CPU blocks vs swapped tokens")
            if r.cpu_blocks:
                require(r.status == RequestStatus.PREEMPTED and not r.block_ids, f"{r.req_id}: swapped but not waiting")
                require(len(r.cpu_blocks) == -(-r.num_swapped_tokens // bs), f"{r.req_id}: CPU blocks cover its KV")
                require(r.num_swapped_tokens < r.num_tokens, f"{r.req_id}: swapped more than it has")
        for r in self._requests.values():
            require(0 <= r.num_stale_output_tokens <= r.num_in_flight_tokens, f"{r.req_id}: stale tokens")
        for r in self._requests.values():
            expect = max(0, r.num_tokens - c.hash_lookahead_tokens) // bs if c.enable_prefix_caching else 0
            require(len(r.block_hashes) == expect, f"{r.req_id}: one hash per full block with its look-ahead")
        enc = self._encoder
        require(0 <= enc.num_free <= enc.capacity, "encoder cache: occupied within the capacity")
        unreferenced = {h for h, e in enc.entries.items() if not e[1]}
        require(set(enc.freeable) == unreferenced, "encoder: freeable = unreferenced")
        refs = sorted((h, x.req_id, i) for h, e in enc.entries.items() for x, i in e[1])
        held = sorted(
            (r.encoder_inputs[i][2], r.req_id, i)
            for r in self._requests.values()
            for i, f in enumerate(r.encoder_held)
            if f
        )
        require(refs == held, "encoder cache references = the inputs requests hold")
        for r in self._requests.values():
            require(r.status == RequestStatus.RUNNING or not any(r.encoder_held), f"{r.req_id}: holds encoder entries")
        out = self._last_out
        if out is not None:
            tokens = c.max_num_batched_tokens if c.max_num_scheduled_tokens is None else c.max_num_scheduled_tokens
            require(out.total_num_scheduled_tokens <= tokens, "token budget respected")
            inputs = out.total_num_scheduled_tokens + len(out.req_ids) * c.draft_slots
            require(inputs <= c.max_num_batched_tokens, "input budget respected")
            require(len(out.req_ids) <= c.max_num_seqs, "max_num_seqs respected")
            require(bool(np.all(out.num_scheduled_tokens > 0)), "every scheduled request computes >= 1 token")
