"""``update_from_output()``: applies the tokens sampled for one scheduled step; and the drafts of the next.
Mirrors ``rust/kvsched-core/src/update.rs``.

Steps are applied in the order they were scheduled, each once. Everything is validated before anything changes.
Per entry: requests that finished since the step was scheduled are skipped; an entry with no token (a partial
prefill, or a decode the runner returned nothing for) changes nothing else; otherwise rejected drafts are rolled
back (tokens beyond 1 + drafts move the computed count forward), tokens are appended one at a time with a stop
check after each, new full blocks are hashed, and stopped requests are freed and reported. Decode tokens are
charged to the tenants once, at the end of the call.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import InvalidOutputError, SchedulerTypeError
from .._types import FinishReason, RequestStatus
from .connector_sched import _ConnectorMixin
from .convert import _TOKEN_LIMIT, _as_sequence, _ragged
from .encoder_sched import _EncoderSchedMixin
from .kv_cache_manager import _KVCacheManagerMixin
from .output import SchedulerOutput, UpdateResult
from .request import _Request
from .stream import _StreamMixin


class _UpdateMixin(_StreamMixin, _KVCacheManagerMixin, _ConnectorMixin, _EncoderSchedMixin):
    """Applying sampled tokens and setting drafts."""

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: Any, draft_token_ids: Any = None
    ) -> UpdateResult:
        """Apply the sampled tokens (and next drafts) of step ``out``; steps apply in order, once each."""
        out = self._check_output(out)
        if out.step_id != self._next_update_step:
            raise InvalidOutputError(
                f"step {out.step_id} cannot be applied now (expected step {self._next_update_step})"
            )
        n = len(out._entries)
        sampled = _ragged(sampled_token_ids, n, "sampled_token_ids")
        drafts = None if draft_token_ids is None else _ragged(draft_token_ids, n, "draft_token_ids")
        for k, (r, was_prefill_chunk, num_drafts) in enumerate(out._entries):
            if r.status.is_finished:
                continue  # gone since it was scheduled: whatever the entry holds is ignored
            entry, entry_drafts = sampled[k], drafts[k] if drafts is not None else []
            # Any number of sampled tokens is taken (vLLM takes what the runner returns); drafts are checked.
            stale = r.num_stale_output_tokens > 0
            if num_drafts and len(entry) > 1 + num_drafts and not stale and r.num_computed_tokens > 0:
                # Tokens beyond the step's drafts count as computed: never past the KV slots it holds.
                slots = len(r.block_ids) * self._bs
                if r.num_computed_tokens + len(entry) - 1 - num_drafts > slots:
                    raise InvalidOutputError(f"{r.req_id!r}: computed tokens would pass the {slots} KV slots it holds")
            if was_prefill_chunk and entry_drafts:
                raise InvalidOutputError(f"{r.req_id!r} was a prefill chunk: it cannot receive drafts")
            if len(entry_drafts) > self._config.num_spec_tokens:
                raise InvalidOutputError(f"{r.req_id!r}: more drafts than num_spec_tokens")
            for t in itertools.chain(entry, entry_drafts):
                if not 0 <= t < _TOKEN_LIMIT:
                    raise InvalidOutputError(f"{r.req_id!r}: token id {t} out of [0, 2**31)")

        if drafts is not None and self._config.async_scheduling:
            raise InvalidOutputError("with async_scheduling the drafts stay with the runner: pass None")

        self._next_update_step += 1
        self._outs_in_flight.popleft()
        self._last_out_fresh = False
        if n:  # every write of this step is done: deferred frees fenced by it go back
            self._step_applied()
        spec_decoding = self._config.num_spec_tokens > 0
        finished: list[str] = []
        reasons: list[int] = []
        stop_reasons: list[int] = []
        parts: list[tuple[str, int, int]] = []  # sessions whose input part stopped
        num_new = np.zeros(n, dtype=np.int32)
        decode_tokens: dict[str, int] = {}  # per tenant, charged once at the end
        for k, (r, was_prefill_chunk, num_drafts) in enumerate(out._entries):
            if r.status.is_finished:
                continue
            num_scheduled = int(out.num_scheduled_tokens[k])
            r.num_in_flight_tokens -= num_scheduled
            if r.kv_skip_step == out.step_id:
                # Invalid blocks rolled it back (update_kv_transfers): its output of this step is dropped.
                r.num_stale_output_tokens = max(0, r.num_stale_output_tokens - num_scheduled)
                continue
            stale = r.num_stale_output_tokens > 0  # scheduled before r was preempted
            if stale:
                r.num_stale_output_tokens = max(0, r.num_stale_output_tokens - num_scheduled)
                if r.drop_stale_output:
                    continue
            entry = sampled[k]
            if not entry:
                # A partial prefill or a decode the runner returned nothing for: nothing appended, nothing rolled
                # back (a decode's drafts stay counted as computed); consumed encoder inputs are freed.
                self._release_consumed(r)
                self._enc_dec_release_after_output(r)
                if drafts is not None and not stale and not was_prefill_chunk:
                    r.drafts = list(drafts[k])
                continue
            if num_drafts and not stale:
                # Roll back rejected drafts (placeholders too); tokens beyond 1 + drafts move both forward.
                rejected = num_drafts - (len(entry) - 1)
                if r.num_computed_tokens > 0:
                    r.num_computed_tokens = max(0, r.num_computed_tokens - rejected)
                if r.num_output_placeholders > 0:
                    r.num_output_placeholders = max(0, r.num_output_placeholders - rejected)
            self._release_consumed(r)
            self._enc_dec_release_after_output(r)
            was_running = r.status == RequestStatus.RUNNING
            had_placeholders = r.num_output_placeholders > 0
            stop: tuple[RequestStatus, FinishReason, int] | None = None
            for t in entry:
                r.token_ids.append(t)
                num_new[k] += 1
                stop = self._check_stop(r, t)
                if stop is not None:
                    break
            decode_tokens[r.tenant] = decode_tokens.get(r.tenant, 0) + int(num_new[k])
            self._update_block_hashes(r)
            if not stale:
                # A stop cuts the rest of the entry: computed covers only what was kept (with trim_computed_on_stop;
                # the blocks cached now never cover the cut tokens).
                cut = len(entry) - int(num_new[k]) if stop is not None else 0
                if self._config.trim_computed_on_stop:
                    r.num_computed_tokens = max(0, r.num_computed_tokens - cut)
                    cut = 0
                r.num_output_placeholders = max(0, r.num_output_placeholders - len(entry))
                if was_running and (had_placeholders or (spec_decoding and self._config.cache_drafts_at_update)):
                    # Up to what the applied steps computed (vLLM 0.32: the computed count less the placeholders
                    # left, which a rollback of invalid blocks can leave above the tokens in flight).
                    pending = r.num_in_flight_tokens if self._config.cache_upto_in_flight else r.num_output_placeholders
                    self._cache_blocks(r, max(0, r.num_computed_tokens - cut - pending))
            if stop is not None:
                status, reason, stop_reason = stop
                if r.resumable and self._stop_part(r, status, parts, stop_reason):
                    continue
                self._finish(r, status)
                finished.append(r.req_id)
                reasons.append(reason)
                stop_reasons.append(stop_reason)
            elif drafts is not None and not stale:
                r.drafts = list(drafts[k])
        if self._continuing:
            self._queue_continuing()
        for name, tokens in decode_tokens.items():
            self._tenants[name].charge(tokens, True)
        params, self._transfer_params = self._transfer_params, {}
        self._after_hooks()
        return UpdateResult(
            finished_req_ids=finished,
            finish_reasons=np.array(reasons, dtype=np.int8),
            stop_reasons=np.array(stop_reasons, dtype=np.int64),
            num_new_tokens=num_new,
            kv_transfer_params=params,
            part_finished_req_ids=[p[0] for p in parts],
            part_finish_reasons=np.array([p[1] for p in parts], dtype=np.int8),
            part_stop_reasons=np.array([p[2] for p in parts], dtype=np.int64),
        )

    def set_draft_token_ids(self, req_ids: Iterable[str], draft_token_ids: Any) -> None:
        """The drafts each request proposes for its next step (vLLM's ``update_draft_token_ids``): a request whose
        last step was a partial prefill gets none; -1 is an empty draft position (n-gram padding)."""
        if isinstance(req_ids, str):
            raise SchedulerTypeError("req_ids must be an iterable of str, not a single str")
        ids = _as_sequence(req_ids, "req_ids")
        drafts = _ragged(draft_token_ids, len(ids), "draft_token_ids")
        reqs: list[_Request] = []
        k = self._config.num_spec_tokens
        for req_id, entry in zip(ids, drafts, strict=True):  # in order: the first bad entry is reported
            r = self._get(req_id)
            reqs.append(r)
            if len(entry) > k:
                raise InvalidOutputError(f"request {r.req_id!r} may hold at most num_spec_tokens={k} draft tokens")
            for t in entry:
                if not -1 <= t < _TOKEN_LIMIT:
                    raise InvalidOutputError(f"draft token ids must be in [-1, 2**31), got {t}")
        for r, entry in zip(reqs, drafts, strict=True):
            r.drafts = [] if r.is_prefill_chunk else list(entry)

    def _check_stop(self, r: _Request, t: int) -> tuple[RequestStatus, FinishReason, int] | None:
        """The stop check after appending token ``t``, in vLLM 0.33's order: EOS, stop ids, length. min_tokens
        does not hold EOS or stop ids back here (the sampler masks them until then)."""
        if not r.ignore_eos and t == r.eos_token_id:
            return RequestStatus.FINISHED_STOPPED, FinishReason.STOP, -1
        if t in r.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, FinishReason.STOP, t
        if r.num_tokens >= self._config.max_model_len or r.num_output_tokens >= r.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH, -1
        return None
