"""Multimodal requests in kvsched.vllm.Scheduler: vLLM's ``mm_features``, encoder budget and encoder cache.

Needs vLLM (``pip install '.[vllm]'``); skipped otherwise. The model is a tiny LLaVA written on the fly
(``kvsched.vllm.testing``: 16 tokens per image); each behaviour runs on vLLM's own scheduler too, with the same
calls, and every output is compared field by field (``tests/vllm_driver.py``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install '.[vllm]'")

from kvsched import InvalidConfigError
from kvsched.vllm import RULES, UnsupportedFeatureError
from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.multimodal.inputs import PlaceholderRange
from vllm_driver import run_seed, step_pair

pytestmark = pytest.mark.vllm

BLOCK = 16


def _pair(**fields: Any) -> tuple[Any, Any]:
    cfg = make_vllm_config(
        multimodal=True, block_size=BLOCK, num_blocks=64, max_model_len=256, max_num_seqs=8, **fields
    )
    return make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg)


def _add(scheds: tuple[Any, ...], rid: str, prompt: list[int], images: list[tuple[int, int, str]]) -> None:
    for s in scheds:
        s.add_request(make_request(rid, prompt, max_tokens=2, block_size=BLOCK, images=images))


def _step(scheds: tuple[Any, ...]) -> Any:
    """One synchronous step on each scheduler, outputs compared; returns kvsched's SchedulerOutput."""
    return step_pair(scheds)[0][1]


def test_encoder_budget_and_cache_are_vllms_for_the_model() -> None:
    vllm_s, ours = _pair(max_num_batched_tokens=64)
    assert ours.max_num_encoder_input_tokens == vllm_s.max_num_encoder_input_tokens == 64
    assert ours.core.config.encoder_cache_size == vllm_s.encoder_cache_manager.cache_size


def test_same_tokens_with_another_image_do_not_share_cached_blocks() -> None:
    """The image identifier keys the blocks it overlaps (vLLM's multimodal extra keys): a request with the same
    placeholder tokens and another image hits only the blocks before the image; with the same image, all of them."""
    scheds = _pair(max_num_batched_tokens=128)
    prompt = list(range(100, 180))
    _add(scheds, "a", prompt, [(40, 16, "cat")])
    for _ in range(3):
        _step(scheds)
    _add(scheds, "b", prompt, [(40, 16, "dog")])
    _add(scheds, "c", prompt, [(40, 16, "cat")])
    out = _step(scheds)
    hits = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert hits == {"b": 32, "c": 64}  # b: blocks 0-1 (the image starts in block 2); c: 4 full blocks, not the last
    assert out.scheduled_encoder_inputs == {"b": [0]}  # c's image is still cached (freeable) from a
    vllm_s, ours = scheds
    assert [r.block_hashes for r in (ours.requests["b"], ours.requests["c"])] == [
        vllm_s.requests["b"].block_hashes,
        vllm_s.requests["c"].block_hashes,
    ]


def test_scheduled_and_freed_encoder_inputs_follow_vllm() -> None:
    """A chunk stops before an image the encoder budget cannot take this step; evicted entries are reported once
    in free_encoder_mm_hashes (as vLLM's identifiers)."""
    scheds = _pair(max_num_batched_tokens=32)
    _add(scheds, "a", list(range(200, 260)), [(2, 16, "x"), (20, 16, "y"), (40, 16, "z")])
    seen: dict[str, list[int]] = {}
    freed: list[str] = []
    for _ in range(8):
        out = _step(scheds)
        for rid, ids in out.scheduled_encoder_inputs.items():
            seen.setdefault(rid, []).extend(ids)
        freed += out.free_encoder_mm_hashes
    assert seen == {"a": [0, 1, 2]}
    _add(scheds, "b", list(range(300, 340)), [(0, 16, "w"), (16, 16, "v")])
    for _ in range(6):
        freed += _step(scheds).free_encoder_mm_hashes
    assert freed and set(freed) <= {"x", "y", "z"}


def test_requests_with_images_on_a_text_model_are_refused() -> None:
    s = make_scheduler("kvsched", make_vllm_config(block_size=BLOCK))
    with pytest.raises(UnsupportedFeatureError, match="does not accept multimodal inputs"):
        s.add_request(make_request("a", list(range(40)), block_size=BLOCK, images=[(0, 8, "cat")]))
    assert not s.requests


@pytest.mark.parametrize("multimodal", [True, False])
def test_encoder_sizes_set_on_a_built_scheduler_follow_vllm(multimodal: bool) -> None:
    """vLLM's tests set max_num_encoder_input_tokens and a new EncoderCacheManager on a built scheduler (a text
    model's too): kvsched's core takes both sizes, and the steps stay vLLM's (a 16-token budget, a 40-token cache)."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    cfg = make_vllm_config(
        multimodal=multimodal, block_size=BLOCK, num_blocks=64, max_model_len=256, max_num_seqs=8,
        max_num_batched_tokens=64,
    )  # fmt: skip
    scheds = (make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg))
    for s in scheds:
        s.max_num_encoder_input_tokens = 16
        s.encoder_cache_manager = EncoderCacheManager(cache_size=40)
    vllm_s, ours = scheds
    assert ours.max_num_encoder_input_tokens == 16 and ours.core.config.encoder_cache_size == 40
    _add(scheds, "a", list(range(200, 260)), [(2, 16, "x"), (20, 16, "y")])
    _add(scheds, "b", list(range(300, 340)), [(4, 16, "x"), (24, 12, "z")])
    seen: dict[str, list[int]] = {}
    for _ in range(8):
        for rid, ids in _step(scheds).scheduled_encoder_inputs.items():
            seen.setdefault(rid, []).extend(ids)
    assert seen == {"a": [0, 1], "b": [1]}  # one 16-token image per step; b finds "x" cached
    # The core's cache holds entries now: a new manager of another size is refused, changing nothing.
    with pytest.raises(InvalidConfigError, match="only while the encoder cache is empty"):
        ours.encoder_cache_manager = EncoderCacheManager(cache_size=80)
    with pytest.raises(UnsupportedFeatureError, match="new, empty"):
        ours.encoder_cache_manager = vllm_s.encoder_cache_manager
    assert ours.core.config.encoder_cache_size == 40


@pytest.mark.skipif(RULES.version == "0.32", reason="vLLM 0.33's test (0.32 keeps a consumed image for the lookahead)")
@pytest.mark.parametrize("lookahead", [1, 3])
def test_prefill_lookahead_set_on_a_built_scheduler_follows_vllm(lookahead: int) -> None:
    """vLLM's tests set num_prefill_lookahead on a built scheduler (with the encoder sizes): two adjacent images
    that fit the encoder cache one at a time are encoded in turn, the chunks stopping as vLLM's; it can change
    only while the scheduler holds no request."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    scheds = _pair(max_num_batched_tokens=48)
    for s in scheds:
        s.num_prefill_lookahead = lookahead
        s.max_num_encoder_input_tokens = 48
        s.encoder_cache_manager = EncoderCacheManager(cache_size=48)
    vllm_s, ours = scheds
    assert vllm_s.num_prefill_lookahead == ours.num_prefill_lookahead == lookahead
    assert ours.core.config.prefill_lookahead_tokens == lookahead
    _add(scheds, "a", list(range(100, 200)), [(10, 30, "x"), (40, 30, "y")])
    seen: list[int] = []
    for _ in range(6):
        seen += _step(scheds).scheduled_encoder_inputs.get("a", [])
        if "a" in ours.requests:
            with pytest.raises(UnsupportedFeatureError, match="holds no request"):
                ours.num_prefill_lookahead = 0
            assert ours.num_prefill_lookahead == lookahead
    assert seen == [0, 1] and not ours.requests
    ours.num_prefill_lookahead = 0  # nothing held any more
    assert ours.core.config.prefill_lookahead_tokens == 0


DRAFTERS = [("eagle", 1), ("mtp", 3)]


def _drafter_pair(drafter: str, k: int, **fields: Any) -> tuple[Any, Any]:
    return _pair(
        num_speculative_tokens=k, speculative_method="eagle", multi_module_mtp=drafter == "mtp", eagle_block_drop=True,
        **fields,
    )  # fmt: skip


@pytest.mark.parametrize(("drafter", "lookahead"), DRAFTERS)
def test_drafter_lookahead_schedules_an_image_right_after_the_chunk(drafter: str, lookahead: int) -> None:
    """vLLM widens a chunk's encoder window by the drafter's prefill lookahead (1 for EAGLE, the modules of a
    multi-module MTP drafter): an image starting right after the first chunk's end is encoded with that chunk."""
    scheds = _drafter_pair(drafter, lookahead, max_num_batched_tokens=32)
    assert scheds[1].num_prefill_lookahead == scheds[0].num_prefill_lookahead == lookahead
    _add(scheds, "a", list(range(100, 160)), [(32, 16, "cat")])
    out = _step(scheds)
    assert out.num_scheduled_tokens == {"a": 32}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    out = _step(scheds)
    assert out.num_scheduled_tokens == {"a": 28} and not out.scheduled_encoder_inputs


@pytest.mark.skipif(RULES.version == "0.32", reason="disable_chunked_mm_input is refused on vLLM 0.32")
@pytest.mark.parametrize(("drafter", "lookahead"), DRAFTERS)
def test_drafter_lookahead_stops_a_chunk_short_of_an_image_with_disable_chunked_mm_input(
    drafter: str, lookahead: int
) -> None:
    """With disable_chunked_mm_input a chunk that would cover only part of an image stops the drafter's prefill
    lookahead before it; the next chunk covers the image whole."""
    scheds = _drafter_pair(drafter, lookahead, max_num_batched_tokens=32, disable_chunked_mm_input=True)
    _add(scheds, "a", list(range(100, 160)), [(20, 16, "cat")])
    out = _step(scheds)
    assert out.num_scheduled_tokens == {"a": 20 - lookahead} and not out.scheduled_encoder_inputs
    out = _step(scheds)
    assert out.num_scheduled_tokens == {"a": 32} and out.scheduled_encoder_inputs == {"a": [0]}


@pytest.mark.parametrize(("drafter", "lookahead"), DRAFTERS)
def test_image_in_the_lookahead_that_does_not_fit_cuts_the_chunk_as_the_release_does(
    drafter: str, lookahead: int
) -> None:
    """An image reached only by the drafter's lookahead that the encoder budget cannot take this step: vLLM 0.33
    keeps the chunk (its read-ahead falls back to token embeddings), vLLM 0.32 cuts the lookahead off it too
    (kvsched's exact_encoder_cut_and_release); the image is encoded at the next step."""
    scheds = _drafter_pair(drafter, lookahead, max_num_batched_tokens=32)
    for s in scheds:
        s.max_num_encoder_input_tokens = 16
    _add(scheds, "a", list(range(100, 160)), [(2, 16, "x"), (32, 16, "y")])
    first = 32 if RULES.exact_encoder_cut_and_release else 32 - lookahead
    out = _step(scheds)
    assert out.num_scheduled_tokens == {"a": first} and out.scheduled_encoder_inputs == {"a": [0]}
    out = _step(scheds)
    assert out.num_scheduled_tokens == {"a": 60 - first} and out.scheduled_encoder_inputs == {"a": [1]}


def test_embedding_masks_are_refused_by_name() -> None:
    _, ours = _pair()
    request = make_request("a", list(range(40)), block_size=BLOCK, images=[(0, 8, "cat")])
    pos = request.mm_features[0].mm_position
    request.mm_features[0].mm_position = PlaceholderRange(
        offset=pos.offset, length=pos.length, is_embed=__import__("torch").tensor([True] * 4 + [False] * 4)
    )
    with pytest.raises(UnsupportedFeatureError, match="is_embed"):
        ours.add_request(request)
    assert not ours.requests and ours.get_num_unfinished_requests() == 0


def test_identifier_map_drops_identifiers_no_request_holds() -> None:
    """The identifier <-> hash map keeps an identifier while a request holds it or the core still caches it."""
    scheds = _pair(max_num_batched_tokens=64)
    _, ours = scheds
    for i in range(6):
        _add(scheds, f"r{i}", list(range(1000 * i, 1000 * i + 40)), [(4, 16, f"img{i}")])
        for _ in range(4):
            _step(scheds)
    assert not ours.requests
    assert len(ours._mm) <= 4  # at most the 64-token cache's worth of 16-token entries is still cached


@pytest.mark.skipif(RULES.version != "0.32", reason="vLLM 0.32 only")
def test_disable_chunked_mm_input_is_refused_on_vllm_032() -> None:
    cfg = make_vllm_config(multimodal=True, disable_chunked_mm_input=True)
    with pytest.raises(UnsupportedFeatureError, match="disable_chunked_mm_input"):
        make_scheduler("kvsched", cfg)


MODES = [("sync", "v1"), ("async", "v1"), ("sync", "v2"), ("async", "v2")]


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(3))
def test_identical_to_vllm_with_images(sync: str, runner: str, seed: int) -> None:
    """The differential driver with images: shared and distinct identifiers on shared prefixes, tight encoder
    budgets and caches, disable_chunked_mm_input in some runs."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", multimodal=True)
    assert cfg.multimodal


@pytest.mark.parametrize("drafter", [d for d, _ in DRAFTERS])
@pytest.mark.parametrize("sync", ["sync", "async"])
@pytest.mark.parametrize("seed", range(2))
def test_identical_to_vllm_with_images_and_a_drafter(drafter: str, sync: str, seed: int) -> None:
    """The differential driver with images and an EAGLE or multi-module MTP drafter (its prefill lookahead widens
    the encoder window; look-ahead block hashes key the images after a block)."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=False, multimodal=True, eagle=True,
                   mtp=drafter == "mtp")  # fmt: skip
    assert cfg.multimodal and cfg.num_speculative_tokens
