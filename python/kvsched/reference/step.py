"""``schedule()``: vLLM 0.33's token-budget loop. Mirrors ``rust/kvsched-core/src/step.rs``.

Phase A walks ``running`` in order and gives each request ``min(remaining, threshold, budget, model-length
cap)`` tokens; when its KV slots cannot be allocated, a victim is preempted (``victim.py``; vLLM's rule: fcfs:
the last running request; priority: the largest ``(priority, arrival_time)``; fair: the last of the tenant with
the largest counter) until the allocation succeeds or the request itself is the victim. Phase B, only when
nothing was preempted and admissions are not paused, admits waiting requests in policy order with their
prefix-cache hits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InternalError, SchedulerTypeError
from .._types import RequestStatus
from ..config import CROSS_ATTENTION, MAMBA, RING
from .admission import _AdmissionMixin
from .connector_sched import _ConnectorMixin
from .convert import _indptr
from .encoder_sched import _EncoderSchedMixin, _EncoderStep
from .output import SchedulerOutput
from .queue import _WaitingQueue
from .request import _Request
from .swap_sched import _SwapMixin
from .victim import _VictimMixin


class _Budget:
    """A step's two budgets (vLLM 0.33): ``tokens`` to compute (``max_num_scheduled_tokens``) and model
    ``inputs`` (``max_num_batched_tokens``), of which every scheduled request also takes ``slots`` (``draft_slots``:
    the query rows a drafter adds)."""

    def __init__(self, tokens: int, inputs: int, slots: int) -> None:
        self.tokens, self.inputs, self.slots = tokens, inputs, slots

    def open(self) -> bool:
        """Whether one more request can be scheduled."""
        return self.tokens > 0 and self.inputs > self.slots

    def chunk(self) -> int:
        """The most tokens the next request can be given (only while ``open()``)."""
        return min(self.tokens, self.inputs - self.slots)

    def take(self, n: int) -> None:
        self.tokens -= n
        self.inputs -= n + self.slots

    def give(self, n: int) -> None:
        """A request scheduled with ``n`` tokens leaves the step (a preemption victim)."""
        self.tokens += n
        self.inputs += n + self.slots


class _StepMixin(_AdmissionMixin, _ConnectorMixin, _EncoderSchedMixin, _SwapMixin, _VictimMixin):
    """``schedule()`` and what only it uses: preemption, promoting finished loads."""

    def _preempt(self, r: _Request, drop_stale_output: bool = False) -> None:
        """Free ``r``'s KV and send it back to waiting. Output of steps still in flight becomes stale: applied
        when it arrives (dropped with ``drop_stale_output``, always with ``drop_preempted_output``), rolling
        nothing back; ``r`` is not resumed before. With ``defer_block_free`` its blocks wait for the steps in
        flight."""
        drop_stale_output = drop_stale_output or self._config.drop_preempted_output
        self._free_request_blocks(r)
        self._release_all_encoder(r)
        if self._config.encoder_decoder:  # vLLM's EncoderDecoderCacheManager frees a preempted request's inputs
            self._enc_dec_free_slots += r.cross_attention_tokens
        r.num_lost_tokens = r.num_computed_tokens
        r.num_computed_tokens = 0
        r.drafts = []
        r.inflight_prefill = False
        r.status = RequestStatus.PREEMPTED
        r.num_preemptions += 1
        r.drop_stale_output = drop_stale_output or (r.drop_stale_output and r.num_stale_output_tokens > 0)
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        self._session_leaves_running(r)
        self._stats["preemptions"] += 1
        self._waiting.add_preempted(r)
        t = self._tenants[r.tenant]
        t.num_waiting += 1  # back in waiting; no lift (the tenant did not arrive)
        t.num_running -= 1
        self._enter_waiting(r)

    @property
    def prefill_cadence(self) -> tuple[int, int, bool]:
        """``(num_executed_steps, last_prefill_step, prefill_capacity_bound)``."""
        return self._num_executed_steps, self._last_prefill_step, self._prefill_capacity_bound

    def schedule(self, throttle_prefills: bool | None = None) -> SchedulerOutput:
        """One step: continue running requests (phase A, may preempt), then admit waiting ones (phase B).
        ``throttle_prefills`` (vLLM's data-parallel prefill balancing) and ``prefill_schedule_interval`` defer
        prefill compute while something decodes; None is False."""
        if throttle_prefills is None:
            throttle_prefills = False
        if not isinstance(throttle_prefills, bool):
            raise SchedulerTypeError(f"throttle_prefills must be a bool, got {type(throttle_prefills).__name__}")
        c = self._config
        if self._newly_ready:
            self._queue_newly_ready()
        self._in_schedule = True  # from here on a request entering waiting first waits in the next step
        look, num_spec = c.num_lookahead_tokens, c.num_spec_tokens
        budget = _Budget(
            0 if self._pause_state == "paused_all" else c.max_num_scheduled_tokens or c.max_num_batched_tokens,
            c.max_num_batched_tokens,
            c.draft_slots,
        )
        # the per-request cap applies only when more than one request is running or waiting (blocked ones too)
        num_eligible = len(self._requests)
        threshold = c.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and c.long_prefill_token_threshold_adaptive:  # floored at a fair share of the budget
            threshold = max(threshold, c.max_num_batched_tokens // num_eligible)
        # per scheduled request: [request, num_new_tokens, computed_before, new_blocks, drafts, kind, is_chunk]
        scheduled: list[list[Any]] = []
        preempted: list[_Request] = []
        swap_out: list[int] = []  # flattened (GPU block, CPU block) pairs
        swap_in: list[int] = []  # flattened (CPU block, GPU block) pairs
        prefill_scheduled = False  # a request scheduled in phase A is still prefilling
        interval = c.prefill_schedule_interval
        decoding = any(not r.is_prefill_chunk for r in self._running)
        defer = throttle_prefills and not self._prefill_capacity_bound and decoding
        if (
            not defer
            and interval > 1
            and not self._prefill_capacity_bound
            and (self._num_executed_steps + 1) - self._last_prefill_step < interval
            and decoding
        ):
            defer = True  # the local cadence: the interval since the last prefill-carrying step has not passed
        prefill_admitted = False
        self._newly_cached = []  # what updates cached since the previous step is not this step's
        self._mamba_cached_step.clear()
        enc = _EncoderStep(c.max_num_encoder_input_tokens)

        i = 0
        while i < len(self._running) and budget.open():
            r = self._running[i]
            ph = r.num_output_placeholders
            if ph > 0 and r.num_computed_tokens + 2 - ph >= r.num_prompt_tokens + r.requested_max_tokens:
                i += 1  # async: the steps in flight already produce its last token
                continue
            if r.decode_ready_step > self._next_step_id:
                i += 1  # decode_stagger: decoded fewer than decode_stagger calls ago
                continue
            if defer and r.is_prefill_chunk:
                i += 1  # deferred prefill: its next chunk waits for a cadence-aligned step
                continue
            if not self._ec_cache_available(r, max(0, r.num_computed_tokens - ph)):
                i += 1  # the EC connector: an encoder output still in transit
                continue
            n = r.num_tokens + len(r.drafts) + ph - r.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget.chunk(), c.max_model_len - 1 - r.num_computed_tokens)
            # A KV cache below max_model_len caps n, except for a request rolled back by invalid blocks with async
            # placeholders left (vLLM keeps them): vLLM's allocation then fails and it preempts down to the request
            # itself, as here.
            beyond = (
                ph > 0 and r.num_computed_tokens < r.num_tokens and r.num_computed_tokens + n > c.max_slots_per_request
            )
            if not beyond:
                n = min(n, c.max_slots_per_request - r.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            if c.mamba_align:  # a prefill chunk ends where a Mamba state must be written; none: skipped
                n = self._mamba_split(r, r.num_computed_tokens, n)
                if n == 0:
                    i += 1
                    continue
            if r.encoder_inputs:
                n = self._plan_encoder(enc, r, r.num_computed_tokens, n)
            # the drafter's prefill lookahead (after the encoder plan, whose window it widens)
            n = self._reserve_prefill_lookahead(r, r.num_computed_tokens, n)
            if n == 0:  # an encoder input or the drafter's prefill lookahead left nothing to compute
                self._rollback_encoder(enc, r)
                i += 1
                continue
            gave_up = False
            new_blocks = None if beyond else self._allocate_slots(r, n, [], look)
            while new_blocks is None:
                if self._connector is not None and self._connector_has_pending_block_frees():
                    gave_up = True  # the connector's transfers will release blocks: no preemption
                    break
                j = self._pick_victim(scheduled)
                if not self._request_blocks_can_be_freed(self._running[j]):
                    gave_up = True  # a step in flight still writes the victim's blocks: freeing them comes late
                    break
                victim = self._running.pop(j)
                computed_before = None
                for k, entry in enumerate(scheduled):
                    if entry[0] is victim:  # refund the victim's share of this step
                        budget.give(entry[1])
                        computed_before = entry[2]
                        del scheduled[k]
                        break
                if j < i:
                    i -= 1
                self._abandon_encoder(enc, victim, r)
                self._preempt_victim(victim, computed_before, swap_out)
                preempted.append(victim)
                if victim is r:
                    break
                new_blocks = None if beyond else self._allocate_slots(r, n, [], look)
            if new_blocks is None:
                if gave_up:  # r was not preempted: its encoder plan goes, and the pass ends
                    if r.encoder_inputs:
                        self._rollback_encoder(enc, r)
                    break
                # r preempted itself; the requests after it rank higher and may still fit (none under fcfs). vLLM
                # 0.32 ends the pass there under priority.
                if c.policy == "priority" and not c.continue_after_self_preemption:
                    break
                continue
            prefill_scheduled |= r.is_prefill_chunk
            if r.encoder_inputs:
                self._ec_notify_alloc(r, self._ec_allocated(enc))
                self._commit_encoder(enc)
            computed = r.num_computed_tokens
            num_drafts = min(len(r.drafts), max(0, computed + n - r.num_tokens - ph))
            is_chunk = computed + n < r.num_tokens + ph
            scheduled.append([r, n, computed, new_blocks, r.drafts[:num_drafts], "running", is_chunk])
            r.chunk_step = (self._next_step_id, computed)
            r.num_computed_tokens += n
            r.is_prefill_chunk = is_chunk
            r.drafts = []
            budget.take(n)
            i += 1

        for r, n, computed, *_ in scheduled:  # phase A is final: charge its prompt chunks, in order
            if computed < r.num_prompt_tokens:
                self._tenants.charge_prompt(r, computed, n)

        if not preempted and self._pause_state != "paused_all":
            # No probing when nobody can be admitted (a full batch or no budget): nothing would move.
            can_admit = budget.open() and len(self._running) + self._num_waiting_for_input < (
                c.max_num_active_seqs or c.max_num_seqs
            )
            plan = self._begin_admission() if can_admit else None
            prefill_admitted = self._admit_waiting(scheduled, budget, threshold, prefill_scheduled, swap_in, defer, enc)
            self._end_admission(plan)
            if not defer:  # a released step: did it drain the waiting queue (skipped requests aside)?
                waiting = [r for r in self._requests.values() if r.status != RequestStatus.RUNNING]
                self._prefill_capacity_bound = len(waiting) > sum(1 for r in waiting if r.deferred)
        if any(e[1] for e in scheduled):
            self._num_executed_steps += 1
        if interval > 1 and (prefill_scheduled or prefill_admitted):
            self._last_prefill_step = self._num_executed_steps

        # the block copies queued by hits ending inside a block, their blocks' extra references released
        copies = self._take_block_copies() if self._partial_unit else []
        work = sorted(enc.work, key=lambda w: w[1])
        enc_ids: list[list[int]] = [[i for x, i in work if x is e[0]] for e in scheduled]
        enc_hashes = [e[0].encoder_inputs[i][2] for e, ids in zip(scheduled, enc_ids, strict=True) for i in ids]
        if sum(map(len, enc_ids)) != len(work):
            raise InternalError("an encoder input is computed by a request not in the step")
        loads = sorted(enc.loads, key=lambda w: w[1])
        load_ids: list[list[int]] = [[i for x, i in loads if x is e[0]] for e in scheduled]
        if sum(map(len, load_ids)) != len(loads):
            raise InternalError("an encoder input is loaded by a request not in the step")
        # A failed step's loads never arrived either: fail_step treats them as its computes.
        enc_hashes += [e[0].encoder_inputs[i][2] for e, ids in zip(scheduled, load_ids, strict=True) for i in ids]
        self._stats["encoder_inputs"] += len(work)
        self._stats["encoder_tokens"] += sum(x.encoder_inputs[i][1] for x, i in work)
        # The other groups' new blocks per request (every group but the primary one, in group order): the last
        # ones of each table, as many as the primary group's; a cross-attention, Mamba or ring table is taken whole
        # by a new or resumed request and never grows.
        groups: list[list[list[int]]] = []
        windows = c.kv_cache_groups or (None,)
        others = [w for g, w in enumerate(windows) if g != c.primary_group]
        for g, w in enumerate(others):
            whole = w in (CROSS_ATTENTION, MAMBA, RING)
            # An align-mode Mamba table: a running request's entries its allocation appended.
            gid = g if g < c.primary_group else g + 1
            # An attention group of another block size than the primary group's: the blocks its allocation appended.
            appended = (w == MAMBA and c.mamba_align) or (
                w not in (CROSS_ATTENTION, MAMBA, RING) and c.group_block_sizes()[gid] != self._bs
            )
            # (None when the primary group's appended none and its blocks are the smaller; a replayed window's may
            # be smaller still.)
            coarser = c.group_block_sizes()[gid] % self._bs == 0
            groups.append(
                [
                    list(e[0].group_block_ids[g])
                    if (whole or appended) and e[5] in ("new", "resumed")
                    else []
                    if appended and not whole and not e[3] and coarser
                    else e[0].group_block_ids[g][len(e[0].group_block_ids[g]) - e[0].mamba_appended.get(gid, 0) :]
                    if appended
                    else []
                    if whole
                    else e[0].group_block_ids[g][len(e[0].group_block_ids[g]) - len(e[3]) :]
                    for e in scheduled
                ]
            )
        entries = []
        if scheduled:  # a non-empty step: its requests' blocks are written until it is applied
            self._sched_step_seq += 1
        for r, n, _, _, drafts, _, is_chunk in scheduled:
            r.last_sched_seq = self._sched_step_seq
            r.num_in_flight_tokens += n
            if not is_chunk:
                r.inflight_prefill = False
                if c.decode_stagger > 1:  # vLLM's next_decode_eligible_step
                    r.decode_ready_step = self._next_step_id + c.decode_stagger
            if c.async_scheduling and not is_chunk:  # placeholders for the token(s) this step samples
                r.num_output_placeholders += 1 + len(drafts)
                r.drafts = [-1] * num_spec
            entries.append((r, is_chunk, len(drafts)))
        out = SchedulerOutput(
            step_id=self._next_step_id,
            req_ids=[e[0].req_id for e in scheduled],
            num_scheduled_tokens=np.array([e[1] for e in scheduled], dtype=np.int32),
            num_computed_tokens=np.array([e[2] for e in scheduled], dtype=np.int32),
            new_req_ids=[e[0].req_id for e in scheduled if e[5] == "new"],
            resumed_req_ids=[e[0].req_id for e in scheduled if e[5] == "resumed"],
            new_block_ids=np.array([b for e in scheduled for b in e[3]], dtype=np.int32),
            new_block_ids_indptr=_indptr([len(e[3]) for e in scheduled]),
            spec_token_ids=np.array([t for e in scheduled for t in e[4]], dtype=np.int32),
            spec_token_ids_indptr=_indptr([len(e[4]) for e in scheduled]),
            total_num_scheduled_tokens=sum(e[1] for e in scheduled),
            preempted_req_ids=self._preempted_since_schedule + [r.req_id for r in preempted],
            finished_req_ids=self._finished_since_schedule,
            swap_out=np.array(swap_out, dtype=np.int32).reshape(-1, 2),
            swap_in=np.array(swap_in, dtype=np.int32).reshape(-1, 2),
            kv_connector_metadata=None,
            scheduled_encoder_inputs=np.array([i for ids in enc_ids for i in ids], dtype=np.int32),
            scheduled_encoder_inputs_indptr=_indptr([len(ids) for ids in enc_ids]),
            scheduled_encoder_loads=np.array([i for ids in load_ids for i in ids], dtype=np.int32),
            scheduled_encoder_loads_indptr=_indptr([len(ids) for ids in load_ids]),
            free_encoder_hashes=np.array(self._encoder.take_freed(), dtype=np.uint64),
            _encoder_hashes=enc_hashes,
            _owner=self._owner,
            _entries=entries,
            _cached_blocks=self._newly_cached,
            _swapped_out=[r for r in preempted if r.cpu_blocks],
            _group_new_block_ids=[np.array([b for ids in per_req for b in ids], dtype=np.int32) for per_req in groups],
            _group_new_block_ids_indptr=[_indptr([len(ids) for ids in per_req]) for per_req in groups],
            _primary_group=c.primary_group,
            zero_block_ids=np.array([b for ids in self._zero_ids for b in ids], dtype=np.int32),
            kv_cache_block_copies=np.array(copies, dtype=np.int32).reshape(-1, 2),
        )
        self._newly_cached = []
        self._outs_in_flight.append(out)
        for ids in self._zero_ids:
            ids.clear()
        self._next_step_id += 1
        self._finished_since_schedule = []
        self._preempted_since_schedule = []
        self._last_out, self._last_out_fresh = out, True
        self._in_schedule = False
        self._ec_after_hooks()
        self._cap_after_hooks()
        if self._connector is not None:
            self._after_hooks()
            if hasattr(self._connector, "build_connector_meta"):
                out.kv_connector_metadata = self._connector.build_connector_meta(out)
        return out

    def _reserve_prefill_lookahead(self, r: _Request, computed: int, n: int) -> int:
        """A chunk of ``n`` tokens from ``computed`` never ends fewer than ``prefill_lookahead_tokens`` tokens before
        the request's known tokens end: it is shortened to leave that many (possibly to nothing)."""
        remaining = r.num_tokens - computed - n
        lookahead = self._config.prefill_lookahead_tokens
        if 0 < remaining < lookahead:
            return max(0, n - (lookahead - remaining))
        return n

    def _admit_waiting(
        self,
        scheduled: list[list[Any]],
        budget: _Budget,
        threshold: int,
        prefill_scheduled: bool,
        swap_in: list[int],
        defer: bool,
        enc: _EncoderStep,
    ) -> bool:
        """Phase B: admit waiting requests in policy order; never preempts. Requests whose KV load is over
        (``_kv_waiting``) go first, and are the only ones admitted when paused for new requests. Requests that
        cannot run yet are skipped and keep their place. With ``defer`` it stops at a request with prompt to
        compute. Returns whether it admitted one that has (vLLM's ``prefill_admitted``)."""
        prefill_admitted = False
        c, bs, look = self._config, self._bs, self._config.num_lookahead_tokens
        k = c.num_spec_tokens  # drafts per step: the padding of a new decode
        replay_window = c.replay_window  # bounded prefix replay's window W; 0: none
        watermark = int(c.watermark * c.num_blocks)
        any_running_scheduled = bool(scheduled)
        counted = self._running if c.max_loras_counts_unscheduled else [e[0] for e in scheduled]
        loras = {r.lora_name for r in counted if r.lora_name is not None}
        skipped: list[_Request] = []
        skipped_kv: list[_Request] = []
        max_active = c.max_num_active_seqs or c.max_num_seqs
        rekeys = [0]  # sjf re-keys in this pass
        while budget.open() and len(self._running) + self._num_waiting_for_input < max_active:  # sessions keep a slot
            from_kv = len(self._kv_waiting) > 0
            if not from_kv and self._pause_state != "unpaused":
                break
            queue = self._kv_waiting if from_kv else self._waiting
            if not len(queue):
                break
            if from_kv:
                r, aged = queue.peek(), False
            else:
                picked = self._peek_waiting(skipped, rekeys)
                if picked is None:
                    break
                r, aged = picked

            def take(r: _Request = r, queue: _WaitingQueue = queue, aged: bool = aged) -> _Request:
                """Take the candidate out of its queue: the head, or its place if aging picked it."""
                if aged:
                    queue.remove(r)
                    return r
                return queue.pop()

            if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and r.grammar_ready:
                r.status = RequestStatus.WAITING
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.kv_load_done:
                self._promote_loaded(r)
            lora_blocked = (
                c.max_loras > 0 and len(loras) >= c.max_loras and r.lora_name is not None and r.lora_name not in loras
            )
            tenant = self._tenants[r.tenant]
            blocked = (
                r.status
                in (
                    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
                    RequestStatus.WAITING_FOR_REMOTE_KVS,
                    RequestStatus.WAITING_FOR_STREAMING_REQ,
                )
                or (r.num_stale_output_tokens > 0 and not r.drop_stale_output)
                or lora_blocked
                or tenant.num_running >= tenant.max_running  # the per-tenant admission filter
            )
            ext, load_async = 0, False
            computed_before = r.num_computed_tokens
            hits: list[int] = []
            window_loaded = False  # bounded replay: the connector's load restores every replay group
            connector_local = 0  # the local hit the connector was told of (its stats count the tokens beyond it)
            if not blocked and computed_before == 0:
                # The cache-hit cap bounds the lookup: `max` tokens allow `max // bs` blocks (the lookup leaves out
                # the block of the last of the tokens it is given).
                lookup_tokens = r.num_tokens
                cached: list[bool] = []
                if self._hit_cap is not None:
                    cached = [bool(self._cached.get(h)) for h in r.block_hashes]
                    lookup_tokens = min(lookup_tokens, self._cap_ask("max_cache_hit", r.req_id, cached) + 1)
                # With a connector that completes divergent local hits: each group's own hit, and whether one is
                # shorter than full attention's (the per-group lookup leaves the junction at 0).
                per_group = None
                divergent = self._config.divergent_local_hits and self._config.kv_cache_groups is not None
                if divergent and self._connector is not None and not r.skip_reading_prefix_cache:
                    per_group = self._hybrid_lookup_per_group(r.block_hashes, lookup_tokens)
                diverged = False
                if per_group is not None:
                    hits, diverged = per_group
                    r.shared_prefix_boundary = 0
                elif self._partial_unit and not r.skip_reading_prefix_cache:
                    hits = self._partial_lookup(r, lookup_tokens)  # hits can end inside a block
                else:
                    hits = [] if r.skip_reading_prefix_cache else self._lookup(r.block_hashes, lookup_tokens)
                    r.shared_prefix_boundary = (
                        0 if r.skip_reading_prefix_cache else self._shared_prefix_boundary(len(hits))
                    )
                if self._connector is not None and not r.cpu_blocks:  # a swapped-out request resumes from its copy
                    matched = self._hook_matched(r, len(hits) * bs)
                    if r.skip_reading_prefix_cache:
                        pass  # asked, but nothing is loaded for a request that skips reading the cache
                    elif matched is None:
                        blocked = True
                    else:
                        room = r.num_tokens - len(hits) * bs
                        ext = min(matched[0], room)
                        load_async = matched[1] and ext > 0
                        if not load_async and ext == room:
                            ext = room - 1  # a synchronous load leaves at least one token to compute
                        # bounded replay: asked once per admission, only for a hit (the load's promotion keeps it)
                        r.replay_restores = replay_window > 0 and ext > 0 and self._load_restores_replay(r)
                        if replay_window > 0 and not (ext > 0 and r.replay_restores):
                            # Bounded replay recomputes the hit's last window from the block of its first token, and
                            # the window groups free whole blocks below it: a load without the window ends on a
                            # block boundary.
                            ext -= ext % bs
                            load_async = load_async and ext > 0
                    if not blocked and self._hit_cap is not None:
                        # The cap on the external hit, asked whenever the connector answered (0 too).
                        ext = min(self._cap_ask("cap_external_hit", r.req_id, cached, len(hits) * bs, ext), ext)
                        load_async = load_async and ext > 0
                    if diverged and not blocked:
                        self.diverged_hits[ext == 0] += 1
                        if ext == 0:
                            # Nothing from the connector: the usual hit, which every group agrees on, replaces it.
                            hits = self._lookup(r.block_hashes, lookup_tokens)
                            r.shared_prefix_boundary = self._shared_prefix_boundary(len(hits))
                            self._hook_local_hit_replaced(r, len(hits) * bs)
                connector_local = self._hit_tokens(hits)
                if replay_window > 0 and not blocked:
                    window_loaded = ext > 0 and r.replay_restores
                    if not window_loaded and 0 < self._hit_tokens(hits) + ext <= replay_window:
                        # a hit the replay would recompute whole saves nothing: dropped
                        hits, ext, load_async = [], 0, False
            if not blocked and r.encoder_inputs:
                # The EC connector's gate, with the tokens the request has or its lookups cover.
                covered = computed_before if computed_before > 0 else max(len(hits) * bs, r.num_swapped_tokens) + ext
                if computed_before == 0 and not window_loaded:  # the replayed window's inputs are computed again
                    covered = max(0, covered - replay_window)
                blocked = not self._ec_cache_available(r, covered)
            if blocked:
                r.deferred = True
                take()
                # Back among the requests holding KV blocks if it holds some (vLLM's _holds_kv_blocks); a request
                # whose failed load left nothing goes back to `waiting`.
                holds_kv = (
                    r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.num_computed_tokens > 0 or bool(r.block_ids)
                )
                (skipped_kv if holds_kv else skipped).append(r)
                continue
            hit_tokens = self._hit_tokens(hits)
            restored = max(hit_tokens, r.num_swapped_tokens)  # swapped tokens come back by swap_in
            computed = computed_before if computed_before > 0 else restored + ext
            has_prefill = computed + 1 < r.num_tokens
            if defer and not load_async and has_prefill:
                break  # deferred prefill (an asynchronous load computes nothing this step)
            # Bounded replay: a fresh admission's hit recomputes its last window (none when its load carried it);
            # everything after the deferral counts from the rewound tokens.
            num_replay = 0
            hit_computed = computed
            if replay_window > 0 and computed_before == 0 and not load_async:
                num_replay = 0 if window_loaded else min(replay_window, computed)
                computed -= num_replay
                has_prefill = computed + 1 < r.num_tokens
            n = 0 if load_async else r.num_tokens - computed
            pad = False
            if not load_async:
                # spec decoding: one token left, admitted into a batch of decodes: pad with placeholder drafts
                pad = (
                    k > 0
                    and n == 1
                    and not prefill_scheduled
                    and (any_running_scheduled or computed > 0)
                    and computed + 1 + k + 1 <= c.max_model_len
                    and computed + 1 + k <= c.max_slots_per_request
                    and (threshold == 0 or threshold >= 1 + k)
                )
                if pad:
                    if 1 + k > budget.chunk():
                        break
                    n = 1 + k
                if 0 < threshold < n:
                    n = threshold
                if not c.enable_chunked_prefill and n > budget.chunk():
                    break
                n = min(n, budget.chunk())
                if c.mamba_align:  # a prefill chunk ends where a Mamba state must be written; none ends the pass
                    n = self._mamba_split(r, computed, n)
                    if n == 0:
                        break
                    if pad and n != 1 + k:  # a padded decode keeps its drafts or loses them all
                        n, pad = 1, False
            # Nothing left to compute: its first encoder input does not fit, or the drafter's prefill lookahead cut
            # the chunk to nothing. vLLM 0.33 skips it (it keeps its place); 0.32 ends the pass there.
            skip_when_cut: bool | None = None
            planned = not load_async and bool(r.encoder_inputs)
            if planned:
                n = self._plan_encoder(enc, r, computed, n)
                if n == 0:
                    skip_when_cut = c.skip_encoder_blocked_admissions
            if skip_when_cut is None and not load_async:
                n = self._reserve_prefill_lookahead(r, computed, n)
                if n == 0:
                    skip_when_cut = c.skip_lookahead_cut_admissions
            if skip_when_cut is not None:
                self._rollback_encoder(enc, r)
                if not skip_when_cut:
                    break
                r.deferred = True
                (skipped_kv if from_kv else skipped).append(take())
                continue
            # Encoder-decoder: the encoder output is computed at the admission of a request with nothing computed; it
            # must fit the step's encoder budget and the slots, else the request is skipped (it keeps its place).
            enc_dec_tokens = r.cross_attention_tokens if c.encoder_decoder else 0
            enc_dec_charge = 0
            if enc_dec_tokens and computed == 0 and not load_async:
                if enc_dec_tokens > enc.budget or enc_dec_tokens > self._enc_dec_free_slots:
                    if not c.skip_encoder_blocked_admissions:
                        break  # vLLM 0.32: the pass ends there
                    r.deferred = True
                    (skipped_kv if from_kv else skipped).append(take())
                    continue
                enc_dec_charge = enc_dec_tokens
            reserved = watermark if self._running else 0
            if load_async and ext > 0 and self._zero_ids:
                # the groups the load writes keep its tokens' blocks out of the zeroing (asked before allocating)
                loaded = self._hook_loaded_groups(r)
                self._skip_zero = set(range(len(self._zero_ids))) if loaded is None else loaded
            if c.scheduler_reserve_full_isl and not self._full_sequence_fits(r, hits, ext, reserved):
                self._skip_zero = set()
                if planned:
                    self._rollback_encoder(enc, r)
                self._enc_dec_free_slots += enc_dec_tokens  # vLLM frees its inputs, allocated or not
                break  # vLLM's full-prompt admission gate: the whole sequence must fit, not just this chunk
            # vLLM 0.33: an asynchronous load leaves free what the in-flight prefills still need.
            extra = self._inflight_reserved_blocks() if load_async and c.reserve_inflight_prefills else 0
            if computed_before == 0:
                r.num_computed_tokens = restored - hit_tokens  # _allocate_slots counts from computed + hits
            alloc_reserved = reserved + extra
            allocated = self._allocate_slots(
                r, max(n - num_replay, 0), hits, 0 if load_async else look, alloc_reserved, ext, not load_async
            )
            self._skip_zero = set()
            if allocated is None:
                if computed_before == 0:
                    r.num_computed_tokens = 0
                if planned:
                    self._rollback_encoder(enc, r)
                self._enc_dec_free_slots += enc_dec_tokens  # vLLM frees its inputs, allocated or not
                break
            enc.budget -= enc_dec_charge
            self._enc_dec_free_slots -= enc_dec_charge
            ec_allocated = self._ec_allocated(enc) if planned else []
            if planned:
                self._commit_encoder(enc)
            self._complete_resume(r, len(hits), computed, swap_in)
            if replay_window > 0 and computed_before == 0 and not load_async:
                r.replay_start = 0 if window_loaded else hit_computed - num_replay
            if self._connector is not None:
                queries = (r.num_tokens - connector_local, ext) if computed_before == 0 else None
                if (
                    load_async
                    and c.defer_block_free
                    and c.defer_async_loads
                    and self._sched_step_seq > self._processed_step_seq
                ):  # registered once the steps in flight are applied; its blocks wait for them too
                    r.last_sched_seq = self._sched_step_seq
                    self._deferred_loads[r.req_id] = (self._sched_step_seq, ext, queries)
                    self._hook_load_deferred(r, ext)
                else:
                    self._hook_after_alloc(r, ext)
                    self._count_connector_lookup(queries)
            self._ec_notify_alloc(r, ec_allocated)  # after the KV connector hears of the blocks
            if computed_before == 0 and not r.skip_reading_prefix_cache:  # no lookup, no query
                prefix = "preempted_" if r.num_preemptions > 0 else ""
                self._stats[prefix + "queries"] += r.num_tokens
                self._stats[prefix + "hits"] += hit_tokens
            take()
            r.wait_seq = 0  # it left waiting
            if load_async:  # holds its blocks until the engine reports the load over
                r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                r.num_computed_tokens = computed
                r.kv_load_done = False
                r.inflight_prefill = True
                r.deferred = True
                # Parked, or (vLLM 0.33's rule) back with the skipped requests that hold KV blocks, at its place.
                r.parked = c.park_kv_loads
                if not c.park_kv_loads:
                    skipped_kv.append(r)
                continue
            tenant.num_waiting -= 1
            tenant.num_running += 1
            self._tenants.charge_prompt(r, computed, n)
            self._running.append(r)
            if r.session_id is not None:
                self._sessions[r.session_id][0] += 1
            kind = "new" if r.status == RequestStatus.WAITING else "resumed"
            r.status = RequestStatus.RUNNING
            r.deferred = False
            if r.lora_name is not None:
                loras.add(r.lora_name)
            if r.num_cached_tokens < 0:
                r.num_cached_tokens = hit_computed
            is_chunk = computed + n < r.num_tokens
            scheduled.append([r, n, computed, list(r.block_ids), [-1] * k if pad else [], kind, is_chunk])
            r.chunk_step = (self._next_step_id, computed)
            r.num_computed_tokens = computed + n
            r.is_prefill_chunk = is_chunk
            r.inflight_prefill |= is_chunk  # leaves the set after the step (vLLM's _update_after_schedule)
            budget.take(n)
            prefill_admitted |= has_prefill
        for r in reversed(skipped):  # back to the front in their order (fcfs), or by their key (priority)
            self._waiting.add_preempted(r)
            if r.wait_seq == 0:  # back from kv_waiting (its failed load left nothing): it enters waiting anew
                self._enter_waiting(r)
        for r in reversed(skipped_kv):
            self._kv_waiting.add_preempted(r)
        return prefill_admitted

    def _inflight_reserved_blocks(self) -> int:
        """vLLM 0.33's _inflight_prefill_reserved_blocks + _spec_decode_step_blocks: what the in-flight prefills
        still need for their whole sequence (with spec decoding, plus a decode step's 1 + k + lookahead slots),
        plus one decode step's blocks."""
        c, bs = self._config, self._bs
        k = c.num_spec_tokens
        step = 1 + k + c.num_lookahead_tokens if k else 0
        if c.kv_cache_groups is not None:
            # Every group: its blocks, a window's (or chunked-local group's) capped at its admission cap; a Mamba
            # group's as its allocation counts them (mode "none": the state block of max_model_len tokens and the
            # speculative blocks; "align": the entries of the tokens without the decode step, at most one more,
            # summed as they are), and no decode step's blocks (vLLM's Mamba groups hold theirs); a ring's its one
            # block when it holds none (its decode step's blocks count: vLLM's ring is an attention spec).
            windows = list(enumerate(self._group_windows()))
            rows = c.ring_block_size or bs
            total = sum(-(-step // (rows if w == -3 else self._group_bs(g))) for g, w in windows if w != -2)
            spec = c.mamba_speculative_blocks
            for r in self._requests.values():
                if r.inflight_prefill:
                    tokens = min(r.num_tokens, c.max_model_len)
                    for g, w in windows:
                        required = -(-(tokens + step) // self._group_bs(g))
                        held = len(self._group_table(r, g))
                        if w == -2 and c.mamba_align:
                            # (with a prefill checkpoint the rest of the prefill can still export, its block too)
                            allocated = g in r.mamba_allocated
                            stamp, before = r.chunk_step
                            start = before if stamp == self._next_step_id else r.num_computed_tokens
                            checkpoint = self._align_checkpoint(r, g, allocated, start, tokens)
                            total += self._align_need(-(-tokens // bs) + spec, held, allocated, checkpoint is not None)
                        elif w == -2:
                            total += max(0, -(-(tokens + step) // max(1, c.max_model_len)) + spec - held)
                        elif w == -3:
                            total += int(held == 0)
                        else:
                            need = min(required, self._group_cap(w, self._group_bs(g))) if w > 0 else required
                            total += max(0, need - held)
            return max(0, total)
        total = -(-step // bs)
        for r in self._requests.values():
            if r.inflight_prefill:
                required = -(-(min(r.num_tokens, c.max_model_len) + step) // bs)
                if c.sliding_window is not None:  # capped at the window's admission cap
                    required = min(required, self._group_cap(c.sliding_window, bs))
                total += max(0, required - len(r.block_ids))
        return total

    def _promote_loaded(self, r: _Request) -> None:
        """A request whose asynchronous load is over becomes WAITING (PREEMPTED if it was preempted before): its
        loaded blocks enter the cache (after a failure only the valid prefix; with nothing valid its blocks are
        freed and it is admitted afresh), and a fully loaded prompt recomputes its last token."""
        failed = r.kv_load_failed
        if r.kv_load_failed and r.num_computed_tokens == 0:
            self._free_blocks(r)
        else:
            self._cache_blocks(r, r.num_computed_tokens)
        num_replay = 0
        if self._config.replay_window > 0:
            # Bounded replay once the load is over: its hit's last window is computed again, unless the load carried
            # the window (a failed load may have lost it).
            if not failed and r.replay_restores:
                r.replay_start = 0
            else:
                num_replay = min(self._config.replay_window, r.num_computed_tokens)
                r.replay_start = r.num_computed_tokens - num_replay
        if num_replay > 0:
            r.num_computed_tokens -= num_replay
            if r.num_computed_tokens == 0 and r.block_ids:  # nothing left of the hit: admitted afresh
                self._free_blocks(r)
        elif r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens -= 1
            if r.num_computed_tokens == 0 and r.block_ids:  # a one-token prompt: nothing left, admitted afresh
                self._free_blocks(r)
        r.kv_load_done = r.kv_load_failed = False
        r.status = RequestStatus.PREEMPTED if r.num_preemptions > 0 else RequestStatus.WAITING
