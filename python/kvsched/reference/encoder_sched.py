"""Encoder inputs in the step loop (docs/semantics.md, "Encoder inputs"): which inputs a step computes, how far
a prefill chunk may reach, and when a request's references to the encoder cache (``encoder.py``) are taken and
dropped. Mirrors ``rust/kvsched-core/src/encoder_sched.rs`` (vLLM's ``_try_schedule_encoder_inputs`` rules).
"""

from __future__ import annotations

import dataclasses

from .._errors import InvalidConfigError, InvalidRequestError, SchedulerTypeError
from .request import _Request
from .state import _SchedulerState


class _EncoderStep:
    """One step's encoder bookkeeping: the budget left, the (request, input) pairs computed by requests already
    scheduled, and the plan of the request being scheduled (inputs it computes, inputs it newly references)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.work: list[tuple[_Request, int]] = []
        self.pending: list[tuple[_Request, int]] = []
        self.newly: list[int] = []


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
                if size > chunk:
                    raise InvalidRequestError(f"request {req_id!r}: encoder input {i} exceeds a chunk")
            if known.setdefault(h, size) != size:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i}: hash {h} known with another size")

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
        self._encoder.capacity = encoder_cache_size
        self._config = dataclasses.replace(
            self._config,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size,
        )
        self._last_out_fresh = False

    def _release_all_encoder(self, r: _Request) -> None:
        for i, (_, _, h) in enumerate(r.encoder_inputs):
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(h, (r, i))

    def _plan_encoder(self, st: _EncoderStep, r: _Request, computed: int, n: int) -> int:
        """vLLM's _try_schedule_encoder_inputs: the chunk [computed, computed + n) reuses cached inputs and
        computes the others that fit the step's budget and the cache; it is cut before the first that does not
        (to 0 when it starts inside it). With disable_chunked_mm_input it stops before an input it would cover
        only in part. Entries are allocated (and budget charged) now; the plan is committed or rolled back."""
        if n == 0 or not r.encoder_inputs:
            return n
        end = computed + n
        for i, (start, size, h) in enumerate(r.encoder_inputs):
            if start + size <= computed:
                continue
            if start >= end:
                break
            if self._config.disable_chunked_mm_input and computed <= start and end < start + size:
                return start - computed
            if self._encoder.reference(h, (r, i)):
                if not r.encoder_held[i]:
                    r.encoder_held[i] = True
                    st.newly.append(i)
                continue
            if not self._encoder.fits(size, st.budget):
                return min(n, start - computed) if computed < start else 0
            self._encoder.entries[h] = [size, [(r, i)]]
            st.budget -= size
            r.encoder_held[i] = True
            st.newly.append(i)
            st.pending.append((r, i))
        return n

    def _commit_encoder(self, st: _EncoderStep) -> None:
        self._stats["encoder_hits"] += max(0, len(st.newly) - len(st.pending))
        st.work += st.pending
        st.pending, st.newly = [], []

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
        self._settle_uncomputed(st, pending, r, r)

    def _abandon_encoder(self, st: _EncoderStep, victim: _Request, current: _Request) -> None:
        """``victim`` is preempted in the step: its references go, its budget comes back, and the inputs it was
        to compute go to the first request still referencing them, or leave the cache."""
        if victim is current:
            st.newly = []
            removed, st.pending = st.pending, []
        else:
            removed = [w for w in st.work if w[0] is victim]
            st.work = [w for w in st.work if w[0] is not victim]
        self._release_all_encoder(victim)
        self._settle_uncomputed(st, removed, victim, current)

    def _settle_uncomputed(
        self, st: _EncoderStep, items: list[tuple[_Request, int]], owner: _Request, current: _Request
    ) -> None:
        inputs = [owner.encoder_inputs[i] for _, i in items]
        st.budget += sum(size for _, size, _ in inputs)
        for _, size, h in inputs:
            e = self._encoder.entries.get(h)
            if e is not None and e[1]:
                ref = e[1][0]
                st.budget -= size
                if ref[0] is current and owner is not current:
                    st.pending.append(ref)
                else:
                    st.work.append(ref)
            else:
                self._encoder.drop(h, False)

    def _release_consumed(self, r: _Request) -> None:
        """vLLM's _free_encoder_inputs: after a step, inputs ending at or before the computed tokens (less
        output placeholders) are released."""
        upto = max(0, r.num_computed_tokens - r.num_output_placeholders)
        for i, (start, size, h) in enumerate(r.encoder_inputs):
            if start + size > upto:
                break
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(h, (r, i))
