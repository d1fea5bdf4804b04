"""KV cache events inside vLLM: with ``kv_events_config`` on, kvsched.vllm.Scheduler publishes vLLM's
``KVEventBatch`` (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, vLLM's own block hashes), batch for
batch and event for event as vLLM 0.33's scheduler does (``tests/vllm_driver.py`` compares every field), also
per KV cache group with sliding windows, several groups and chunked-local groups, and under decode context
parallelism.

Needs vLLM (``pip install 'kvsched[vllm]'``); skipped otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install 'kvsched[vllm]'")

from kvsched import InvalidConfigError
from kvsched.vllm import RULES
from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, NullEventPublisher
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_driver import Pair, _event_fields, _RecordingPublisher, random_config, run_seed

pytestmark = pytest.mark.vllm

MODES = [("sync", "v1"), ("sync", "v2"), ("async", "v1"), ("async", "v2")]


def _step(s: Any, token: int = 9) -> Any:
    return _step_with_schedule(s, token)[1]


def _step_with_schedule(s: Any, token: int = 9) -> tuple[Any, Any]:
    """One step: the scheduler output and the update's outputs."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[] if s.requests[r].is_prefill_chunk else [token] for r in ids]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    return so, s.update_from_output(so, mro)


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(300, 306))
def test_published_events_are_identical_to_vllms(sync: str, runner: str, seed: int) -> None:
    """The differential driver with events on: every published batch compared field by field (hashes, parents,
    tokens, extra keys, LoRA, medium, group, spec kind, session) after every update."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", kv_events=True)
    assert cfg.kv_events


@pytest.mark.parametrize(
    ("layout", "sync", "runner"),
    [
        ("sliding_window", "sync", "v1"),
        ("hybrid", "sync", "v1"),
        ("hybrid", "async", "v2"),
        ("chunked_local", "async", "v1"),
        ("dcp", "sync", "v2"),
        ("sparse_window", "sync", "v1"),
        ("sparse_hybrid", "async", "v1"),
        ("mamba", "sync", "v1"),
        ("sparse_mamba_checkpoints", "async", "v1"),
    ],
)
@pytest.mark.parametrize("seed", range(320, 322))
def test_published_events_are_identical_to_vllms_with_windows_groups_and_dcp(
    layout: str, sync: str, runner: str, seed: int
) -> None:
    """Per-group events (group_idx, each group's spec kind and window, a window group's runs without the blocks
    out of its window, and under sparse retention without those it does not keep), Mamba groups' cached states
    with Mamba prefix caching (dense, and sparse with prefill checkpoints), and events under decode context
    parallelism (blocks of block_size * DCP tokens)."""
    kw: dict[str, Any] = {
        "sliding_window": {"sliding_window": True},
        "hybrid": {"hybrid": True},
        "chunked_local": {"hybrid": True, "chunked_local": True},
        "dcp": {"dcp": 2},
        "sparse_window": {"sliding_window": True, "retention": 0},
        "sparse_hybrid": {"hybrid": True, "retention": 0},
        "mamba": {"mamba": True, "mamba_align": True, "mamba_prefix_caching": True},
        "sparse_mamba_checkpoints": {
            "mamba": True,
            "mamba_align": True,
            "mamba_prefix_caching": True,
            "mamba_checkpoints": True,
            "retention": 0,
        },
    }[layout]
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", kv_events=True, **kw)
    assert cfg.kv_events


@pytest.mark.parametrize("seed", range(310, 312))
def test_published_events_are_identical_to_vllms_with_a_kv_connector(seed: int) -> None:
    """Asynchronous loads promote their blocks into the cache, failed loads take them out again."""
    run_seed(seed, 120, async_scheduling=False, v2=False, connector=True, kv_events=True)


def test_the_differential_sees_every_kind_of_event() -> None:
    """A run long enough to store, evict and clear: the comparison above is not vacuous."""
    import random

    cfg = random_config(random.Random(2 * 7919 + 17), async_scheduling=False, v2=False)
    cfg.kv_events, cfg.enable_prefix_caching, cfg.num_speculative_tokens = True, True, 0
    cfg.per_request_spec_decode_metrics = "none"
    pair = Pair(cfg, 2)
    seen: list[Any] = []
    recorder = pair.publishers[0]
    publish = recorder.publish
    recorder.publish = lambda batch: (seen.extend(batch.events), publish(batch))  # type: ignore[method-assign]
    pair.run(150)
    kinds = {type(e) for e in seen}
    assert {BlockStored, BlockRemoved, AllBlocksCleared} <= kinds
    assert pair.num_events == len(seen)
    assert any(e.parent_block_hash is not None for e in seen if isinstance(e, BlockStored))


def test_stored_blocks_carry_vllms_block_hashes() -> None:
    bs = 4
    s = make_scheduler("kvsched", make_vllm_config(block_size=bs, num_blocks=16, kv_events=True))
    assert s.core.config.enable_kv_cache_events
    pub = s.kv_event_publisher = _RecordingPublisher()
    req = make_request("a", list(range(10, 21)), max_tokens=8, block_size=bs, cache_salt="salt")
    s.add_request(req)
    _step(s)
    (stored,) = pub.batches.pop()
    assert isinstance(stored, BlockStored)
    # As vLLM publishes them: 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), else the bytes.
    vllm_hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    assert stored.block_hashes == vllm_hashes[:2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(10, 18)) and stored.block_size == bs
    assert stored.extra_keys == [("salt",), None] and stored.medium == "GPU" and stored.group_idx == 0
    assert stored.kv_cache_spec_kind is not None
    assert pub.batches == []
    _step(s)  # the decode of the 12th token completes block 2: stored by schedule(), published by the update
    (stored,) = pub.batches.pop()
    assert stored.block_hashes == [vllm_hashes[2]] and stored.parent_block_hash == vllm_hashes[1]
    assert s.reset_prefix_cache() is False  # the request holds blocks
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache() is True
    _step(s)
    assert pub.batches == [[AllBlocksCleared()]]


@pytest.mark.parametrize("retention", [0, 12])
def test_sparse_window_retention_publishes_vllms_stored_blocks(retention: int) -> None:
    """A sliding window of 8 tokens (two blocks of 4 before a hit) under sparse retention: a prompt's run keeps
    only the blocks a later hit can use, the two before the prompt's last token (not the run's last block, which
    holds that token) and, with an interval of 12 tokens, also the last two of every three-block segment; its
    decodes keep none. The stored events list the kept blocks wherever they sit in the run, with their own hashes
    and extra keys, while the tokens span the run. A resend of the prompt hits; a longer sibling hits and stores
    its own blocks. Published events equal vLLM's."""
    bs = 4
    prompt = list(range(100, 132))  # 8 full blocks
    sibling = [*prompt, *range(300, 314)]
    published: list[list[Any]] = []
    for impl in ("vllm", "kvsched"):
        cfg = make_vllm_config(block_size=bs, num_blocks=48, max_num_batched_tokens=64, kv_events=True)
        s = make_scheduler(impl, cfg, sliding_window=8, prefix_cache_retention_interval=retention)
        pub = s.kv_event_publisher = _RecordingPublisher()
        for name, tokens in (("a", prompt), ("b", prompt), ("c", sibling)):
            s.add_request(make_request(name, tokens, max_tokens=6, block_size=bs, cache_salt="salt"))
            while name in s.requests:
                _step(s)
        published.append([_event_fields(e) for batch in pub.batches for e in batch])
    assert published[0] == published[1]
    stored = [dict(fields) for kind, fields in published[0] if kind == "BlockStored"]
    # The prompt's run from its first block (no block out of the window yet) stores some of its blocks, not all:
    # the ones retention left out are not only its first ones.
    first_runs = [e for e in stored if e["parent_block_hash"] is None]
    assert any(0 < len(e["block_hashes"]) < len(e["token_ids"]) // bs for e in first_runs)


@pytest.mark.parametrize("retention", [None, 0], ids=["dense", "sparse"])
def test_mamba_prefix_caching_publishes_vllms_events(retention: int | None) -> None:
    """Mamba prefix caching (mode "align", a Mamba group before full attention): each group's runs are stored
    under its group_idx and spec kind, the Mamba group's with the states it caches at block boundaries (densely,
    or under retention 0 only the one at the prompt's last boundary before its last token: a run with holes), and
    states freed as a request moves on are removed when their blocks are reused. A resend of a prompt hits the
    state before its last token; a sibling finds no state at the shared prefix, stops there and caches one, which
    the next sibling hits. Published events equal vLLM's, batch by batch."""
    bs = 4
    prompt = list(range(100, 126))  # 6 full blocks and 2 tokens
    siblings = [[*prompt[:18], *range(300 + 20 * k, 310 + 20 * k)] for k in range(2)]
    others = [list(range(500 + 40 * k, 530 + 40 * k)) for k in range(3)]  # fill the pool: cached states evicted
    published: list[list[Any]] = []
    hits: dict[tuple[str, str], int] = {}
    for impl in ("vllm", "kvsched"):
        cfg = make_vllm_config(block_size=bs, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                               max_num_seqs=4, mamba_cache_mode="align", kv_events=True)  # fmt: skip
        s = make_scheduler(impl, cfg, kv_cache_groups=("mamba", None), prefix_cache_retention_interval=retention)
        pub = s.kv_event_publisher = _RecordingPublisher()
        batches: list[Any] = []
        for name, tokens in [("a", prompt), ("b", prompt), ("c", siblings[0]), ("d", siblings[1])] + [
            (f"o{k}", t) for k, t in enumerate(others)
        ]:
            s.add_request(make_request(name, tokens, max_tokens=3, block_size=bs))
            so, _ = _step_with_schedule(s)
            (hits[impl, name],) = [new.num_computed_tokens for new in so.scheduled_new_reqs if new.req_id == name]
            while name in s.requests:
                _step(s)
                batches.extend([_event_fields(e) for e in b] for b in pub.batches)
                pub.batches.clear()
        published.append(batches)
    assert published[0] == published[1]
    assert [hits[impl, r] for impl in ("vllm", "kvsched") for r in "abcd"] == [0, 24, 0, 16] * 2, hits
    events = [(kind, dict(fields)) for batch in published[0] for kind, fields in batch]
    mamba_stored = [e for kind, e in events if kind == "BlockStored" and e["group_idx"] == 0]
    mamba_removed = [e for kind, e in events if kind == "BlockRemoved" and e["group_idx"] == 0]
    assert mamba_stored and mamba_removed, events
    attention_stored = [e for kind, e in events if kind == "BlockStored" and e["group_idx"] == 1]
    assert {e["kv_cache_spec_kind"] for e in mamba_stored}.isdisjoint(e["kv_cache_spec_kind"] for e in attention_stored)
    # A run of Mamba states lists the real states only (a prefill chunk leaves null blocks before its last state);
    # under retention 0 a decode's run keeps none of them, densely each keeps its state.
    assert all(0 < len(e["block_hashes"]) <= len(e["token_ids"]) // bs for e in attention_stored)
    empty = [e for e in mamba_stored if not e["block_hashes"]]
    assert bool(empty) is (retention is not None), empty


def test_events_off_publish_nothing_and_cost_the_core_nothing() -> None:
    s = make_scheduler("kvsched", make_vllm_config(block_size=4, num_blocks=16))
    assert isinstance(s.kv_event_publisher, NullEventPublisher)
    assert s.get_kv_event_publisher_config() is None
    assert s.core.config.enable_kv_cache_events is False
    pub = s.kv_event_publisher = _RecordingPublisher()
    s.add_request(make_request("a", list(range(10, 21)), max_tokens=4, block_size=4))
    for _ in range(5):
        _step(s)
    assert pub.batches == []


def test_full_report_mode_fails_the_request_with_a_validation_error() -> None:
    """vLLM's ``kv_cache_report_mode='full'`` also publishes every prefix-cache lookup that hits (admitted or not),
    which the core does not report: such a request fails alone, as a bad kvsched attribute does."""
    s = make_scheduler("kvsched", make_vllm_config(block_size=4, num_blocks=16, kv_events=True))
    req = make_request("a", list(range(10, 21)), max_tokens=4, block_size=4)
    req.kv_cache_report_mode = "full"
    s.add_request(req)
    s.add_request(make_request("b", list(range(10, 21)), max_tokens=4, block_size=4))
    outs = _step(s)
    (failed,) = [o for o in outs[0].outputs if o.request_id == "a"]
    assert failed.finish_reason == FinishReason.ERROR
    if RULES.output_error:  # vLLM 0.32's outputs carry no error, only the finish reason
        assert failed.error is not None and "kv_cache_report_mode" in failed.error.message
    assert "b" in s.requests and "a" not in s.requests


def test_events_are_vllms_setting_not_a_kvsched_knob() -> None:
    cfg = make_vllm_config()
    cfg.additional_config = {"kvsched": {"enable_kv_cache_events": True}}
    with pytest.raises(InvalidConfigError, match="kv-events-config"):
        make_scheduler("kvsched", cfg)
