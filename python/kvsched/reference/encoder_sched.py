"""Encoder inputs in the step loop (docs/semantics.md, "Encoder inputs"): which inputs a step computes, how far
a prefill chunk may reach, and when a request's references to the encoder cache (``encoder.py``) are taken and
dropped. Mirrors ``rust/kvsched-core/src/encoder_sched.rs`` (vLLM's ``_try_schedule_encoder_inputs`` rules).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import InvalidConfigError, InvalidRequestError, SchedulerTypeError
from .request import _Request
from .state import _SchedulerState


class _EncoderStep:
    """One step's encoder bookkeeping: the budget left, the (request, input) pairs computed (and loaded by the
    EC connector) by requests already scheduled, and the plan of the request being scheduled (inputs it
    computes, inputs it loads, inputs it newly references)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.work: list[tuple[_Request, int]] = []
        self.pending: list[tuple[_Request, int]] = []
        self.newly: list[int] = []
        self.loads: list[tuple[_Request, int]] = []
        self.pending_loads: list[tuple[_Request, int]] = []


class _EncoderSchedMixin(_SchedulerState):
    """Checking, planning, committing and releasing encoder inputs."""

    def _check_encoder_inputs(self, req_id: str, prompt_len: int, inputs: list[tuple[int, int, int]]) -> None:
        if not inputs:
            return
        c = self._config
        limit = min(c.max_num_encoder_input_tokens, c.encoder_cache_size)
        if limit == 0:
            raise InvalidRequestError(
                f"request {req_id!r} has encoder inputs, but max_num_encoder_input_tokens and encoder_cache_size "
                "must both be > 0"
            )
        known: dict[int, int] = {h: e[0] for h, e in self._encoder.entries.items()}
        for other in self._requests.values():
            for _, size, h in other.encoder_inputs:
                known[h] = size
        prev_end = 0
        for i, (start, size, h) in enumerate(inputs):
            if size < 1:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i} has no tokens")
            if start + size > prompt_len:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i} reaches beyond the prompt")
            if i > 0 and start < prev_end:
                raise InvalidRequestError(f"request {req_id!r}: encoder inputs must be sorted and not overlap")
            prev_end = start + size
            if size > limit:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i} exceeds the encoder budget/cache")
            if c.disable_chunked_mm_input:
                th = c.long_prefill_token_threshold
                chunk = min(th, c.max_chunk_tokens) if th > 0 else c.max_chunk_tokens
                if size + min(start, c.prefill_lookahead_tokens) > chunk:  # and the lookahead's tokens before it
                    raise InvalidRequestError(f"request {req_id!r}: encoder input {i} exceeds a chunk")
            if known.setdefault(h, size) != size:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i}: hash {h} known with another size")

    def set_prefill_lookahead(self, prefill_lookahead_tokens: int) -> None:
        """Set the drafter's prefill lookahead of the chunk rules and the encoder window (from the next step), only
        while no request is live; the prefix cache's not-final tail stays the one built with."""
        n = prefill_lookahead_tokens
        if isinstance(n, bool) or not isinstance(n, int):
            raise SchedulerTypeError(f"prefill_lookahead_tokens must be an int, got {type(n).__name__}")
        if not 0 <= n <= 1024:
            raise InvalidConfigError(f"prefill_lookahead_tokens must be in [0, 1024], got {n}")
        if self._requests:
            raise InvalidConfigError(
                f"prefill_lookahead_tokens can change only while no request is live ({len(self._requests)} are)"
            )
        self._config = dataclasses.replace(self._config, prefill_lookahead_tokens=n)
        self._last_out_fresh = False

    def set_encoder_sizes(self, max_num_encoder_input_tokens: int, encoder_cache_size: int) -> None:
        """Re-size the encoder budget (from the next step) and the encoder cache (only while it holds no entry);
        neither may drop below a live request's encoder input. On error nothing changes."""
        sizes = {"max_num_encoder_input_tokens": max_num_encoder_input_tokens, "encoder_cache_size": encoder_cache_size}
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise SchedulerTypeError(f"{name} must be an int, got {type(v).__name__}")
            if not 0 <= v <= 2**31 - 1:
                raise InvalidConfigError(f"{name} must be in [0, {2**31 - 1}], got {v}")
        if encoder_cache_size != self._encoder.capacity and self._encoder.entries:
            raise InvalidConfigError("encoder_cache_size can change only while the encoder cache is empty")
        limit = min(max_num_encoder_input_tokens, encoder_cache_size)
        for r in self._requests.values():
            if any(size > limit for _, size, _ in r.encoder_inputs):
                raise InvalidConfigError(f"request {r.req_id!r} has an encoder input larger than the new sizes allow")
        if self._config.encoder_decoder:
            for r in self._requests.values():
                if r.cross_attention_tokens > max_num_encoder_input_tokens:
                    raise InvalidConfigError(
                        f"a live request has {r.cross_attention_tokens} encoder tokens (cross_attention_tokens), "
                        "more than a step could compute with "
                        f"max_num_encoder_input_tokens={max_num_encoder_input_tokens}"
                    )
        self._encoder.capacity = encoder_cache_size
        self._config = dataclasses.replace(
            self._config,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size,
        )
        self._last_out_fresh = False

    @property
    def encoder_decoder_free_slots(self) -> int:
        """Encoder-decoder scheduling: the slot count of vLLM's ``EncoderDecoderCacheManager``."""
        return self._enc_dec_free_slots

    def reset_encoder_decoder_slots(self) -> None:
        """Encoder-decoder scheduling: the slot count back to ``encoder_cache_size`` (vLLM's ``reset``)."""
        if not self._config.encoder_decoder:
            raise InvalidConfigError("reset_encoder_decoder_slots needs encoder_decoder=True")
        self._enc_dec_free_slots = self._config.encoder_cache_size
        self._last_out_fresh = False

    def _check_encoder_decoder_request(self, req_id: str, inputs: list[tuple[int, int, int]], cross: int) -> None:
        """With ``encoder_decoder`` the encoder output comes as ``cross_attention_tokens`` (not ``encoder_inputs``)
        and must fit the step's encoder budget."""
        c = self._config
        if not c.encoder_decoder:
            return
        if inputs:
            raise InvalidRequestError(
                f"request {req_id!r}: with encoder_decoder a request's encoder output is given as "
                "cross_attention_tokens, not encoder_inputs"
            )
        if cross > c.max_num_encoder_input_tokens:
            raise InvalidRequestError(
                f"request {req_id!r}: cross_attention_tokens ({cross}) exceed the encoder compute budget "
                f"(max_num_encoder_input_tokens={c.max_num_encoder_input_tokens}); no step could admit it"
            )

    def _enc_dec_release_after_output(self, r: _Request) -> None:
        """Encoder-decoder: vLLM's EncoderDecoderCacheManager frees a request's inputs at every applied output once
        it has computed tokens."""
        if self._config.encoder_decoder and r.num_computed_tokens > 0:
            self._enc_dec_free_slots += r.cross_attention_tokens

    @property
    def ec_connector(self) -> Any:
        """The encoder-cache connector set with :meth:`set_ec_connector`, or None."""
        return self._ec_connector

    def set_ec_connector(self, connector: Any) -> None:
        """Sets (None: removes) the encoder-cache connector (``has_cache_item(hash)``, optional
        ``ensure_cache_available(req_id, num_computed_tokens)``); it applies from the next step."""
        if connector is not None and not hasattr(connector, "has_cache_item"):
            raise SchedulerTypeError(
                f"ec_connector must have a has_cache_item() method, got {type(connector).__name__}"
            )
        self._ec_connector = connector
        self._last_out_fresh = False

    def _ec_ask(self, hook: str, conservative: bool, *args: Any) -> bool:
        """An EC connector hook's answer; an exception or a non-bool answer is kept (raised after the call)
        and the conservative answer stands."""
        try:
            res = getattr(self._ec_connector, hook)(*args)
            if not isinstance(res, bool):
                raise SchedulerTypeError(f"ec_connector.{hook} must return a bool, got {type(res).__name__}")
            return res
        except Exception as e:  # kept and raised once the scheduler is consistent
            if self._ec_error is None:
                self._ec_error = e
            return conservative

    def _ec_cache_available(self, r: _Request, num_computed: int) -> bool:
        """The EC connector's deferral gate (true without a connector, encoder inputs or the hook)."""
        ec = self._ec_connector
        if ec is None or not r.encoder_inputs or not hasattr(ec, "ensure_cache_available"):
            return True
        return self._ec_ask("ensure_cache_available", True, r.req_id, num_computed)

    def _ec_allocated(self, st: _EncoderStep) -> list[int]:
        """The planned request's inputs to compute, then to load (for update_state_after_alloc)."""
        if self._ec_connector is None:
            return []
        return [i for _, i in st.pending] + [i for _, i in st.pending_loads]

    def _ec_notify_alloc(self, r: _Request, inputs: list[int]) -> None:
        """The EC connector's optional update_state_after_alloc, per input (an exception is kept, as a hook's)."""
        ec = self._ec_connector
        if not inputs or ec is None or not hasattr(ec, "update_state_after_alloc"):
            return
        for i in inputs:
            try:
                ec.update_state_after_alloc(r.req_id, i)
            except Exception as e:  # kept and raised once the scheduler is consistent
                if self._ec_error is None:
                    self._ec_error = e

    def _ec_after_hooks(self) -> None:
        e, self._ec_error = self._ec_error, None
        if e is not None:
            raise e

    def _release_all_encoder(self, r: _Request) -> None:
        for i, (_, _, h) in enumerate(r.encoder_inputs):
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(h, (r, i))

    def _plan_encoder(self, st: _EncoderStep, r: _Request, computed: int, n: int) -> int:
        """vLLM's _try_schedule_encoder_inputs: the chunk [computed, computed + n), widened by the drafter's
        prefill lookahead, reuses cached inputs and computes the others that fit the step's budget and the cache;
        it is cut before the first that does not (to 0 when it starts inside it). With disable_chunked_mm_input it
        stops before an input it would cover only in part, by the lookahead too. Entries are allocated (and budget
        charged) now; the plan is committed or rolled back."""
        if n == 0 or not r.encoder_inputs:
            return n
        shift = self._config.prefill_lookahead_tokens  # the drafter reads that many tokens past the chunk
        end = computed + n
        for i, (start, size, h) in enumerate(r.encoder_inputs):
            if start + size <= computed:
                continue
            if start >= end + shift:
                break
            if self._config.disable_chunked_mm_input and computed <= start and end < start + size:
                return max(0, start - computed - shift)
            if self._encoder.reference(h, (r, i)):
                if not r.encoder_held[i]:
                    r.encoder_held[i] = True
                    st.newly.append(i)
                continue
            if not self._encoder.fits(size, st.budget):
                if not self._config.exact_encoder_cut_and_release:  # vLLM 0.32: the lookahead stops before it too
                    return max(0, start - computed - shift)
                return min(n, start - computed) if computed < start else 0
            # The EC connector is asked once the input fits: a load takes cache space but no budget.
            load = self._ec_connector is not None and self._ec_ask("has_cache_item", False, h)
            self._encoder.entries[h] = [size, [(r, i)]]
            r.encoder_held[i] = True
            st.newly.append(i)
            if load:
                st.pending_loads.append((r, i))
            else:
                st.budget -= size
                st.pending.append((r, i))
        return n

    def _commit_encoder(self, st: _EncoderStep) -> None:
        self._stats["encoder_hits"] += max(0, len(st.newly) - len(st.pending) - len(st.pending_loads))
        st.work += st.pending
        st.loads += st.pending_loads
        st.pending, st.newly, st.pending_loads = [], [], []

    def _rollback_encoder(self, st: _EncoderStep, r: _Request) -> None:
        """``r`` is not scheduled: the references its plan took go, its computes are refunded and dropped."""
        if not st.newly:
            return
        for i in st.newly:
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(r.encoder_inputs[i][2], (r, i))
        st.newly = []
        pending, st.pending = st.pending, []
        loads, st.pending_loads = st.pending_loads, []
        self._settle_uncomputed(st, pending, r, r)
        self._settle_uncomputed(st, loads, r, r, load=True)

    def _abandon_encoder(self, st: _EncoderStep, victim: _Request, current: _Request) -> None:
        """``victim`` is preempted in the step: its references go, its budget comes back, and the inputs it was
        to compute go to the first request still referencing them, or leave the cache."""
        if victim is current:
            st.newly = []
            removed, st.pending = st.pending, []
            removed_loads, st.pending_loads = st.pending_loads, []
        else:
            removed = [w for w in st.work if w[0] is victim]
            st.work = [w for w in st.work if w[0] is not victim]
            removed_loads = [w for w in st.loads if w[0] is victim]
            st.loads = [w for w in st.loads if w[0] is not victim]
        self._release_all_encoder(victim)
        self._settle_uncomputed(st, removed, victim, current)
        self._settle_uncomputed(st, removed_loads, victim, current, load=True)

    def _settle_uncomputed(
        self,
        st: _EncoderStep,
        items: list[tuple[_Request, int]],
        owner: _Request,
        current: _Request,
        load: bool = False,
    ) -> None:
        """Inputs no longer computed (``load``: loaded) by ``owner`` this step: a compute's budget comes back; an
        entry still referenced goes to its first referrer (a compute charged again), another leaves the cache."""
        inputs = [owner.encoder_inputs[i] for _, i in items]
        if not load:
            st.budget += sum(size for _, size, _ in inputs)
        for _, size, h in inputs:
            e = self._encoder.entries.get(h)
            if e is not None and e[1]:
                ref = e[1][0]
                if not load:
                    st.budget -= size
                plan = ref[0] is current and owner is not current
                if load:
                    (st.pending_loads if plan else st.loads).append(ref)
                elif plan:
                    st.pending.append(ref)
                else:
                    st.work.append(ref)
            else:
                self._encoder.drop(h, False)

    def _release_consumed(self, r: _Request) -> None:
        """vLLM's _free_encoder_inputs: after a step, inputs ending at or before the computed tokens (less
        output placeholders; less the drafter's prefill lookahead without exact_encoder_cut_and_release) are
        released."""
        upto = max(0, r.num_computed_tokens - r.num_output_placeholders)
        c = self._config
        delay = 0 if c.exact_encoder_cut_and_release else c.prefill_lookahead_tokens
        for i, (start, size, h) in enumerate(r.encoder_inputs):
            if start + size + delay > upto:
                break
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(h, (r, i))
