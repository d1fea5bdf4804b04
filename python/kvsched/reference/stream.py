"""Streaming-input sessions (vLLM 0.33's resumable requests): a stop ends only the current input part; the request
keeps its blocks and computed tokens and waits for its next part (docs/semantics.md, Streaming input)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from .._errors import InvalidRequestError, SchedulerTypeError
from .._types import FinishReason, RequestStatus
from .connector_sched import _ConnectorMixin
from .convert import _check_tokens, _int_array, _is_int, _to_float
from .kv_cache_manager import _KVCacheManagerMixin
from .request import _Request


class _StreamMixin(_KVCacheManagerMixin, _ConnectorMixin):
    def _check_resumable(self, req_id: str, encoder_inputs: list[Any], ready: bool) -> None:
        what = None
        if encoder_inputs:
            what = "encoder inputs"
        elif self._config.preemption_mode != "recompute":
            what = "preemption_mode other than 'recompute'"
        elif not ready:
            what = "ready=False"
        elif self._config.hash_lookahead_tokens > 0:
            # A part drops the last sampled token, which the hash of the block before it may cover.
            what = "hash_lookahead_tokens > 0"
        if what is not None:
            raise InvalidRequestError(f"request {req_id!r}: a resumable request cannot have {what}")

    def append_input(
        self,
        req_id: str,
        prompt_token_ids: Any,
        max_tokens: int | None = None,
        eos_token_id: int | None = None,
        ignore_eos: bool | None = False,
        stop_token_ids: Any = (),
        arrival_time: float | None = None,
    ) -> None:
        """The next input part of the streaming-input session ``req_id`` (taken now if it waits for one, else
        queued for its following stop). Validates everything first; on error nothing changes."""
        prompt = _int_array(prompt_token_ids, "prompt_token_ids")
        _check_tokens(prompt, "prompt_token_ids", InvalidRequestError)
        if max_tokens is not None and not _is_int(max_tokens):
            raise SchedulerTypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
        if eos_token_id is not None:
            if not _is_int(eos_token_id):
                raise SchedulerTypeError("eos_token_id must be None or an int")
            if not 0 <= eos_token_id < 2**31:
                raise InvalidRequestError(f"eos_token_id {eos_token_id} out of [0, 2**31)")
        ignore_eos = False if ignore_eos is None else ignore_eos
        if not isinstance(ignore_eos, bool):
            raise SchedulerTypeError("ignore_eos must be a bool")
        stops = _int_array([] if stop_token_ids is None else stop_token_ids, "stop_token_ids")
        _check_tokens(stops, "stop_token_ids", InvalidRequestError)
        if arrival_time is None:
            arrival_time = time.monotonic()
        elif not isinstance(arrival_time, (int, float, np.integer, np.floating)) or isinstance(
            arrival_time, (bool, np.bool_)
        ):
            raise SchedulerTypeError(f"arrival_time must be a float, got {type(arrival_time).__name__}")
        r = self._get(req_id)
        if not r.resumable:
            raise InvalidRequestError(f"request {req_id!r} is not a streaming-input (resumable) request")
        if r.input_closed:
            raise InvalidRequestError(f"request {req_id!r}: its input was finished (finish_input)")
        if len(prompt) == 0:
            raise InvalidRequestError(f"request {req_id!r}: an input part needs at least one token")
        if not math.isfinite(_to_float(arrival_time)):
            raise InvalidRequestError(f"arrival_time must be finite, got {arrival_time}")
        c = self._config
        waiting = r.status == RequestStatus.WAITING_FOR_STREAMING_REQ
        base = r.num_tokens if waiting else r.max_len_bound
        worst_prompt = base - 1 + len(prompt)
        if worst_prompt >= c.max_model_len:
            raise InvalidRequestError(
                f"request {req_id!r}: with this part the prompt can reach {worst_prompt} tokens, no room in "
                f"max_model_len={c.max_model_len}"
            )
        bound = c.max_model_len if max_tokens is None else min(worst_prompt + int(max_tokens), c.max_model_len)
        if bound - 1 > c.kv_capacity_tokens:
            raise InvalidRequestError(f"request {req_id!r}: the streaming-input session can reach {bound - 1} KV slots")
        if not c.enable_chunked_prefill and bound - 1 > c.max_chunk_tokens:
            raise InvalidRequestError(f"request {req_id!r}: the streaming-input session can reach {bound - 1} KV slots")
        r.max_len_bound = bound
        part = (
            prompt.tolist(),
            None if max_tokens is None else int(max_tokens),
            None if eos_token_id is None else int(eos_token_id),
            ignore_eos,
            frozenset(stops.tolist()),
            _to_float(arrival_time),
        )
        if waiting:
            self._take_part(r, part)
        else:
            r.input_queue.append(part)
        self._last_out_fresh = False

    def finish_input(self, req_id: str) -> None:
        """Ends the input of a streaming request: one waiting for input is aborted, one still running finishes at
        its following stop."""
        r = self._get(req_id)
        if not r.resumable:
            raise InvalidRequestError(f"request {req_id!r} is not a streaming-input (resumable) request")
        if r.input_closed:
            raise InvalidRequestError(f"request {req_id!r}: its input was already finished")
        r.input_closed = True
        if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        else:
            r.input_queue.append(None)
        self._last_out_fresh = False

    def has_request(self, req_id: str) -> bool:
        """vLLM's ``has_request``: live (waiting for input too) or its blocks held for a transfer."""
        return req_id in self._requests or req_id in self._held

    def _stop_part(
        self, r: _Request, status: RequestStatus, parts: list[tuple[str, int, int]], stop_reason: int
    ) -> bool:
        """A part of session ``r`` stopped; False when its input is over (the caller finishes it)."""
        # The part's in-flight work is dropped first, also when the input is over (the finish then hands a KV
        # connector the blocks of the computed tokens left), as vLLM does.
        r.num_computed_tokens = max(0, r.num_computed_tokens - r.num_output_placeholders)
        r.drafts = []
        r.drop_stale_output = True
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        r.inflight_prefill = False
        if r.input_queue and r.input_queue[0] is None:
            r.input_queue.popleft()
            return False
        if r.status == RequestStatus.RUNNING:
            self._running.remove(r)
            self._session_leaves_running(r)
            t = self._tenants[r.tenant]
            t.num_waiting += 1
            t.num_running -= 1
        elif any(x is r for x in self._kv_waiting):
            self._kv_waiting.remove(r)
        else:
            self._waiting.remove(r)
        r.wait_seq = 0
        r.deferred = False
        if r.input_queue:
            r.status = RequestStatus.WAITING
            self._take_part(r, r.input_queue.popleft())
        else:
            r.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self._num_waiting_for_input += 1
        self._continuing.append(r)
        reason = FinishReason.STOP if status == RequestStatus.FINISHED_STOPPED else FinishReason.LENGTH
        parts.append((r.req_id, int(reason), stop_reason))
        return True

    def _queue_continuing(self) -> None:
        for r in self._continuing:
            if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                r.deferred = True
            if r.num_computed_tokens > 0 or r.block_ids:
                self._kv_waiting.add(r)
            else:
                self._waiting.add(r)
                self._enter_waiting(r)
        self._continuing = []

    def _take_part(self, r: _Request, part: tuple[Any, ...]) -> None:
        tokens, max_tokens, eos, ignore_eos, stops, arrival_time = part
        keep = r.num_tokens - 1
        # Without trim_computed_on_stop a stop inside a step's tokens leaves the computed count past the tokens
        # kept; the KV of the positions the part now fills is recomputed.
        r.num_computed_tokens = min(r.num_computed_tokens, keep)
        del r.token_ids[keep:]
        del r.block_hashes[keep // self._bs :]
        if self._partial_unit:
            del r.unit_hashes[keep // self._partial_unit :]
        r.token_ids.extend(tokens)
        r.num_prompt_tokens = len(r.token_ids)
        room = self._config.max_model_len - r.num_prompt_tokens
        r.max_tokens = room if max_tokens is None else min(max_tokens, room)
        r.requested_max_tokens = r.max_tokens if max_tokens is None else max_tokens
        r.min_tokens = 0
        r.eos_token_id = eos
        r.ignore_eos = ignore_eos
        r.stop_token_ids = stops
        r.arrival_time = arrival_time + 0.0
        if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            self._num_waiting_for_input -= 1
        r.status = RequestStatus.WAITING
        self._update_block_hashes(r)
        if r.num_computed_tokens == 0 and r.block_ids:
            # Nothing computed is left (a runner sampled tokens for a partial prefill, and the stop dropped them as
            # in flight): the blocks hold no valid KV; they are freed and the next admission looks up afresh.
            self._free_request_blocks(r)
