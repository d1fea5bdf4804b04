"""Bad input to ``kvsched.Scheduler``: one table, one parametrised test.

Each case builds a scheduler in a known state (a decoding request, a request mid-prefill, a waiting request
and one step in flight), makes one bad call and checks that:

- the exact exception class is raised (every one a ``kvsched.SchedulerError``, with its stdlib mix-in), never a
  ``pyo3_runtime.PanicException`` (a ``BaseException``) nor any other type;
- the message names the bad value;
- nothing changed: stats, free blocks and every request's status, computed tokens, outputs, block table and
  hashes are as before, ``check_invariants()`` passes, and the scheduler then runs everything to completion.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kvsched
import numpy as np
import pytest
from kvsched import (
    DuplicateRequestError,
    InvalidConfigError,
    InvalidOutputError,
    InvalidRequestError,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulerTypeError,
    UnknownRequestError,
)

IDS = ("run", "chunk", "wait", "x")
CONFIG: dict[str, Any] = {
    "block_size": 4,
    "num_blocks": 64,
    "max_model_len": 64,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 2,
    "prefix_hash_seed": 0,
}


def answer(s: Scheduler, out: Any) -> list[list[int]]:
    """The right sampled tokens for ``out`` (call right after ``schedule()``)."""
    res = []
    for rid in out.req_ids:
        num_tokens = s._request_info(rid)[0] + len(s.get_output_token_ids(rid))
        res.append([] if s.get_num_computed_tokens(rid) < num_tokens else [7])
    return res


@dataclass
class Ctx:
    s: Scheduler
    pending: list[tuple[Any, list[list[int]]]] = field(default_factory=list)
    applied: Any = None


def setup_in_flight(**overrides: Any) -> Ctx:
    """run: decoding; chunk: 15 of 30 prompt tokens scheduled; wait: waiting (max_num_seqs=2); the step
    that schedules run and chunk is in flight."""
    s = Scheduler(**{**CONFIG, **overrides})
    s.add_request("run", [1, 2, 3, 4, 5], max_tokens=20)
    out = s.schedule()
    s.update_from_output(out, [[7]])
    s.add_request("chunk", list(range(100, 130)), max_tokens=5)
    s.add_request("wait", [9, 9, 9], max_tokens=5)
    out = s.schedule()
    assert out.req_ids == ["run", "chunk"]
    assert out.num_scheduled_tokens.tolist() == [1, 15]
    return Ctx(s, [(out, answer(s, out))])


def setup_applied() -> Ctx:
    ctx = setup_in_flight()
    out, ans = ctx.pending.pop()
    ctx.s.update_from_output(out, ans)
    ctx.applied = out
    return ctx


def setup_two_in_flight() -> Ctx:
    ctx = setup_in_flight()
    out = ctx.s.schedule()
    ctx.pending.append((out, answer(ctx.s, out)))
    return ctx


def setup_gone() -> Ctx:
    """A request "gone" that was added and aborted: finished requests are forgotten."""
    ctx = setup_in_flight()
    ctx.s.add_request("gone", [5, 6, 7], max_tokens=1)
    ctx.s.abort_requests(["gone"])
    return ctx


def setup_async() -> Ctx:
    """Async scheduling with one draft slot: run's prefill step is in flight."""
    s = Scheduler(**{**CONFIG, "async_scheduling": True, "num_lookahead_tokens": 1})
    s.add_request("run", [1, 2, 3, 4, 5], max_tokens=20)
    out = s.schedule()
    return Ctx(s, [(out, [[7]])])


def setup_no_chunking() -> Ctx:
    """No chunked prefill with a budget (16) below max_model_len (64): run (5 + 12 - 1 = 16 tokens at most)
    fits one step, its prefill is in flight."""
    s = Scheduler(**{**CONFIG, "enable_chunked_prefill": False})
    s.add_request("run", [1, 2, 3, 4, 5], max_tokens=12)
    out = s.schedule()
    return Ctx(s, [(out, [[7]])])


def setup_lookahead() -> Ctx:
    return setup_in_flight(num_lookahead_tokens=2)


def setup_decodes() -> Ctx:
    """run and run2 decoding; the step that schedules one token of each is in flight: a step of plain decodes,
    whose update first tries the one-token-each fast path and must fall back to the checks on bad input."""
    s = Scheduler(**CONFIG)
    s.add_request("run", [1, 2, 3, 4, 5], max_tokens=20)
    s.add_request("run2", [6, 7, 8], max_tokens=20)
    out = s.schedule()
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()
    assert out.req_ids == ["run", "run2"]
    assert out.num_scheduled_tokens.tolist() == [1, 1]
    return Ctx(s, [(out, answer(s, out))])


class LoadWait:
    """A KV connector that loads 4 tokens of "wait" asynchronously and keeps "sent"'s blocks for a send."""

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        return (4, True) if req_id == "wait" else (0, False)

    def update_state_after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def request_finished(self, req_id: str, block_ids: list[int]) -> bool:
        return req_id == "sent"


def setup_connector() -> Ctx:
    """As setup_in_flight with a KV connector: "wait" is loading (WAITING_FOR_REMOTE_KVS), "sent" finished and
    its blocks are held for a send, and run's decode step is in flight."""
    s = Scheduler(**{**CONFIG, "max_num_seqs": 3}, kv_connector=LoadWait())
    s.add_request("run", [1, 2, 3, 4, 5], max_tokens=20)
    s.add_request("sent", [8, 8, 8, 8, 8], max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, [[7], [7]])
    s.add_request("wait", [9, 9, 9, 9, 9, 9], max_tokens=5)
    out = s.schedule()
    assert out.req_ids == ["run"] and s.get_request_status("wait") == kvsched.RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.num_held_kv_requests == 1
    return Ctx(s, [(out, [[7]])])


def kv(**report: Any) -> Callable[[Ctx], Any]:
    return lambda c: c.s.update_kv_transfers(**report)


def setup_encoder() -> Ctx:
    """setup_in_flight with an encoder budget of 8 tokens and an encoder cache of 12."""
    return setup_in_flight(max_num_encoder_input_tokens=8, encoder_cache_size=12)


def add_enc(inputs: Any, prompt_len: int = 20) -> Callable[[Ctx], Any]:
    return lambda c: c.s.add_request("x", list(range(prompt_len)), encoder_inputs=inputs)


def setup_encoder_held() -> Ctx:
    """setup_encoder, then the encoder input of "enc" (hash 5, 8 tokens) is cached and referenced."""
    ctx = setup_encoder()
    s = ctx.s
    out, ans = ctx.pending.pop()
    s.update_from_output(out, ans)
    s.abort_requests(["chunk", "wait"])  # room for "enc" (max_num_seqs=2)
    s.add_request("enc", list(range(12)), max_tokens=5, encoder_inputs=[(2, 8, 5)])
    out = s.schedule()
    assert out.scheduled_encoder_inputs.tolist() == [0]
    ctx.pending.append((out, answer(s, out)))
    return ctx


def setup_spec() -> Ctx:
    """n-gram style speculative decoding: 2 drafts per step, no lookahead slots."""
    return setup_in_flight(num_speculative_tokens=2)


def snapshot(s: Scheduler) -> Any:
    reqs = {}
    for rid in IDS:
        with contextlib.suppress(UnknownRequestError):
            reqs[rid] = (
                s.get_request_status(rid),
                s.get_num_computed_tokens(rid),
                s.get_output_token_ids(rid),
                s.get_block_ids(rid).tolist(),
                s.get_block_hashes(rid),
                s._request_info(rid),
            )
    return (
        s.stats(),
        s.tenant_stats(),
        s.num_free_blocks,
        s.num_unfinished_requests,
        s.has_unfinished_requests(),
        reqs,
    )


def finish_everything(ctx: Ctx) -> None:
    s = ctx.s
    for out, ans in ctx.pending:
        s.update_from_output(out, ans)
        s.check_invariants()
    if s.kv_connector is not None:  # every load and send ends
        loading = [r for r in IDS if r == "wait" and s.get_request_status(r) == 7]
        s.update_kv_transfers(finished_recving=loading, finished_sending=["sent"])
        s.check_invariants()
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.check_invariants()
        s.update_from_output(out, answer(s, out))
        s.check_invariants()
    assert not s.has_unfinished_requests()
    assert s.num_free_blocks == s.config.num_blocks - 1


def bypass(**fields: Any) -> SchedulerConfig:
    """A valid config whose fields are then overwritten, so that only the Rust core's checks see them."""
    cfg = SchedulerConfig(**CONFIG)
    for name, value in fields.items():
        object.__setattr__(cfg, name, value)
    return cfg


def other_scheduler_output() -> Any:
    other = Scheduler(**CONFIG)
    other.add_request("run", [1, 2, 3])
    return other.schedule()


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Ctx], Any]
    exc: type[SchedulerError]
    needle: str
    setup: Callable[[], Ctx] = setup_in_flight
    xfail: str | None = None  # a known bug: the case is expected to fail until it is fixed


def add(**kw: Any) -> Callable[[Ctx], Any]:
    req_id = kw.pop("req_id", "x")
    prompt = kw.pop("prompt", [1, 2, 3])
    return lambda c: c.s.add_request(req_id, prompt, **kw)


def update(sampled: Any, drafts: Any = None) -> Callable[[Ctx], Any]:
    return lambda c: c.s.update_from_output(c.pending[0][0], sampled, drafts)


def weight(tenant: Any, w: Any) -> Callable[[Ctx], Any]:
    return lambda c: c.s.set_tenant_weight(tenant, w)


def prep(**kw: Any) -> Callable[[Ctx], Any]:
    return lambda c: c.s.prepare_model_inputs(c.pending[-1][0], **kw)


def setup_dcp2() -> Ctx:
    return setup_in_flight(dcp_world_size=2)


def costs(recompute: Any, swap: Any) -> Callable[[Ctx], Any]:
    return lambda c: c.s.set_preemption_costs(recompute, swap)


def new(*args: Any, **fields: Any) -> Callable[[Ctx], Any]:
    return lambda c: Scheduler(*args, **fields)


def cfg(**fields: Any) -> Callable[[Ctx], Any]:
    return new(**{**CONFIG, **fields})


ARR = np.array
I64 = np.int64

CASES = [
    # --- add_request -------------------------------------------------------------------------------------
    Case("duplicate-running-id", add(req_id="run"), DuplicateRequestError, "run"),
    Case("duplicate-waiting-id", add(req_id="wait"), DuplicateRequestError, "wait"),
    Case("empty-prompt", add(prompt=[]), InvalidRequestError, "empty"),
    Case("empty-array-prompt", add(prompt=ARR([], I64)), InvalidRequestError, "empty"),
    Case("prompt-equal-to-max-model-len", add(prompt=[1] * 64), InvalidRequestError, "64"),
    Case("prompt-over-max-model-len", add(prompt=[1] * 65), InvalidRequestError, "65"),
    Case("negative-token", add(prompt=[1, -1]), InvalidRequestError, "-1"),
    Case("token-2**31", add(prompt=[1, 2**31]), InvalidRequestError, "2147483648"),
    Case("token-over-int64", add(prompt=[2**64]), InvalidRequestError, "18446744073709551616"),
    Case("negative-token-in-array", add(prompt=ARR([1, -5])), InvalidRequestError, "-5"),
    Case(
        "uint64-token-over-int64",
        add(prompt=ARR([1, 2**63], np.uint64)),
        InvalidRequestError,
        "9223372036854775808",
    ),
    Case("float-token", add(prompt=[1, 1.5]), SchedulerTypeError, "float"),
    Case("numpy-float-token", add(prompt=[1, np.float64(2)]), SchedulerTypeError, "float64"),
    Case("bool-array-prompt", add(prompt=ARR([True, False])), SchedulerTypeError, "bool"),
    Case("bool-token", add(prompt=[1, True]), SchedulerTypeError, "bool"),
    Case("none-token", add(prompt=[1, None]), SchedulerTypeError, "NoneType"),
    Case("str-prompt", add(prompt="hello"), SchedulerTypeError, "str"),
    Case("bytes-prompt", add(prompt=b"hello"), SchedulerTypeError, "bytes"),
    Case("int-prompt", add(prompt=5), SchedulerTypeError, "int"),
    Case("float-array-prompt", add(prompt=ARR([1.0, 2.0])), SchedulerTypeError, "float64"),
    Case("2d-array-prompt", add(prompt=ARR([[1, 2]])), SchedulerTypeError, "2 dimensions"),
    Case("int-id", add(req_id=5), SchedulerTypeError, "int"),
    Case("none-id", add(req_id=None), SchedulerTypeError, "NoneType"),
    Case("bytes-id", add(req_id=b"x"), SchedulerTypeError, "bytes"),
    Case("empty-id", add(req_id=""), InvalidRequestError, "non-empty"),
    Case("max-tokens-0", add(max_tokens=0), InvalidRequestError, "got 0"),
    Case("max-tokens-negative", add(max_tokens=-3), InvalidRequestError, "-3"),
    Case("max-tokens-float", add(max_tokens=2.0), SchedulerTypeError, "float"),
    Case("min-tokens-negative", add(min_tokens=-1), InvalidRequestError, "-1"),
    Case(
        "min-tokens-over-uint32",
        add(min_tokens=2**40),
        InvalidRequestError,
        "1099511627776",
    ),
    Case("min-over-max-tokens", add(min_tokens=5, max_tokens=3), InvalidRequestError, "min_tokens=5"),
    Case("throttle-int", lambda c: c.s.schedule(throttle_prefills=1), SchedulerTypeError, "int"),
    Case("skip-prefix-cache-int", add(skip_reading_prefix_cache=1), SchedulerTypeError, "int"),
    # --- encoder inputs ----------------------------------------------------------------------------------
    Case("encoder-without-cache", add_enc([(0, 4, 1)]), InvalidRequestError, "encoder_cache_size"),
    Case("encoder-empty-input", add_enc([(0, 0, 1)]), InvalidRequestError, "no tokens", setup_encoder),
    Case("encoder-beyond-prompt", add_enc([(16, 5, 1)]), InvalidRequestError, "beyond the prompt", setup_encoder),
    Case("encoder-overlap", add_enc([(0, 4, 1), (3, 4, 2)]), InvalidRequestError, "overlap", setup_encoder),
    Case("encoder-unsorted", add_enc([(8, 2, 1), (0, 2, 2)]), InvalidRequestError, "sorted", setup_encoder),
    Case("encoder-over-budget", add_enc([(0, 9, 1)]), InvalidRequestError, "9 tokens", setup_encoder),
    Case(
        "encoder-over-cache",
        add_enc([(0, 9, 1)]),
        InvalidRequestError,
        "encoder_cache_size=8",
        lambda: setup_in_flight(max_num_encoder_input_tokens=16, encoder_cache_size=8),
    ),
    Case(
        "encoder-unchunked-over-chunk",
        add_enc([(0, 17, 1)]),
        InvalidRequestError,
        "disable_chunked_mm_input",
        lambda: setup_in_flight(max_num_encoder_input_tokens=20, encoder_cache_size=20, disable_chunked_mm_input=True),
    ),
    Case("encoder-same-hash-two-sizes", add_enc([(0, 2, 1), (4, 3, 1)]), InvalidRequestError, "hash 1", setup_encoder),
    Case("encoder-hash-cached-other-size", add_enc([(0, 3, 5)]), InvalidRequestError, "hash 5", setup_encoder_held),
    Case("encoder-negative-start", add_enc([(-1, 2, 1)]), InvalidRequestError, "-1", setup_encoder),
    Case("encoder-negative-hash", add_enc([(0, 2, -1)]), InvalidRequestError, "-1", setup_encoder),
    Case("encoder-hash-2**64", add_enc([(0, 2, 2**64)]), InvalidRequestError, "18446744073709551616", setup_encoder),
    Case("encoder-float-hash", add_enc([(0, 2, 1.0)]), SchedulerTypeError, "float", setup_encoder),
    Case("encoder-bool-start", add_enc([(True, 2, 1)]), SchedulerTypeError, "bool", setup_encoder),
    Case("encoder-pair", add_enc([(0, 2)]), SchedulerTypeError, "triple", setup_encoder),
    Case("encoder-not-a-list", add_enc(5), SchedulerTypeError, "int", setup_encoder),
    Case("encoder-a-set", add_enc({(0, 2, 1)}), SchedulerTypeError, "set", setup_encoder),
    Case("encoder-a-str", add_enc("abc"), SchedulerTypeError, "str", setup_encoder),
    Case("encoder-2-column-array", add_enc(ARR([[0, 2]])), SchedulerTypeError, "triple", setup_encoder),
    Case("encoder-negative-budget", cfg(max_num_encoder_input_tokens=-1), InvalidConfigError, "-1"),
    Case("encoder-float-cache-size", cfg(encoder_cache_size=8.0), InvalidConfigError, "float"),
    Case("encoder-int-chunk-flag", cfg(disable_chunked_mm_input=1), InvalidConfigError, "1"),
    Case("core-encoder-cache-size", new(bypass(encoder_cache_size=-3)), InvalidConfigError, "-3"),
    # A KV cache (11 usable blocks of 4 = 44 tokens) or, without chunked prefill, a budget (16) below
    # max_model_len (64): accepted by the config, as vLLM's scheduler does; a request that could never fit is not.
    Case(
        "longer-than-the-kv-cache",
        add(prompt=[1] * 30, max_tokens=16),
        InvalidRequestError,
        "= 45 tokens do not fit the KV cache",
        setup=lambda: setup_in_flight(num_blocks=12),
    ),
    Case(
        "unbounded-max-tokens-beyond-the-kv-cache",
        add(),
        InvalidRequestError,
        "do not fit the KV cache",
        setup=lambda: setup_in_flight(num_blocks=12),
    ),
    Case(
        "longer-than-the-budget-without-chunking",
        add(max_tokens=15),
        InvalidRequestError,
        "max_num_batched_tokens=16",
        setup=lambda: setup_no_chunking(),
    ),
    Case(
        "min-over-effective-max-tokens",
        add(prompt=[1] * 60, min_tokens=5),
        InvalidRequestError,
        "min_tokens=5",
    ),
    Case("nan-arrival-time", add(arrival_time=math.nan), InvalidRequestError, "NaN"),
    Case("inf-arrival-time", add(arrival_time=math.inf), InvalidRequestError, "inf"),
    Case("str-arrival-time", add(arrival_time="now"), SchedulerTypeError, "str"),
    Case("bool-arrival-time", add(arrival_time=True), SchedulerTypeError, "bool"),
    Case("negative-stop-token", add(stop_token_ids=[3, -2]), InvalidRequestError, "-2"),
    Case("stop-token-2**31", add(stop_token_ids=[2**31]), InvalidRequestError, "2147483648"),
    Case("str-stop-token", add(stop_token_ids=["a"]), SchedulerTypeError, "str"),
    Case("int-stop-token-ids", add(stop_token_ids=3), SchedulerTypeError, "int"),
    Case("negative-eos", add(eos_token_id=-1), InvalidRequestError, "-1"),
    Case("float-eos", add(eos_token_id=1.0), SchedulerTypeError, "float"),
    Case("str-ignore-eos", add(ignore_eos="yes"), SchedulerTypeError, "str"),
    Case("priority-over-int64", add(priority=2**63), InvalidRequestError, "9223372036854775808"),
    Case("float-priority", add(priority=0.5), SchedulerTypeError, "float"),
    Case("int-cache-salt", add(cache_salt=5), SchedulerTypeError, "int"),
    Case("bytes-lora-name", add(lora_name=b"l"), SchedulerTypeError, "bytes"),
    Case("empty-tenant", add(tenant=""), InvalidRequestError, "non-empty"),
    Case("int-tenant", add(tenant=5), SchedulerTypeError, "int"),
    Case("bytes-tenant", add(tenant=b"t"), SchedulerTypeError, "bytes"),
    Case("surrogate-tenant", add(tenant="\ud800"), InvalidRequestError, "unicode"),
    # --- the ordering keywords: session_id, ttft_slo_s, order_key ----------------------------------------------
    Case("int-session-id", add(session_id=5), SchedulerTypeError, "session_id"),
    Case("bytes-session-id", add(session_id=b"s"), SchedulerTypeError, "session_id"),
    Case("empty-session-id", add(session_id=""), InvalidRequestError, "session_id"),
    Case("surrogate-session-id", add(session_id="\ud800"), InvalidRequestError, "session_id"),
    Case("zero-ttft-slo", add(ttft_slo_s=0), InvalidRequestError, "ttft_slo_s"),
    Case("negative-ttft-slo", add(ttft_slo_s=-1.5), InvalidRequestError, "ttft_slo_s"),
    Case("nan-ttft-slo", add(ttft_slo_s=math.nan), InvalidRequestError, "ttft_slo_s"),
    Case("inf-ttft-slo", add(ttft_slo_s=math.inf), InvalidRequestError, "ttft_slo_s"),
    Case("huge-int-ttft-slo", add(ttft_slo_s=10**400), InvalidRequestError, "ttft_slo_s"),
    Case("str-ttft-slo", add(ttft_slo_s="1"), SchedulerTypeError, "ttft_slo_s"),
    Case("bool-ttft-slo", add(ttft_slo_s=True), SchedulerTypeError, "ttft_slo_s"),
    Case("float-order-key", add(order_key=1.5), SchedulerTypeError, "order_key"),
    Case("bool-order-key", add(order_key=True), SchedulerTypeError, "order_key"),
    Case("str-order-key", add(order_key="1"), SchedulerTypeError, "order_key"),
    Case("huge-order-key", add(order_key=2**63), InvalidRequestError, "order_key"),
    Case("tiny-order-key", add(order_key=-(2**63) - 1), InvalidRequestError, "order_key"),
    # --- set_tenant_weight -------------------------------------------------------------------------------
    Case("zero-weight", weight("t", 0.0), InvalidRequestError, "got 0"),
    Case("negative-weight", weight("default", -2.5), InvalidRequestError, "-2.5"),
    Case("nan-weight", weight("t", math.nan), InvalidRequestError, "nan"),
    Case("inf-weight", weight("t", math.inf), InvalidRequestError, "inf"),
    Case("huge-int-weight", weight("t", 10**400), InvalidRequestError, "inf"),
    Case("bool-weight", weight("t", True), SchedulerTypeError, "bool"),
    Case("str-weight", weight("t", "2"), SchedulerTypeError, "str"),
    Case("empty-tenant-weight", weight("", 1.0), InvalidRequestError, "non-empty"),
    Case("none-tenant-weight", weight(None, 1.0), SchedulerTypeError, "NoneType"),
    # --- set_preemption_costs ----------------------------------------------------------------------------
    Case("negative-recompute-cost", costs(-1.0, 1.0), InvalidRequestError, "-1"),
    Case("nan-swap-cost", costs(1.0, math.nan), InvalidRequestError, "nan"),
    Case("inf-recompute-cost", costs(math.inf, 1.0), InvalidRequestError, "inf"),
    Case("huge-int-swap-cost", costs(1.0, 10**400), InvalidRequestError, "inf"),
    Case("bool-swap-cost", costs(1.0, True), SchedulerTypeError, "bool"),
    Case("str-recompute-cost", costs("1", 1.0), SchedulerTypeError, "str"),
    Case("none-swap-cost", costs(1.0, None), SchedulerTypeError, "NoneType"),
    Case("cpu-blocks-of-unknown", lambda c: c.s.get_cpu_block_ids("zz"), UnknownRequestError, "zz"),
    # --- update_from_output: the form of the tokens ------------------------------------------------------
    Case("float-values", update((ARR([1.0]), ARR([0, 1, 1]))), SchedulerTypeError, "float64"),
    Case("2d-values", update((ARR([[1]]), ARR([0, 1, 1]))), SchedulerTypeError, "2 dimensions"),
    Case("float-indptr", update((ARR([1]), ARR([0.0, 1.0, 1.0]))), SchedulerTypeError, "float64"),
    Case("indptr-too-short", update((ARR([1]), ARR([0, 1]))), InvalidOutputError, "got 2"),
    Case("indptr-too-long", update((ARR([1]), ARR([0, 1, 1, 1]))), InvalidOutputError, "got 4"),
    Case("indptr-not-from-0", update((ARR([1]), ARR([1, 1, 1]))), InvalidOutputError, "got 1"),
    Case("indptr-decreasing", update((ARR([1, 2]), ARR([0, 2, 1]))), InvalidOutputError, "non-decreasing"),
    Case("indptr-misaligned", update((ARR([1, 2]), ARR([0, 1, 1]))), InvalidOutputError, "2 values"),
    Case("tuple-of-three", update((ARR([1]), ARR([0, 1, 1]), ARR([0]))), SchedulerTypeError, "tuple"),
    Case("tuple-of-lists", update(([1], [0, 1, 1])), SchedulerTypeError, "tuple"),
    Case("str-tokens", update("7"), SchedulerTypeError, "str"),
    Case("dict-tokens", update({"run": [7]}), SchedulerTypeError, "dict"),
    Case("list-too-short", update([[7]]), InvalidOutputError, "got 2"),
    Case("list-too-long", update([[7], [], []]), InvalidOutputError, "got 4"),
    Case("float-in-list", update([[7.0], []]), SchedulerTypeError, "float"),
    Case("none-entry", update([None, []]), SchedulerTypeError, "NoneType"),
    Case("bool-in-list", update([[True], []]), SchedulerTypeError, "bool"),
    Case("bool-in-tuple-row", update([(True,), []]), SchedulerTypeError, "bool"),
    Case("bool-after-a-good-row", update([[7], [False]]), SchedulerTypeError, "sampled_token_ids[1]"),
    Case("negative-numpy-int-in-list", update([[np.int64(-1)], []]), InvalidOutputError, "-1"),
    Case("sampled-token-2**63", update([[2**63], []]), InvalidOutputError, "9223372036854775808"),
    Case("negative-sampled-token", update([[-1], []]), InvalidOutputError, "-1"),
    Case("sampled-token-2**31", update([[2**31], []]), InvalidOutputError, "2147483648"),
    Case(
        "sampled-token-over-int64",
        update([[2**64], []]),
        InvalidOutputError,
        "18446744073709551616",
    ),
    # --- update_from_output on a step of plain decodes (its one-token-each fast path falls back) --------------
    Case("decodes-negative-token", update((ARR([-1, 7]), ARR([0, 1, 2]))), InvalidOutputError, "-1", setup_decodes),
    Case(
        "decodes-token-2**31",
        update((ARR([7, 2**31]), ARR([0, 1, 2]))),
        InvalidOutputError,
        "2147483648",
        setup_decodes,
    ),
    Case("decodes-indptr-short", update((ARR([7, 8]), ARR([0, 1]))), InvalidOutputError, "got 2", setup_decodes),
    Case(
        "decodes-values-long", update((ARR([7, 8, 9]), ARR([0, 1, 2]))), InvalidOutputError, "3 values", setup_decodes
    ),
    Case("decodes-drafts", update([[7], [7]], [[1], []]), InvalidOutputError, "at most 0", setup_decodes),
    # --- update_from_output: what the tokens answer -------------------------------------------------------
    Case("drafts-without-lookahead", update([[7], []], [[1], []]), InvalidOutputError, "at most 0"),
    Case(
        "too-many-drafts",
        update([[7], []], [[1, 2, 3], []]),
        InvalidOutputError,
        "got 3",
        setup_lookahead,
    ),
    Case(
        "drafts-for-a-partial-prefill",
        update([[7], []], [[1], [2]]),
        InvalidOutputError,
        "chunk",
        setup_lookahead,
    ),
    Case("negative-draft", update([[7], []], [[-4], []]), InvalidOutputError, "-4", setup_lookahead),
    Case("bool-draft", update([[7], []], [[True], []]), SchedulerTypeError, "bool", setup_lookahead),
    Case("drafts-misaligned", update([[7], []], [[1]]), InvalidOutputError, "got 2", setup_lookahead),
    Case(
        "applied-twice",
        lambda c: c.s.update_from_output(c.applied, [[7], []]),
        InvalidOutputError,
        "already applied",
        setup_applied,
    ),
    Case(
        "out-of-order",
        lambda c: c.s.update_from_output(c.pending[1][0], c.pending[1][1]),
        InvalidOutputError,
        "in order",
        setup_two_in_flight,
    ),
    Case(
        "another-schedulers-output",
        lambda c: c.s.update_from_output(other_scheduler_output(), [[7]]),
        InvalidOutputError,
        "another scheduler",
    ),
    Case("fail-applied-step", lambda c: c.s.fail_step(c.applied), InvalidOutputError, "already applied", setup_applied),
    Case(
        "fail-step-with-a-later-step-in-flight",
        lambda c: c.s.fail_step(c.pending[0][0]),
        InvalidOutputError,
        "only step in flight",
        setup_two_in_flight,
    ),
    Case(
        "fail-a-later-step-first",
        lambda c: c.s.fail_step(c.pending[1][0]),
        InvalidOutputError,
        "apply or fail it first",
        setup_two_in_flight,
    ),
    Case(
        "fail-another-schedulers-step",
        lambda c: c.s.fail_step(other_scheduler_output()),
        InvalidOutputError,
        "another scheduler",
    ),
    Case("fail-not-an-output", lambda c: c.s.fail_step("out"), SchedulerTypeError, "str"),
    Case("not-a-scheduler-output", lambda c: c.s.update_from_output("out", [[7]]), SchedulerTypeError, "str"),
    Case("none-output", lambda c: c.s.update_from_output(None, []), SchedulerTypeError, "NoneType"),
    Case(
        "prepare-not-a-scheduler-output",
        lambda c: c.s.prepare_model_inputs(object()),
        SchedulerTypeError,
        "object",
    ),
    Case(
        "prepare-stale-output",
        lambda c: c.s.prepare_model_inputs(c.applied),
        InvalidOutputError,
        "step 1",
        setup_applied,
    ),
    Case(
        "prepare-another-schedulers-output",
        lambda c: c.s.prepare_model_inputs(other_scheduler_output()),
        InvalidOutputError,
        "another scheduler",
    ),
    # --- prepare_model_inputs(out, dcp_rank=...) under decode context parallelism ------------------------
    Case("prepare-dcp-rank-too-big", prep(dcp_rank=2), InvalidRequestError, "got 2", setup_dcp2),
    Case("prepare-dcp-rank-without-dcp", prep(dcp_rank=1), InvalidRequestError, "dcp_world_size=1"),
    Case("prepare-dcp-rank-negative", prep(dcp_rank=-1), InvalidRequestError, "-1", setup_dcp2),
    Case("prepare-dcp-rank-str", prep(dcp_rank="0"), SchedulerTypeError, "str", setup_dcp2),
    Case("prepare-dcp-rank-bool", prep(dcp_rank=True), SchedulerTypeError, "bool", setup_dcp2),
    Case("prepare-dcp-rank-huge", prep(dcp_rank=2**40), InvalidRequestError, str(2**40), setup_dcp2),
    # --- unknown ids and abort ---------------------------------------------------------------------------
    Case("abort-unknown", lambda c: c.s.abort_requests(["nope"]), UnknownRequestError, "nope"),
    Case(
        "abort-known-and-unknown",
        lambda c: c.s.abort_requests(["run", "wait", "nope"]),
        UnknownRequestError,
        "nope",
    ),
    Case("abort-a-single-string", lambda c: c.s.abort_requests("run"), SchedulerTypeError, "single str"),
    Case("abort-an-int", lambda c: c.s.abort_requests(5), SchedulerTypeError, "int"),
    Case("abort-int-ids", lambda c: c.s.abort_requests(["run", 5]), SchedulerTypeError, "int"),
    Case("abort-finished", lambda c: c.s.abort_requests(["gone"]), UnknownRequestError, "gone", setup_gone),
    Case("status-of-finished", lambda c: c.s.get_request_status("gone"), UnknownRequestError, "gone", setup_gone),
    Case("get-block-ids-unknown", lambda c: c.s.get_block_ids("nope"), UnknownRequestError, "nope"),
    Case("get-block-hashes-unknown", lambda c: c.s.get_block_hashes("nope"), UnknownRequestError, "nope"),
    Case("get-status-unknown", lambda c: c.s.get_request_status("nope"), UnknownRequestError, "nope"),
    Case("get-computed-unknown", lambda c: c.s.get_num_computed_tokens("nope"), UnknownRequestError, "nope"),
    Case("get-outputs-unknown", lambda c: c.s.get_output_token_ids("nope"), UnknownRequestError, "nope"),
    Case("request-info-unknown", lambda c: c.s._request_info("nope"), UnknownRequestError, "nope"),
    Case("get-status-int-id", lambda c: c.s.get_request_status(3), SchedulerTypeError, "int"),
    Case("probe-negative-token", lambda c: c.s.get_num_cached_tokens([1, -1]), InvalidRequestError, "-1"),
    # --- pause states, grammar wait, placeholders, forced reset, async drafts --------------------------------
    Case("pause-unknown-state", lambda c: c.s.set_pause_state("paused"), InvalidRequestError, "paused"),
    Case("pause-int-state", lambda c: c.s.set_pause_state(2), SchedulerTypeError, "int"),
    Case("set-ready-unknown", lambda c: c.s.set_ready("nope"), UnknownRequestError, "nope"),
    Case("set-ready-int-id", lambda c: c.s.set_ready(3), SchedulerTypeError, "int"),
    Case("placeholders-unknown", lambda c: c.s.get_num_output_placeholders("nope"), UnknownRequestError, "nope"),
    Case("reset-running-str", lambda c: c.s.reset_prefix_cache("yes"), SchedulerTypeError, "str"),
    Case("add-ready-int", lambda c: c.s.add_request("y", [1], ready=1), SchedulerTypeError, "int"),
    Case(
        "async-drafts-refused",
        lambda c: c.s.update_from_output(c.pending[0][0], c.pending[0][1], [[1]]),
        InvalidOutputError,
        "async_scheduling",
        lambda: setup_async(),
    ),
    # --- set_draft_token_ids (vLLM's update_draft_token_ids) --------------------------------------------
    Case(
        "set-drafts-unknown-id",
        lambda c: c.s.set_draft_token_ids(["run", "nope"], [[1], [2]]),
        UnknownRequestError,
        "nope",
        setup_spec,
    ),
    Case(
        "set-drafts-finished-id",
        lambda c: c.s.set_draft_token_ids(["gone"], [[1]]),
        UnknownRequestError,
        "gone",
        setup_gone,
    ),
    Case(
        "set-drafts-too-many",
        lambda c: c.s.set_draft_token_ids(["run"], [[1, 2, 3]]),
        InvalidOutputError,
        "num_spec_tokens=2",
        setup_spec,
    ),
    Case(
        "set-drafts-without-spec-decoding",
        lambda c: c.s.set_draft_token_ids(["run"], [[1]]),
        InvalidOutputError,
        "num_spec_tokens=0",
    ),
    Case(
        "set-drafts-below-minus-one",
        lambda c: c.s.set_draft_token_ids(["run"], [[5, -2]]),
        InvalidOutputError,
        "-2",
        setup_spec,
    ),
    Case(
        "set-drafts-out-of-range",
        lambda c: c.s.set_draft_token_ids(["run"], [[2**31]]),
        InvalidOutputError,
        "2147483648",
        setup_spec,
    ),
    Case(
        "set-drafts-misaligned",
        lambda c: c.s.set_draft_token_ids(["run", "chunk"], [[1]]),
        InvalidOutputError,
        "draft_token_ids",
        setup_spec,
    ),
    Case(
        "set-drafts-single-str",
        lambda c: c.s.set_draft_token_ids("run", [[1]]),
        SchedulerTypeError,
        "single str",
        setup_spec,
    ),
    Case("set-drafts-int-id", lambda c: c.s.set_draft_token_ids([3], [[1]]), SchedulerTypeError, "int", setup_spec),
    Case("set-drafts-not-lists", lambda c: c.s.set_draft_token_ids(["run"], 5), SchedulerTypeError, "int", setup_spec),
    Case(
        "set-drafts-later-entry-bad",
        lambda c: c.s.set_draft_token_ids(["run", "wait"], [[4, 5], [1, 2, 3]]),
        InvalidOutputError,
        "wait",
        setup_spec,
    ),
    Case("probe-str", lambda c: c.s.get_num_cached_tokens("abc"), SchedulerTypeError, "str"),
    # --- KV connector: update_kv_transfers, the connector object ------------------------------------------
    Case("kv-recv-unknown", kv(finished_recving=["nope"]), UnknownRequestError, "nope", setup_connector),
    Case("kv-recv-not-loading", kv(finished_recving=["run"]), InvalidRequestError, "run", setup_connector),
    Case("kv-recv-one-bad-of-two", kv(finished_recving=["wait", "nope"]), UnknownRequestError, "nope", setup_connector),
    Case("kv-failed-not-loading", kv(failed_recving=["run"]), InvalidRequestError, "run", setup_connector),
    Case("kv-send-running", kv(finished_sending=["run"]), InvalidRequestError, "run", setup_connector),
    Case("kv-send-loading", kv(finished_sending=["wait"]), InvalidRequestError, "wait", setup_connector),
    Case("kv-send-unknown", kv(finished_sending=["nope"]), UnknownRequestError, "nope", setup_connector),
    Case("kv-recv-of-a-send", kv(finished_recving=["sent"]), InvalidRequestError, "sent", setup_connector),
    Case("kv-invalid-block-0", kv(invalid_block_ids=[0]), InvalidRequestError, "got 0", setup_connector),
    Case("kv-invalid-block-too-big", kv(invalid_block_ids=[64]), InvalidRequestError, "64", setup_connector),
    Case("kv-invalid-block-str", kv(invalid_block_ids=["1"]), SchedulerTypeError, "str", setup_connector),
    Case("kv-invalid-block-bool", kv(invalid_block_ids=[True]), SchedulerTypeError, "bool", setup_connector),
    Case("kv-recv-a-str", kv(finished_recving="wait"), SchedulerTypeError, "str", setup_connector),
    Case("kv-recv-int-ids", kv(finished_recving=[3]), SchedulerTypeError, "int", setup_connector),
    Case("kv-recv-without-connector", kv(finished_recving=["wait"]), InvalidRequestError, "wait"),
    Case("kv-add-held-id", add(req_id="sent"), DuplicateRequestError, "sent", setup_connector),
    Case("kv-abort-held-id", lambda c: c.s.abort_requests(["sent"]), UnknownRequestError, "sent", setup_connector),
    Case(
        "kv-connector-without-hooks",
        new(SchedulerConfig(**CONFIG), kv_connector=object()),
        SchedulerTypeError,
        "get_num_new_matched_tokens",
    ),
    Case("config-kv-load-failure-policy", cfg(kv_load_failure_policy="retry"), InvalidConfigError, "'retry'"),
    Case("core-kv-load-failure-policy", new(bypass(kv_load_failure_policy="retry")), InvalidConfigError, "retry"),
    # --- configs (the Python checks) ---------------------------------------------------------------------
    Case("config-block-size-0", cfg(block_size=0), InvalidConfigError, "got 0"),
    Case("config-dcp-0", cfg(dcp_world_size=0), InvalidConfigError, "got 0"),
    Case("config-block-size-4097", cfg(block_size=4097), InvalidConfigError, "4097"),
    Case("config-dcp-too-big", cfg(dcp_world_size=2048), InvalidConfigError, "2048"),
    Case("config-dcp-str", cfg(dcp_world_size="2"), InvalidConfigError, "'2'"),
    Case("config-dcp-bool", cfg(dcp_world_size=True), InvalidConfigError, "True"),
    Case("config-pcp-0", cfg(pcp_world_size=0), InvalidConfigError, "got 0"),
    Case("config-pcp-float", cfg(pcp_world_size=2.0), InvalidConfigError, "2.0"),
    Case("config-dcp-not-multiple-of-pcp", cfg(dcp_world_size=4, pcp_world_size=3), InvalidConfigError, "multiple"),
    Case(
        "config-dcp-positions-overflow",
        cfg(num_blocks=2**24, block_size=64, dcp_world_size=4),
        InvalidConfigError,
        "int32",
    ),
    Case("config-cp-interleave-over-block-size", cfg(cp_kv_cache_interleave_size=8), InvalidConfigError, "[1, 4]"),
    Case("config-cp-interleave-0", cfg(cp_kv_cache_interleave_size=0), InvalidConfigError, "got 0"),
    Case("config-block-size-too-big", cfg(block_size=8192), InvalidConfigError, "8192"),
    Case("config-block-size-str", cfg(block_size="16"), InvalidConfigError, "'16'"),
    Case("config-num-blocks-1", cfg(num_blocks=1), InvalidConfigError, "got 1"),
    Case("config-max-num-seqs-0", cfg(max_num_seqs=0), InvalidConfigError, "got 0"),
    Case("config-active-over-max-num-seqs", cfg(max_num_active_seqs=3), InvalidConfigError, "[1, 2], got 3"),
    Case("config-active-0", cfg(max_num_active_seqs=0), InvalidConfigError, "got 0"),
    Case("config-active-str", cfg(max_num_active_seqs="1"), InvalidConfigError, "'1'"),
    Case("config-interval-0", cfg(prefill_schedule_interval=0), InvalidConfigError, "got 0"),
    Case("config-int-adaptive-flag", cfg(long_prefill_token_threshold_adaptive=1), InvalidConfigError, "1"),
    Case("config-int-park-grammar-waits", cfg(park_grammar_waits=0), InvalidConfigError, "park_grammar_waits"),
    Case("config-int-park-kv-loads", cfg(park_kv_loads=1), InvalidConfigError, "park_kv_loads"),
    Case("config-int-reserve-inflight", cfg(reserve_inflight_prefills=1), InvalidConfigError, "reserve_inflight"),
    Case("config-int-divergent-hits", cfg(divergent_local_hits=1), InvalidConfigError, "divergent_local_hits"),
    Case("config-max-model-len-1", cfg(max_model_len=1), InvalidConfigError, "got 1"),
    Case("config-unknown-policy", cfg(policy="lifo"), InvalidConfigError, "'lifo'"),
    Case("config-unknown-hash-algo", cfg(prefix_hash_algo="md5"), InvalidConfigError, "'md5'"),
    Case("config-float-seed", cfg(prefix_hash_seed=1.5), InvalidConfigError, "1.5"),
    Case("config-bool-seed", cfg(prefix_hash_seed=True), InvalidConfigError, "True"),
    Case("config-negative-threshold", cfg(long_prefill_token_threshold=-1), InvalidConfigError, "got -1"),
    Case("config-negative-lookahead", cfg(num_lookahead_tokens=-1), InvalidConfigError, "got -1"),
    Case("config-negative-spec-tokens", cfg(num_speculative_tokens=-1), InvalidConfigError, "got -1"),
    Case("config-too-many-spec-tokens", cfg(num_speculative_tokens=1025), InvalidConfigError, "1025"),
    Case("config-float-spec-tokens", cfg(num_speculative_tokens=2.0), InvalidConfigError, "2.0"),
    Case("config-int-caching-flag", cfg(enable_prefix_caching=1), InvalidConfigError, "1"),
    Case("config-str-full-isl-flag", cfg(scheduler_reserve_full_isl="yes"), InvalidConfigError, "'yes'"),
    Case("config-int-async-flag", cfg(async_scheduling=1), InvalidConfigError, "1"),
    Case("config-negative-max-loras", cfg(max_loras=-1), InvalidConfigError, "got -1"),
    Case("config-watermark-1", cfg(watermark=1.0), InvalidConfigError, "1.0"),
    Case("config-watermark-str", cfg(watermark="0.1"), InvalidConfigError, "'0.1'"),
    Case("config-watermark-nan", cfg(watermark=float("nan")), InvalidConfigError, "nan"),
    Case(
        "config-object-and-fields",
        new(SchedulerConfig(), block_size=4),
        SchedulerTypeError,
        "not both",
    ),
    Case("config-a-dict", new({"block_size": 4}), SchedulerTypeError, "dict"),
    # --- admission, fairness and aging fields ------------------------------------------------------------
    Case("unknown-policy", cfg(policy="fai"), InvalidConfigError, "fai"),
    Case("negative-window", cfg(cache_aware_admission_window=-1), InvalidConfigError, "-1"),
    Case("float-window", cfg(cache_aware_admission_window=2.0), InvalidConfigError, "float"),
    Case("window-with-priority", cfg(cache_aware_admission_window=4, policy="priority"), InvalidConfigError, "fcfs"),
    Case("window-with-fair", cfg(cache_aware_admission_window=4, policy="fair"), InvalidConfigError, "fcfs"),
    Case("threshold-over-1", cfg(cache_aware_admission_threshold=1.5), InvalidConfigError, "1.5"),
    Case("negative-threshold", cfg(cache_aware_admission_threshold=-0.1), InvalidConfigError, "-0.1"),
    Case("nan-threshold", cfg(cache_aware_admission_threshold=math.nan), InvalidConfigError, "nan"),
    Case("str-threshold", cfg(cache_aware_admission_threshold="0.5"), InvalidConfigError, "'0.5'"),
    Case("slo-zero-default-slo", cfg(policy="slo", default_ttft_slo_s=0.0), InvalidConfigError, "default_ttft_slo_s"),
    Case("nan-default-slo", cfg(default_ttft_slo_s=math.nan), InvalidConfigError, "default_ttft_slo_s"),
    Case("str-default-slo", cfg(default_ttft_slo_s="1"), InvalidConfigError, "default_ttft_slo_s"),
    Case("zero-max-wait", cfg(max_wait_steps=0), InvalidConfigError, "max_wait_steps"),
    Case("float-max-wait", cfg(max_wait_steps=2.0), InvalidConfigError, "max_wait_steps"),
    Case("zero-session-ttl", cfg(session_ttl_steps=0), InvalidConfigError, "session_ttl_steps"),
    Case("window-with-sjf", cfg(policy="sjf", cache_aware_admission_window=4), InvalidConfigError, "fcfs"),
    Case("zero-tenant-weight", cfg(tenant_weights={"a": 0}), InvalidConfigError, "got 0"),
    Case("negative-tenant-weight", cfg(tenant_weights={"a": -1.0}), InvalidConfigError, "-1.0"),
    Case("inf-tenant-weight", cfg(tenant_weights={"a": math.inf}), InvalidConfigError, "inf"),
    Case("empty-tenant-name", cfg(tenant_weights={"": 1.0}), InvalidConfigError, "non-empty"),
    Case("int-tenant-name", cfg(tenant_weights={3: 1.0}), InvalidConfigError, "int"),
    Case("str-tenant-weight", cfg(tenant_weights={"a": "x"}), InvalidConfigError, "str"),
    Case("tenant-weights-a-list", cfg(tenant_weights=[("a", 1.0)]), InvalidConfigError, "mapping"),
    Case("negative-decode-weight", cfg(fair_decode_weight=-1), InvalidConfigError, "-1"),
    Case("inf-prefill-weight", cfg(fair_prefill_weight=math.inf), InvalidConfigError, "inf"),
    Case("bool-decode-weight", cfg(fair_decode_weight=True), InvalidConfigError, "True"),
    Case("negative-aging", cfg(priority_aging_steps=-1, policy="priority"), InvalidConfigError, "-1"),
    Case("aging-with-fcfs", cfg(priority_aging_steps=3), InvalidConfigError, "priority"),
    Case("aging-with-fair", cfg(priority_aging_steps=3, policy="fair"), InvalidConfigError, "priority"),
    # --- preemption mode, CPU pool and cost fields -------------------------------------------------------
    Case("unknown-preemption-mode", cfg(preemption_mode="discard"), InvalidConfigError, "'discard'"),
    Case("swap-without-cpu-pool", cfg(preemption_mode="swap"), InvalidConfigError, "num_cpu_blocks"),
    Case("auto-without-cpu-pool", cfg(preemption_mode="auto"), InvalidConfigError, "num_cpu_blocks"),
    Case("negative-cpu-blocks", cfg(num_cpu_blocks=-1), InvalidConfigError, "got -1"),
    Case("float-cpu-blocks", cfg(num_cpu_blocks=4.0), InvalidConfigError, "float"),
    Case("huge-cpu-blocks", cfg(num_cpu_blocks=2**25), InvalidConfigError, str(2**25)),
    Case("negative-swap-cost", cfg(swap_cost_per_block=-0.5), InvalidConfigError, "-0.5"),
    Case("nan-recompute-cost-config", cfg(recompute_cost_per_token=math.nan), InvalidConfigError, "nan"),
    Case("bool-swap-cost-config", cfg(swap_cost_per_block=False), InvalidConfigError, "bool"),
    # --- configs that only the Rust core sees ------------------------------------------------------------
    Case("core-block-size-too-big", new(bypass(block_size=4097)), InvalidConfigError, "got 4097"),
    Case("core-dcp-0", new(bypass(dcp_world_size=0)), InvalidConfigError, "dcp_world_size"),
    Case("core-dcp-too-big", new(bypass(dcp_world_size=1025)), InvalidConfigError, "got 1025"),
    Case("core-dcp-negative", new(bypass(dcp_world_size=-2)), InvalidConfigError, "dcp_world_size"),
    Case("core-dcp-str", new(bypass(dcp_world_size="2")), SchedulerTypeError, "str"),
    Case("core-pcp-0", new(bypass(pcp_world_size=0)), InvalidConfigError, "pcp_world_size"),
    Case("core-pcp-too-big", new(bypass(pcp_world_size=4096)), InvalidConfigError, "4096"),
    Case(
        "core-dcp-not-multiple-of-pcp", new(bypass(dcp_world_size=2, pcp_world_size=4)), InvalidConfigError, "multiple"
    ),
    Case("core-cp-interleave-3", new(bypass(cp_kv_cache_interleave_size=3)), InvalidConfigError, "divide"),
    Case("core-cp-interleave-0", new(bypass(cp_kv_cache_interleave_size=0)), InvalidConfigError, "got 0"),
    Case(
        "core-dcp-positions-overflow",
        new(bypass(num_blocks=2**24, block_size=64, dcp_world_size=4)),
        InvalidConfigError,
        "int32 positions",
    ),
    Case("core-num-blocks-1", new(bypass(num_blocks=1)), InvalidConfigError, "got 1"),
    Case("core-policy", new(bypass(policy="lifo")), InvalidConfigError, "lifo"),
    Case("core-hash-algo", new(bypass(prefix_hash_algo="md5")), InvalidConfigError, "md5"),
    Case("core-seed", new(bypass(prefix_hash_seed=1.5)), InvalidConfigError, "float"),
    Case("core-negative-threshold", new(bypass(long_prefill_token_threshold=-1)), InvalidConfigError, "-1"),
    Case("core-bool-block-size", new(bypass(block_size=True)), SchedulerTypeError, "bool"),
    Case("core-int-full-isl-flag", new(bypass(scheduler_reserve_full_isl=1)), InvalidConfigError, "1"),
    Case("core-watermark-1", new(bypass(watermark=1.0)), InvalidConfigError, "watermark"),
    Case("core-watermark-bool", new(bypass(watermark=True)), InvalidConfigError, "watermark"),
    Case("core-negative-max-loras", new(bypass(max_loras=-1)), InvalidConfigError, "-1"),
    Case("core-too-many-spec-tokens", new(bypass(num_speculative_tokens=2000)), InvalidConfigError, "2000"),
    Case("core-str-spec-tokens", new(bypass(num_speculative_tokens="2")), SchedulerTypeError, "str"),
    Case(
        "core-window-with-fair", new(bypass(cache_aware_admission_window=4, policy="fair")), InvalidConfigError, "fcfs"
    ),
    Case("core-threshold", new(bypass(cache_aware_admission_threshold=2.0)), InvalidConfigError, "got 2"),
    Case("core-nan-threshold", new(bypass(cache_aware_admission_threshold=math.nan)), InvalidConfigError, "nan"),
    Case("core-str-threshold", new(bypass(cache_aware_admission_threshold="x")), InvalidConfigError, "x"),
    Case("core-tenant-weight", new(bypass(tenant_weights={"a": -1.0})), InvalidConfigError, "got -1"),
    Case("core-default-slo", new(bypass(default_ttft_slo_s=-2.0)), InvalidConfigError, "default_ttft_slo_s"),
    Case("core-default-slo-type", new(bypass(default_ttft_slo_s="x")), InvalidConfigError, "default_ttft_slo_s"),
    Case("core-max-wait", new(bypass(max_wait_steps=0)), InvalidConfigError, "max_wait_steps"),
    Case("core-session-ttl", new(bypass(session_ttl_steps=0)), InvalidConfigError, "session_ttl_steps"),
    Case("core-policy-names-the-orders", new(bypass(policy="edf")), InvalidConfigError, "'sjf', 'slo'"),
    Case("core-tenant-weight-type", new(bypass(tenant_weights={"a": "x"})), InvalidConfigError, "tenant_weights"),
    Case("core-tenant-weights-list", new(bypass(tenant_weights=[1])), InvalidConfigError, "tenant_weights"),
    Case("core-decode-weight", new(bypass(fair_decode_weight=math.nan)), InvalidConfigError, "nan"),
    Case("core-aging-with-fcfs", new(bypass(priority_aging_steps=2)), InvalidConfigError, "priority"),
    Case("core-active-over-max-num-seqs", new(bypass(max_num_active_seqs=3)), InvalidConfigError, "[1, 2], got 3"),
    Case("core-interval-0", new(bypass(prefill_schedule_interval=0)), InvalidConfigError, "got 0"),
    Case("core-negative-active", new(bypass(max_num_active_seqs=-1)), InvalidConfigError, "-1"),
    Case("core-str-adaptive-flag", new(bypass(long_prefill_token_threshold_adaptive="y")), InvalidConfigError, "y"),
    Case("core-str-park-grammar-waits", new(bypass(park_grammar_waits="n")), InvalidConfigError, "n"),
    Case("core-str-park-kv-loads", new(bypass(park_kv_loads="y")), InvalidConfigError, "y"),
    Case("core-str-reserve-inflight", new(bypass(reserve_inflight_prefills="y")), InvalidConfigError, "y"),
    Case("core-str-divergent-hits", new(bypass(divergent_local_hits="y")), InvalidConfigError, "y"),
    Case("core-preemption-mode", new(bypass(preemption_mode="discard")), InvalidConfigError, "discard"),
    Case("core-swap-without-cpu-pool", new(bypass(preemption_mode="swap")), InvalidConfigError, "num_cpu_blocks"),
    Case("core-cpu-blocks", new(bypass(num_cpu_blocks=2**25)), InvalidConfigError, str(2**25)),
    Case("core-swap-cost", new(bypass(swap_cost_per_block=-1.0)), InvalidConfigError, "-1"),
    Case("core-recompute-cost-str", new(bypass(recompute_cost_per_token="x")), InvalidConfigError, "x"),
]

STDLIB = {
    InvalidConfigError: ValueError,
    InvalidRequestError: ValueError,
    DuplicateRequestError: ValueError,
    InvalidOutputError: ValueError,
    UnknownRequestError: KeyError,
    SchedulerTypeError: TypeError,
}


def test_the_table_has_unique_names():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


def test_error_classes_mix_in_the_stdlib_exceptions():
    for cls, base in STDLIB.items():
        assert issubclass(cls, SchedulerError)
        assert issubclass(cls, base)
    assert issubclass(DuplicateRequestError, InvalidRequestError)
    assert issubclass(kvsched.InternalError, RuntimeError)
    assert issubclass(kvsched.InternalError, SchedulerError)
    assert issubclass(kvsched.KVConnectorError, TypeError)
    assert issubclass(kvsched.KVConnectorError, SchedulerError)


PARAMS = [
    pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []) for c in CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_bad_input_raises_and_changes_nothing(case: Case):
    ctx = case.setup()
    before = snapshot(ctx.s)
    raised: BaseException | None = None
    try:
        case.call(ctx)
    except BaseException as e:
        raised = e
    assert raised is not None, "no exception was raised"
    assert type(raised).__name__ != "PanicException", f"a Rust panic escaped: {raised!r}"
    assert type(raised) is case.exc, f"expected {case.exc.__name__}, got {type(raised).__name__}: {raised}"
    assert isinstance(raised, SchedulerError)
    assert isinstance(raised, STDLIB[case.exc])
    assert case.needle in str(raised), f"{case.needle!r} not in the message: {raised}"
    assert not re.match(r"\w+Error: ", str(raised)), f"the message names another error class: {raised}"
    assert snapshot(ctx.s) == before
    ctx.s.check_invariants()
    finish_everything(ctx)
