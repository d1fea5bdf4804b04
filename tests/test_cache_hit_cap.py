"""The cache-hit cap (``set_cache_hit_cap``): the local prefix hit stops at the cap's blocks, the external hit is
what the cap lets through, the hooks see which of the request's blocks are cached, and a failing hook answers
"no hit". Each test runs on the Rust core and on the pure-Python reference; docs/semantics.md, "Cache-hit cap",
is the contract."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import SchedulerConfig, SchedulerTypeError
from kvsched.reference import ReferenceScheduler

IMPLS = [pytest.param("rust", marks=requires_rust), "reference"]
PROMPT = list(range(100, 120))  # 20 tokens: 5 full blocks of 4


class Cap:
    """Caps the local hit at ``max`` tokens; lets an external hit through only if it ends on a block boundary at
    or before ``max``. Logs every question."""

    def __init__(self, max_hit: Any) -> None:
        self.max = max_hit
        self.log: list[tuple[Any, ...]] = []

    def max_cache_hit(self, req_id: str, cached: list[bool]) -> Any:
        self.log.append(("max", req_id, list(cached)))
        return self.max

    def cap_external_hit(self, req_id: str, cached: list[bool], num_local: int, num_external: int) -> Any:
        self.log.append(("ext", req_id, list(cached), num_local, num_external))
        hit = num_local + num_external
        return num_external if hit % 4 == 0 and hit <= self.max else 0


class Offer:
    """A KV connector that offers ``ext`` tokens (synchronously unless ``load_async``) to every admission."""

    def __init__(self, ext: int, load_async: bool = False) -> None:
        self.ext, self.load_async = ext, load_async

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> Any:
        return (self.ext, self.load_async)

    def update_state_after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def request_finished(self, req_id: str, block_ids: list[int]) -> Any:
        return False


def make(impl: str, conn: Any = None, **fields: Any) -> Any:
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 32, "max_model_len": 64, "prefix_hash_seed": 0, **fields})
    if impl == "rust":
        from kvsched import Scheduler

        return Scheduler(cfg, kv_connector=conn)
    return ReferenceScheduler(cfg, kv_connector=conn)


def run_to_end(s: Any, rid: str) -> None:
    """Admits ``rid`` (one output token) and applies its step: its blocks stay cached."""
    s.add_request(rid, PROMPT, max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, [[7]])
    s.check_invariants()


def second(impl: str, cap: Cap | None, conn: Any = None, warm: bool = True, **fields: Any) -> Any:
    """The scheduled tokens of ``b`` (the same prompt as ``a``, which ran first if ``warm``) under ``cap``."""
    s = make(impl, conn, **fields)
    if warm:
        run_to_end(s, "a")
    if cap is not None:
        s.set_cache_hit_cap(cap)
    s.add_request("b", PROMPT, max_tokens=1)
    out = s.schedule()
    s.check_invariants()
    return dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True))["b"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("max_hit", "scheduled"), [(None, 4), (100, 4), (16, 4), (9, 12), (8, 12), (7, 16), (0, 20)])
def test_the_local_hit_stops_at_the_caps_blocks(impl: str, max_hit: int | None, scheduled: int) -> None:
    """``max`` tokens allow ``max // 4`` blocks, never the block of the last token (16 of 20 tokens at most)."""
    assert second(impl, None if max_hit is None else Cap(max_hit)) == scheduled


@pytest.mark.parametrize("impl", IMPLS)
def test_the_local_cap_applies_to_a_sliding_window_hit(impl: str) -> None:
    """With a sliding window of 8 tokens the hit is the window's run below the cap's bound."""
    assert second(impl, None, sliding_window=8) == 4
    assert second(impl, Cap(9), sliding_window=8) == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_the_hook_sees_the_requests_cached_blocks(impl: str) -> None:
    """``cached[i]``: whether the prefix cache holds the request's full block ``i`` now (all five after ``a``,
    none on a cold cache)."""
    cap = Cap(9)
    second(impl, cap)
    assert cap.log == [("max", "b", [True] * 5)]
    cap = Cap(9)
    second(impl, cap, warm=False)
    assert cap.log == [("max", "b", [False] * 5)]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_external_hit_is_what_the_cap_lets_through(impl: str) -> None:
    """With a KV connector: the cap is asked after the connector, with the (capped) local hit; its answer is the
    external hit, never more than offered; 0 loads nothing."""
    cap = Cap(19)
    assert second(impl, cap, Offer(8), warm=False) == 12
    assert cap.log == [("max", "b", [False] * 5), ("ext", "b", [False] * 5, 0, 8)]
    assert second(impl, Cap(4), Offer(8), warm=False) == 20
    assert second(impl, Cap(19), Offer(7), warm=False) == 20  # not on a block boundary
    cap = Cap(8)
    assert second(impl, cap, Offer(4)) == 12  # 8 local tokens; 4 more would end past 8
    assert cap.log[1] == ("ext", "b", [True] * 5, 8, 4)
    assert second(impl, None, Offer(8), warm=False) == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_an_asynchronous_load_capped_to_nothing_is_no_load(impl: str) -> None:
    s = make(impl, Offer(8, load_async=True))
    s.set_cache_hit_cap(Cap(4))
    s.add_request("b", PROMPT, max_tokens=1)
    out = s.schedule()
    assert (out.req_ids, out.num_scheduled_tokens.tolist()) == (["b"], [20])


@pytest.mark.parametrize("impl", IMPLS)
def test_the_external_cap_never_raises_the_hit(impl: str) -> None:
    class Raise(Cap):
        def cap_external_hit(self, req_id: str, cached: list[bool], num_local: int, num_external: int) -> Any:
            return 1000

    assert second(impl, Raise(2**70), Offer(8), warm=False) == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_the_cap_is_asked_only_at_a_lookup(impl: str) -> None:
    """Not while the request runs; removing the cap restores the plain hits."""
    s = make(impl)
    cap = Cap(0)
    s.set_cache_hit_cap(cap)
    assert s.cache_hit_cap is cap
    s.add_request("a", PROMPT[:10], max_tokens=3)
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, [[1]])
    assert cap.log == [("max", "a", [False, False])]
    s.set_cache_hit_cap(None)
    assert s.cache_hit_cap is None
    s.add_request("b", PROMPT[:10], max_tokens=1)
    assert s.schedule().num_scheduled_tokens.tolist() == [2]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("answer", [-1, 2.5, True, None, "8"])
def test_a_bad_answer_is_no_hit_and_raised_after_the_step(impl: str, answer: Any) -> None:
    s = make(impl)
    run_to_end(s, "a")
    s.set_cache_hit_cap(Cap(answer))
    s.add_request("b", PROMPT, max_tokens=1)
    with pytest.raises(SchedulerTypeError, match=r"cache_hit_cap\.max_cache_hit must return an int >= 0"):
        s.schedule()
    s.check_invariants()
    assert s.get_num_computed_tokens("b") == 20  # admitted with no hit: the whole prompt


@pytest.mark.parametrize("impl", IMPLS)
def test_a_raising_hook_is_no_hit_and_raised_after_the_step(impl: str) -> None:
    class Boom(Cap):
        def max_cache_hit(self, req_id: str, cached: list[bool]) -> Any:
            raise RuntimeError("boom")

    s = make(impl)
    run_to_end(s, "a")
    s.set_cache_hit_cap(Boom(9))
    s.add_request("b", PROMPT, max_tokens=1)
    with pytest.raises(RuntimeError, match="boom"):
        s.schedule()
    s.check_invariants()
    assert s.get_num_computed_tokens("b") == 20


@pytest.mark.parametrize("impl", IMPLS)
def test_a_cap_without_the_hooks_is_refused(impl: str) -> None:
    s = make(impl)
    with pytest.raises(SchedulerTypeError, match="cache_hit_cap must have a max_cache_hit"):
        s.set_cache_hit_cap(object())
    assert s.cache_hit_cap is None


@pytest.mark.parametrize("impl", IMPLS)
def test_get_cached_block_mask_answers_block_by_block(impl: str) -> None:
    """``get_cached_block_mask``: one entry per full block, whether a block with its hash is cached now, also
    past a block that is not (a prefix lookup stops there); a salt keys other blocks; changes nothing."""
    s = make(impl, num_blocks=12)
    run_to_end(s, "a")  # caches blocks 0-4 of PROMPT
    assert s.get_cached_block_mask(PROMPT) == [True] * 5
    assert s.get_cached_block_mask(PROMPT[:11]) == [True, True]
    assert s.get_cached_block_mask(PROMPT, cache_salt="x") == [False] * 5
    other = [*PROMPT[:4], 1, 2, 3, 4, *PROMPT[8:]]
    assert s.get_cached_block_mask(other) == [True, False, False, False, False]
    s.check_invariants()
    assert make(impl, enable_prefix_caching=False).get_cached_block_mask(PROMPT) == [False] * 5
