"""Encoder-decoder scheduling (``encoder_decoder=True``): docs/semantics.md's "Encoder-decoder scheduling", on the
Rust core and on the reference. The slot counts are those vLLM 0.33's ``EncoderDecoderCacheManager`` reaches for
the same calls (its ``num_free_slots``): charged at an admission, given back at every output of a request with
computed tokens, at its preemption, its finish and a failed allocation."""

from __future__ import annotations

from typing import Any

import pytest
from kvsched import InvalidConfigError, InvalidRequestError, Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **fields: Any) -> Any:
    cfg: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 40,
        "max_model_len": 64,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": False,
        "kv_cache_groups": (None, "cross"),
        "encoder_decoder": True,
        "max_num_encoder_input_tokens": 10,
        "encoder_cache_size": 100,
    }
    cfg.update(fields)
    config = SchedulerConfig(**cfg)
    return Scheduler(config) if impl == "rust" else ReferenceScheduler(config)


def ids(out: Any) -> list[str]:
    return list(out.req_ids)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_encoder_budget_skips_an_admission_that_does_not_fit_and_tries_the_next(impl: str) -> None:
    # Budget 10: "a" (6 encoder tokens) leaves 4; "b" (6) gets 0 tokens and keeps its place; "c" (3) fits.
    s = make(impl)
    s.add_request("a", [1, 2, 3], max_tokens=4, cross_attention_tokens=6)
    s.add_request("b", [4, 5], max_tokens=4, cross_attention_tokens=6)
    s.add_request("c", [6], max_tokens=4, cross_attention_tokens=3)
    out = s.schedule()
    assert ids(out) == ["a", "c"]
    assert s.encoder_decoder_free_slots == 100 - 9
    assert s.get_block_ids("b", 1).size == 0
    s.update_from_output(out, [[7], [7]])
    assert s.encoder_decoder_free_slots == 100  # both computed tokens: their inputs are freed
    out = s.schedule()
    assert ids(out) == ["a", "c", "b"]
    assert list(out.new_req_ids) == ["b"]
    assert s.encoder_decoder_free_slots == 94
    s.update_from_output(out, [[7], [7], [7]])
    assert s.encoder_decoder_free_slots == 94 + 6 + 3 + 6  # every output frees again: the count grows
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_without_skip_encoder_blocked_admissions_an_encoder_input_that_does_not_fit_ends_the_pass(impl: str) -> None:
    # vLLM 0.32's rule: "b" (6 of the 4 encoder tokens left) ends the admission pass; "c" (3) is not tried and
    # nothing counts as skipped. It is admitted with "c" once the budget is back.
    s = make(impl, skip_encoder_blocked_admissions=False)
    s.add_request("a", [1, 2, 3], max_tokens=4, cross_attention_tokens=6)
    s.add_request("b", [4, 5], max_tokens=4, cross_attention_tokens=6)
    s.add_request("c", [6], max_tokens=4, cross_attention_tokens=3)
    out = s.schedule()
    assert ids(out) == ["a"]
    assert s.encoder_decoder_free_slots == 100 - 6
    assert s.stats().num_skipped_waiting_reqs == 0
    s.update_from_output(out, [[7]])
    out = s.schedule()
    assert ids(out) == ["a", "b", "c"]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_short_slots_skip_an_admission_until_outputs_give_them_back(impl: str) -> None:
    # 10 slots: "a" (6) leaves 4; "b" (6) is skipped, "c" (3) admitted. With async scheduling the next step comes
    # before the first output: "b" is still skipped; once the output is applied it fits.
    s = make(impl, max_num_encoder_input_tokens=100, encoder_cache_size=10, async_scheduling=True)
    s.add_request("a", [1, 2, 3], max_tokens=6, cross_attention_tokens=6)
    s.add_request("b", [4, 5], max_tokens=6, cross_attention_tokens=6)
    s.add_request("c", [6], max_tokens=6, cross_attention_tokens=3)
    first = s.schedule()
    assert ids(first) == ["a", "c"] and s.encoder_decoder_free_slots == 1
    second = s.schedule()
    assert ids(second) == ["a", "c"] and s.encoder_decoder_free_slots == 1
    s.update_from_output(first, [[7], [7]])
    assert s.encoder_decoder_free_slots == 10
    third = s.schedule()
    assert ids(third) == ["a", "c", "b"] and s.encoder_decoder_free_slots == 4
    s.update_from_output(second, [[7], [7]])
    s.update_from_output(third, [[7], [7], [7]])
    assert s.encoder_decoder_free_slots == 4 + 9 + 15
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_failed_allocation_gives_the_slots_back_and_ends_the_pass(impl: str) -> None:
    # 5 usable blocks: "a" takes 1 decoder + 2 cross blocks; "b" needs 1 + 3: its allocation fails, vLLM frees
    # its inputs all the same (the count grows by its 9), and "c", which would fit, is not tried.
    s = make(impl, num_blocks=6, max_num_encoder_input_tokens=100)
    s.add_request("a", [1, 2], max_tokens=2, cross_attention_tokens=8)
    s.add_request("b", [3, 4], max_tokens=2, cross_attention_tokens=9)
    s.add_request("c", [5], max_tokens=2)
    out = s.schedule()
    assert ids(out) == ["a"]
    assert s.encoder_decoder_free_slots == 100 - 8 + 9
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_preemption_finish_and_abort_give_the_slots_back(impl: str) -> None:
    # 9 usable blocks of 4 tokens: "a" takes 2 decoder + 3 cross blocks, "b" 1 + 3; "b" is preempted when "a"
    # needs a third decoder block, and charged again when readmitted.
    s = make(impl, num_blocks=10, max_num_encoder_input_tokens=100)
    s.add_request("a", list(range(7)), max_tokens=8, cross_attention_tokens=12)
    s.add_request("b", list(range(3)), max_tokens=8, cross_attention_tokens=9)
    s.add_request("w", [1], max_tokens=2, cross_attention_tokens=5)  # waits: no blocks left
    out = s.schedule()
    assert ids(out) == ["a", "b"] and s.encoder_decoder_free_slots == 79 + 5  # "w"'s failed allocation
    s.update_from_output(out, [[7], [7]])
    assert s.encoder_decoder_free_slots == 84 + 21
    out = s.schedule()  # "w" fails again: every failed allocation gives its slots back
    assert s.encoder_decoder_free_slots == 105 + 5
    s.update_from_output(out, [[7], [7]])
    assert s.encoder_decoder_free_slots == 110 + 21
    out = s.schedule()  # nobody is admitted in a step with a preemption
    assert list(out.preempted_req_ids) == ["b"]
    assert s.encoder_decoder_free_slots == 131 + 9
    s.update_from_output(out, [[7]])
    assert s.encoder_decoder_free_slots == 140 + 12
    s.abort_requests(["w"])  # never admitted: freed all the same
    assert s.encoder_decoder_free_slots == 152 + 5
    s.abort_requests(["a"])
    assert s.encoder_decoder_free_slots == 157 + 12
    out = s.schedule()
    assert list(out.resumed_req_ids) == ["b"] and s.encoder_decoder_free_slots == 169 - 9
    # A request that stops frees at its output and again at its finish.
    s.add_request("z", [1], max_tokens=1, cross_attention_tokens=2)
    s.update_from_output(out, [[7]])
    out = s.schedule()
    assert "z" in ids(out)
    before = s.encoder_decoder_free_slots
    s.update_from_output(out, [[7], [7]])
    assert s.encoder_decoder_free_slots == before + 9 + 2 + 2
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_budget_applies_only_in_encoder_decoder_mode(impl: str) -> None:
    # Without encoder_decoder a cross-attention group takes encoder outputs of any size (no budget, no slots).
    s = make(impl, encoder_decoder=False, max_num_encoder_input_tokens=0, encoder_cache_size=0)
    s.add_request("a", [1, 2], max_tokens=2, cross_attention_tokens=30)
    assert ids(s.schedule()) == ["a"]
    assert s.encoder_decoder_free_slots == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_encoder_decoder_settings_and_requests_are_checked(impl: str) -> None:
    with pytest.raises(InvalidConfigError, match="needs a cross-attention group"):
        make(impl, kv_cache_groups=(None, 8))
    with pytest.raises(InvalidConfigError, match="needs a cross-attention group"):
        make(impl, kv_cache_groups=None)
    s = make(impl, encoder_cache_size=20)
    with pytest.raises(InvalidRequestError, match="exceed the encoder compute budget"):
        s.add_request("a", [1, 2], cross_attention_tokens=11)
    with pytest.raises(InvalidRequestError, match="not encoder_inputs"):
        s.add_request("a", [1, 2], encoder_inputs=[(0, 2, 5)])
    s.add_request("a", [1, 2], max_tokens=2, cross_attention_tokens=10)
    with pytest.raises(InvalidConfigError, match="max_num_encoder_input_tokens=9"):
        s.set_encoder_sizes(9, 20)
    assert s.config.max_num_encoder_input_tokens == 10
    out = s.schedule()
    assert s.encoder_decoder_free_slots == 10
    s.set_encoder_sizes(10, 30)  # the slot count stays; a reset takes the new size
    assert s.encoder_decoder_free_slots == 10
    s.reset_encoder_decoder_slots()
    assert s.encoder_decoder_free_slots == 30
    s.update_from_output(out, [[7]])
    assert s.encoder_decoder_free_slots == 40
    plain = make(impl, encoder_decoder=False)
    with pytest.raises(InvalidConfigError, match="needs encoder_decoder=True"):
        plain.reset_encoder_decoder_slots()
    assert s.num_unfinished_requests == 1
