"""Drive vLLM's own scheduler and ``kvsched.vllm.Scheduler`` side by side and compare everything observable.

vLLM's side is the installed release's own ``Scheduler``/``AsyncScheduler`` (0.32 or 0.33: run the driver in an
environment with each to check both); kvsched's adapter follows that release's rules.

Used by ``tests/test_vllm_differential.py`` (and runnable by hand for long sweeps:
``python tests/vllm_driver.py --seeds 200 --steps 300``). Each scheduler gets its own, identical ``Request``
objects and its own copy of every ``ModelRunnerOutput`` (``update_from_output`` trims the lists it is given).
After every call the two ``SchedulerOutput``s / ``EngineCoreOutputs`` are compared field by field, and so is the
state of every live request and the block table of every request that holds blocks.

With ``--streaming`` some requests are streaming-input sessions (resumable): their next parts arrive while they
run, wait to run or wait for input, and their input ends (``finish_input``) at a random point or at the drain.

With ``--mm`` the model is a tiny LLaVA and requests carry images (shared and distinct identifiers, on the
shared prefixes too): ``scheduled_encoder_inputs``, ``free_encoder_mm_hashes``, ``encoder_input_updates`` and the
block hashes the identifiers key are compared like every other field.

Not compared, by design: timestamps (events, outputs), object identities, and the opaque connector and
encoder-cache manager fields, which are None/empty on both sides in the configurations driven here.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import dataclasses
import enum
import math
import operator
import os
import random
import sys
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Before vLLM is imported: no GPU is needed (or used) to schedule.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib

from kvsched.vllm import RULES
from kvsched.vllm.testing import is_replay_group, make_request, make_scheduler, make_vllm_config

# Request fields mirrored by the adapter and compared after every call.
REQUEST_FIELDS = (
    "status",
    "num_computed_tokens",
    "num_output_placeholders",
    "num_in_flight_tokens",
    "num_stale_output_tokens",
    "drop_stale_output",
    "spec_token_ids",
    "num_preemptions",
    "is_prefill_chunk",
    "stop_reason",
    "output_token_ids",
    "all_token_ids",
    "block_hashes",
    "spec_decode_metrics",
    # What a streaming-input part changes (the prompt grows by the kept outputs and the part, the part's limits
    # and sampling parameters replace the request's).
    "prompt_token_ids",
    "num_prompt_tokens",
    "max_tokens",
    "arrival_time",
    "sampling_params",
)

# All of them in one tuple (the token lists read as plain lists: ``ConstantList`` compares by identity), so
# that the common case, nothing differs, costs one comparison per request; a difference is then located field
# by field.
_request_fast = operator.attrgetter(
    *(f for f in REQUEST_FIELDS if f not in ("output_token_ids", "all_token_ids")),
    "_output_token_ids",
    "_all_token_ids",
)


class Divergence(AssertionError):
    pass


# Steps without anything scheduled, and with every request unchanged, after which the drain counts as stalled.
DRAIN_STALL_STEPS = 64


class VllmStopped(Exception):
    """vLLM's own scheduler failed one of its assertions, or stalled in the drain: the seed stops there (every step
    before it agreed)."""


def _norm(value: Any) -> Any:
    """A comparable, timestamp-free form of a vLLM output value."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, dict):
        return [(_norm(k), _norm(v)) for k, v in value.items()]  # insertion order matters (batch order)
    if isinstance(value, (set, frozenset)):
        return sorted(_norm(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    name = type(value).__name__
    if name == "ConstantList":  # vLLM's read-only view of a request's token lists
        return [_norm(v) for v in value]
    if name == "EngineCoreEvent":
        return ("event", int(value.type))
    if name == "SamplingParams":
        return ("sampling_params", repr(value))
    if name in ("EngineCoreOutput", "EngineCoreOutputs", "SchedulerStats", "PrefixCacheStats", "PrefillStats"):
        fields = (
            value.__struct_fields__
            if hasattr(value, "__struct_fields__")
            else [f.name for f in dataclasses.fields(value)]
        )
        return (name, [(f, _norm(getattr(value, f))) for f in fields if f != "timestamp"])
    if dataclasses.is_dataclass(value):
        return (name, [(f.name, _norm(getattr(value, f.name))) for f in dataclasses.fields(value)])
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return (name, value.name)
    return ("opaque", name)


def _diff(path: str, a: Any, b: Any) -> str | None:
    if a == b:
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}\n  vllm:    {a}\n  kvsched: {b}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _diff(f"{path}[{i}]", x, y)
            if d:
                return d
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _diff(f"{path}.{i}", x, y)
            if d:
                return d
    return f"{path}:\n  vllm:    {a}\n  kvsched: {b}"


_PLAIN = frozenset((type(None), bool, int, float, str, bytes))


def _plain_equal(a: Any, b: Any) -> bool:
    """``a == b`` where that also means equal normalized forms: plain values, enum members, sequences of plain
    values (vLLM's ``ConstantList`` included), dataclasses of such. No dicts (their order matters to
    :func:`_norm`) and no other objects (timestamps). A fast path of :func:`compare`: most compared values are
    token lists, counters and statuses; anything else goes the normalized way."""
    ta = type(a)
    if ta is not type(b):
        return False
    if ta in _PLAIN:
        return bool(a == b)
    if isinstance(a, enum.Enum):
        return a is b
    if ta.__name__ == "ConstantList":
        a, b = a._x, b._x
        ta = type(a)
        if ta is not type(b):
            return False
    if ta is list or ta is tuple:
        return len(a) == len(b) and a == b and set(map(type, a)) <= _PLAIN
    if dataclasses.is_dataclass(a):
        names = _FIELDS.get(ta)
        if names is None:
            names = _FIELDS[ta] = tuple(f.name for f in dataclasses.fields(a))
        return all(_plain_equal(getattr(a, n), getattr(b, n)) for n in names)
    return False


_FIELDS: dict[type, tuple[str, ...]] = {}


# Requests scheduled as new with prefix-hit tokens (their first step starts past 0), over the runs of the process.
PREFIX_HITS = 0
# --divergent-hits: vLLM's admission lookups whose per-group local hit diverged, and those of them it replaced by the
# hit every group agrees on (the connector found no tokens).
DIVERGED_HITS = collections.Counter[str]()
# Runs whose requests hash at a unit finer than the block (--hash-block-size).
FINER_HASH_SEEDS = 0
# --ring: the runs with compressor rings, those with a ring first, with compressed attention, where vLLM zeroes new
# attention blocks for mixed precisions (no Mamba group), and the blocks to zero its steps reported there.
RING_COUNTS = collections.Counter[str]()
# --replay: the runs with bounded prefix replay and the admissions that replayed (vLLM's replay_start above 0).
REPLAY_COUNTS = collections.Counter[str]()
# Of the prefix-hit admissions, those whose hit ends inside a block; and the block copies vLLM's scheduler sent
# to the workers (kv_cache_block_copies: the copy-on-write of a shared block a hit ends inside).
PARTIAL_BLOCK_HITS = 0
BLOCK_COPIES = 0
# Runs whose KV cache groups have different block sizes (--group-block-factors).
MIXED_BLOCK_SEEDS = 0
# ... and those whose first attention group has larger blocks than another's (--first-group-factor).
MIXED_LARGER_FIRST = 0
# With --connector in those runs: the allocation hook calls with external tokens, and those where a group's cached
# blocks do not lead its table (a window of blocks smaller than the scheduler block keeps only what an aligned hit
# can use).
MIXED_BLOCK_CONNECTOR = collections.Counter[str]()
# What the Mooncake stand-in answered and reported (lookups, hits, loads, invalid blocks, store jobs), over the
# completed runs of the process.
MOONCAKE_COUNTS = collections.Counter[str]()
# With --cpu-offload: the load and store events and the blocks they copied, the stored ones by their group's kind
# (and those no request held: a window's blocks that left it, recovered from the prefix cache, or a finished
# request's).
OFFLOAD_COUNTS = collections.Counter[str]()
# ... and the UMBP stand-in's.
UMBP_COUNTS = collections.Counter[str]()
# The KV events compared in runs with Mamba groups, by kind and by whether their group is a Mamba group.
MAMBA_EVENT_COUNTS = collections.Counter[str]()


def compare(what: str, a: Any, b: Any) -> None:
    if _plain_equal(a, b):
        return
    d = _diff(what, _norm(a), _norm(b))
    if d:
        raise Divergence(d)


def runner_output(req_ids: list[str], sampled: list[list[int]], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` carrying these requests' sampled tokens (and ``fields``, if any)."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        **fields,
    )


def step_pair(scheds: Sequence[Any], token: int = 9) -> tuple[list[Any], list[Any]]:
    """One synchronous engine step on each scheduler: their ``SchedulerOutput``s compared, every scheduled request
    not in the middle of its prompt sampling ``token``, their ``EngineCoreOutputs`` compared. Returns the
    scheduler outputs and the engine-core outputs, one per scheduler."""
    outs = [s.schedule() for s in scheds]
    compare("SchedulerOutput", outs[0], outs[1])
    results = []
    for s, so in zip(scheds, outs, strict=True):
        ids = list(so.num_scheduled_tokens)
        sampled = [[] if s.requests[r].is_prefill_chunk else [token] for r in ids]
        results.append(s.update_from_output(so, runner_output(ids, sampled)))
    compare("EngineCoreOutputs", results[0], results[1])
    return outs, results


@dataclasses.dataclass
class Config:
    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    async_scheduling: bool = False
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    max_loras: int = 0
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    num_speculative_tokens: int = 0
    speculative_method: str = "ngram"
    per_request_spec_decode_metrics: str = "none"
    use_v2_model_runner: bool = False
    # A RandomKVConnector (kvsched.vllm.testing) with this seed, in the role kv_role: external tokens, async
    # loads finished late, failed or cut by invalid blocks (consumer roles), delayed frees for sends (producer
    # roles).
    kv_connector_seed: int | None = None
    # ... which also reports invalid blocks of synchronous loads (vLLM rolls running requests back).
    kv_connector_sync_invalid: bool = False
    kv_load_failure_policy: str = "recompute"
    kv_role: str = "kv_both"
    # The RandomKVConnector is the second child of vLLM's MultiConnector, after a passive one (it finds no tokens
    # and delays no free); both log their calls.
    kv_connector_multi: bool = False
    # The RandomKVConnector (and the passive one) claims supports_divergent_local_hybrid_hits.
    kv_connector_divergent_hits: bool = False
    # vLLM's SimpleCPUOffloadConnector (eager offload) with a CPU pool of this many blocks, instead of a
    # RandomKVConnector: its loads and stores are reported over by a simulated worker (Pair.offload_transfers).
    cpu_offload_blocks: int | None = None
    # ... in its lazy mode (it walks the GPU free block queue and offloads the blocks next in line for eviction).
    cpu_offload_lazy: bool = False
    # vLLM's MooncakeStoreConnector (role kv_role) with this kv_connector_extra_config, instead of a
    # RandomKVConnector: a stand-in store (MooncakeStandIn) answers its prefix lookups and reports its store jobs
    # and loads.
    mooncake_store: dict[str, Any] | None = None
    # vLLM 0.33's UMBPStoreConnector (role kv_role) with this kv_connector_extra_config, instead of a
    # RandomKVConnector: a stand-in UMBP runtime and workers (UMBPStandIn) answer its lookups and report its store
    # events and loads.
    umbp_store: dict[str, Any] | None = None
    umbp_sync_invalid: bool = False
    # vLLM 0.33's deferred registration of asynchronous loads, set on both built schedulers as vLLM's tests do
    # (vLLM turns it on only with HiSparse, which kvsched.vllm refuses); it acts with defer_block_free.
    defer_async_loads: bool = False
    # KV cache events on (vLLM's kv_events_config): the published batches are compared event by event.
    kv_events: bool = False
    # The model's one KV cache group is a sliding window of this many tokens (None: full attention).
    sliding_window: int | None = None
    # A hybrid model instead: one KV cache group per entry (None: full attention, an int: a sliding window,
    # "chunked:<c>": chunked-local attention, "cross": cross attention, "mamba": a Mamba group, vLLM's
    # mamba_cache_mode "none").
    kv_cache_groups: tuple[int | str | None, ...] | None = None
    # Each KV cache group's block size (a model whose groups' pages differ, after vLLM's engine raised the smaller
    # page's block size; None: block_size for every group). The scheduler block size is then their least common
    # multiple, the requests' hash block their greatest common divisor (with prefix caching).
    group_block_sizes: tuple[int, ...] | None = None
    # vLLM's Mamba cache mode: "align" gives the Mamba groups blocks of block_size tokens and block-aligned prefill
    # chunks.
    mamba_cache_mode: str = "none"
    # The KV cache config's prefix_cache_retention_interval (vLLM's sparse retention of cached Mamba states; None:
    # dense).
    prefix_cache_retention_interval: int | None = None
    # The Mamba groups' prefill checkpoint alignment (vLLM 0.33's Mamba2 and Gated DeltaNet layers in mode "align":
    # MambaSpec's num_prefill_checkpoint_blocks and prefill_checkpoint_alignment; None: none).
    mamba_checkpoint_alignment: int | None = None
    # The KV cache groups marked as an EAGLE/MTP drafter's (vLLM's is_eagle_group; none: vLLM treats all as its).
    eagle_groups: tuple[int, ...] = ()
    # Multi-head latent attention (DeepSeek, Kimi): the full-attention and sliding-window groups' specs are
    # MLAAttentionSpec and SlidingWindowMLASpec.
    mla: bool = False
    # The rows of the "ring" groups' rings (CircularBufferSpec's block size), the full-attention groups' tokens per
    # stored state (compressed attention), and attention groups in bfloat16 beside the rings' float32 (vLLM then
    # zeroes new attention blocks).
    ring_block_size: int = 8
    tokens_per_state: int = 1
    mixed_precision: bool = False
    # A multimodal model (a tiny LLaVA): requests carry images (shared and distinct identifiers).
    multimodal: bool = False
    disable_chunked_mm_input: bool = False
    # Parallel drafting (k - 1 extra query slots per scheduled request, from max_num_batched_tokens) and a token
    # budget below the input budget.
    parallel_drafting: bool = False
    # An EAGLE drafter with vLLM's default prefix-cache rules (look-ahead hashes, or the trailing-block drop with a
    # KV connector and on vLLM 0.32) instead of disable_eagle_block_drop.
    eagle_block_drop: bool = False
    # With eagle_block_drop on vLLM 0.33: its disable_lookahead_block_hashes (the drop without a KV connector).
    lookahead_block_hashes: bool = True
    # The EAGLE drafter is a multi-module MTP one (one module per draft token: vLLM's num_prefill_lookahead_tokens
    # is the number of drafts; its windows keep that many tokens less one below them).
    multi_module_mtp: bool = False
    max_num_scheduled_tokens: int | None = None
    # A RandomECConnector (kvsched.vllm.testing) with this seed: images loaded instead of encoded, requests waiting
    # for images in transit; its calls are compared.
    ec_connector_seed: int | None = None
    # Some requests are streaming-input sessions (resumable), given further parts and ended by the driver.
    streaming: bool = False
    # vLLM's pipeline parallelism: the driver keeps steps in flight as EngineCore's batch queue does.
    pipeline_parallel_size: int = 1
    # vLLM's decode / prefill context parallelism: block_size is then per DCP rank, the scheduler's block (and the
    # requests' hash block) block_size * DCP tokens.
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    # An encoder-decoder model (Whisper-like): a full-attention and a cross-attention KV cache group, encoder-decoder
    # scheduling set on both built schedulers as vLLM's tests do, with this encoder compute budget and
    # EncoderDecoderCacheManager size (small: admissions wait for the budget and the slots).
    encoder_decoder: tuple[int, int] | None = None
    # The requests' hash block (vLLM's hash_block_size, set through prefix_match_unit): a divisor of the block size,
    # with several KV cache groups (None: the scheduler block size).
    hash_block_size: int | None = None


def batch_queue_size(cfg: Config) -> int:
    """The steps vLLM's engine keeps in flight (its ``max_concurrent_batches``): the pipeline-parallel size, plus
    one with async scheduling on model runner V2; without pipeline parallelism 2 with async scheduling, else 1."""
    pp = cfg.pipeline_parallel_size
    if cfg.async_scheduling:
        return pp + 1 if cfg.use_v2_model_runner else max(pp, 2)
    return pp


def random_config(rng: random.Random, *, async_scheduling: bool, v2: bool, block_size: int | None = None) -> Config:
    """A drawn configuration; ``block_size`` replaces the drawn block size (4, 8 or 16), and one above 16 scales
    the drawn model length and token budget with it (lengths of 4 to 16 blocks, as with the drawn sizes)."""
    drawn = rng.choice([4, 8, 16])
    block_size = block_size or drawn
    scale = max(1, block_size // 16)
    max_model_len = rng.choice([64, 128, 256]) * scale
    min_blocks = -(-max_model_len // block_size) + 1
    chunked = rng.random() < 0.8
    budget = (rng.choice([32, 64, 128, 256]) * scale) if chunked else max_model_len + rng.choice([0, 64])
    cfg = Config(
        block_size=block_size,
        # Sometimes a KV cache below one max_model_len request (vLLM's scheduler accepts it; requests are drawn
        # to fit it, as kvsched refuses those that could never fit).
        num_blocks=min_blocks + rng.choice([0, 4, 16, 64]) if rng.random() < 0.8 else max(3, min_blocks // 2),
        max_num_seqs=rng.choice([2, 4, 8, 16]),
        max_num_batched_tokens=max(budget, 1),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.8,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=rng.choice([0, 0, 16, 48]),
        policy=rng.choice(["fcfs", "priority"]),
        async_scheduling=async_scheduling,
        scheduler_reserve_full_isl=rng.random() < 0.7,
        watermark=rng.choice([0.0, 0.0, 0.0, 0.05, 0.2]),
        max_loras=rng.choice([0, 0, 0, 1, 2]),
        # Speculative decoding (n-gram: no lookahead slots) in half the configurations, 1-4 drafts per step.
        num_speculative_tokens=rng.choice([0, 0, 0, 0, 1, 2, 3, 4]),
        # vLLM's V1 runner runs async scheduling only with the GPU n-gram drafter or EAGLE (k lookahead slots).
        speculative_method=rng.choice(["ngram_gpu", "eagle"] if async_scheduling else ["ngram", "ngram_gpu", "eagle"]),
        per_request_spec_decode_metrics=rng.choice(["none", "summary", "detailed"]),  # reset below without spec
        use_v2_model_runner=v2,
    )
    cfg.max_num_active_seqs = rng.choice([None, None, 1, max(1, cfg.max_num_seqs // 2)])
    cfg.long_prefill_token_threshold_adaptive = rng.random() < 0.3
    cfg.prefill_schedule_interval = rng.choice([1, 1, 1, 2, 4])
    return cfg


class _ReadyGrammar:
    """Stands for a compiled grammar: the schedulers only need to know it exists (acceptance is stubbed)."""

    def is_terminated(self) -> bool:
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens  # every draft is valid


def _wait_for_grammar(req: Any) -> None:
    """Make ``req`` a structured-output request whose grammar is not compiled yet."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output.request import StructuredOutputRequest

    req.sampling_params.structured_outputs = StructuredOutputsParams(regex="[ab]+")
    req.structured_output_request = StructuredOutputRequest.from_sampling_params(req.sampling_params)
    req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


class _RecordingPublisher:
    """Stands for vLLM's event publisher: keeps every ``KVEventBatch``'s events."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(list(batch.events))

    def shutdown(self) -> None:
        pass


def _event_fields(event: Any) -> tuple[str, list[tuple[str, Any]]]:
    return (type(event).__name__, [(f, _norm(getattr(event, f))) for f in event.__struct_fields__])


def _count_mixed_block_allocs(calls: list[Any]) -> None:
    """Counts in ``MIXED_BLOCK_CONNECTOR`` the RandomKVConnector's allocation hook calls among ``calls`` (a run with
    KV cache groups of different block sizes)."""
    for call in calls:
        if call[0] != "alloc" or len(call) < 6:
            continue
        MIXED_BLOCK_CONNECTOR["allocations"] += 1
        MIXED_BLOCK_CONNECTOR["with external tokens"] += call[3] > 0
        cached = [[b != 0 and b not in set(u) for b in t] for t, u in zip(call[2], call[4], strict=True)]
        MIXED_BLOCK_CONNECTOR["with cached blocks after uncached ones"] += any(
            not c[k] and t[k] != 0 and any(c[k + 1 :])
            for t, c in zip(call[2], cached, strict=True)
            for k in range(len(t))
        )


def _connectors(sched: Any) -> list[Any]:
    """The RandomKVConnectors of a scheduler's KV connector: itself, or a MultiConnector's children in order."""
    return list(getattr(sched.connector, "sub_connectors", [sched.connector]))


class _RecordingPool:
    """A connector's view of its scheduler's block pool that logs each ``touch`` / ``free_blocks`` (block ids, in
    order) before passing it on; every other attribute is the pool's."""

    def __init__(self, pool: Any, calls: list[tuple[str, list[int]]]) -> None:
        self._pool = pool
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def touch(self, blocks: Any) -> None:
        blocks = list(blocks)
        self.calls.append(("touch", [int(b.block_id) for b in blocks]))
        self._pool.touch(blocks)

    def free_blocks(self, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        self.calls.append(("free_blocks", [int(b.block_id) for b in blocks]))
        self._pool.free_blocks(blocks)


def _mooncake_metadata(meta: Any) -> Any:
    """MooncakeStoreConnector's metadata for the workers in a comparable form: its requests (loads, saves, store
    job ids, block ids and hashes) and the unfinished and preempted request ids."""
    if meta is None:
        return None
    return (
        [_norm(r) for r in meta.requests],
        sorted(meta.unfinished_request_ids),
        sorted(meta.preempted_req_ids or ()),
    )


class _StandInLookupClient:
    """Takes the place of MooncakeStoreConnector's lookup client (a ZMQ client of the lookup server on worker rank
    0): answers from the stand-in's store. An asynchronous lookup (``non_block``) is answered after 0-2 polls
    (drawn per request and lookup, so both schedulers see the same), with the store as it was when first asked."""

    def __init__(self, standin: MooncakeStandIn) -> None:
        self.standin = standin
        self.coord: Any = None  # the connector's MooncakeStoreCoordinator, set once the connector is built
        self.pending: dict[str, list[Any]] = {}  # req_id -> [result, polls left]
        self.asked = collections.Counter[str]()

    def lookup(self, req_id: str, num_tokens: int, block_hashes: Sequence[Any], non_block: bool = False) -> Any:
        entry = self.pending.get(req_id)
        if entry is None:
            n = self.asked[req_id]
            self.asked[req_id] += 1
            polls = random.Random(f"{self.standin.seed}/lookup/{req_id}/{n}").choice([0, 0, 1, 2]) if non_block else 0
            entry = self.pending[req_id] = [self.standin.lookup(self.coord, num_tokens, block_hashes), polls]
        if non_block and entry[1] > 0:
            entry[1] -= 1
            return None
        del self.pending[req_id]
        return entry[0]

    def discard(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def reset(self) -> bool:
        self.standin.keys.clear()
        return True

    def close(self) -> None:
        pass


def _items(d: dict[Any, Any]) -> list[Any]:
    return sorted((k, _norm(v)) for k, v in d.items())


class _StoreStandIn:
    """What the store stand-ins share: both schedulers' connectors, their calls on the block pool, and the
    comparison of both sides after every call."""

    name = ""
    pending: list[list[Any]]  # [steps left, ...]: transfers not reported over yet

    def __init__(self) -> None:
        self.pool_calls: tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]] = ([], [])
        self.schedulers: tuple[Any, Any] | None = None

    def record_pools(self, a: Any, b: Any) -> list[Any]:
        """The built schedulers: each connector's pool logs its calls. Returns their connectors' scheduler halves."""
        self.schedulers = (a, b)
        halves = []
        for sched, calls in zip((a, b), self.pool_calls, strict=True):
            cs = sched.connector.connector_scheduler
            cs._gpu_block_pool = _RecordingPool(cs._gpu_block_pool, calls)
            halves.append(cs)
        return halves

    def compare(self, when: str) -> None:
        """The connector's scheduler-side state on both sides, its calls on the block pool since the last
        comparison, and the pool as it sees it (each block's reference count and block hash)."""
        assert self.schedulers is not None
        a, b = self.schedulers
        compare(f"{when}: {self.name} pool calls", *self.pool_calls)
        for calls in self.pool_calls:
            calls.clear()
        self.compare_connectors(when, a.connector.connector_scheduler, b.connector.connector_scheduler)
        _compare_pools(when, a, b)

    def compare_connectors(self, when: str, ca: Any, cb: Any) -> None:
        raise NotImplementedError

    def take_due(self) -> list[list[Any]]:
        """The pending transfers (``[steps left, ...]``) due now, in order; the others are a step closer."""
        due, left = [], []
        for item in self.pending:
            if item[0] > 0:
                item[0] -= 1
                left.append(item)
            else:
                due.append(item)
        self.pending = left
        return due


class MooncakeStandIn(_StoreStandIn):
    """A stand-in for the Mooncake store and the workers of vLLM's MooncakeStoreConnector, shared by both
    schedulers of a pair (every call on it is made alike for both).

    The store holds block hashes by KV cache group. A lookup finds the longest stored prefix of the request's
    block hashes with the connector's own coordinator (every group's hit, a sliding window's within its window),
    within the block-aligned token count and short of the last token, as the lookup server on worker rank 0 does.
    Each store job of a step's metadata completes 0-3 steps later: the hashes of the blocks it saved (its
    ``token_len_chunk`` tokens, in each group the blocks the coordinator's store mask keeps that the block table
    still holds) enter the store and the job is reported done (``MooncakeStoreWorkerMetadata``, one rank). Each
    load completes 0-2 steps later with asynchronous loads (``finished_recving``, requests still known; one in ten
    with an invalid block among those it loads, in any group), in its own step otherwise. Now and then the store
    evicts a third of its hashes."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(f"mooncake-store/{seed}")
        # The stored (group, hash) keys, in the order they were stored (a dict: the draws over it do not depend on
        # hash values, which vLLM seeds per process).
        self.keys: dict[tuple[int, bytes], None] = {}
        self.coord: Any = None  # the connectors' MooncakeStoreCoordinator (both alike)
        self.load_async = True
        # [steps left, "load", req_id, invalid block or None] or [steps left, "save", store job id, hashes]
        self.pending: list[list[Any]] = []
        self.counts = collections.Counter[str]()
        super().__init__()

    name = "Mooncake"

    @contextlib.contextmanager
    def in_place(self) -> Any:
        """While the schedulers are built: their connectors get a stand-in lookup client."""
        from unittest import mock

        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import scheduler as store_scheduler

        with mock.patch.object(store_scheduler, "LookupKeyClient", lambda vllm_config: _StandInLookupClient(self)):
            yield

    def attach(self, a: Any, b: Any) -> None:
        """The built schedulers: each connector's lookup client gets its coordinator, its pool a call log."""
        for cs in self.record_pools(a, b):
            cs.client.coord = self.coord = cs._store_coord
            self.load_async = cs.load_async

    def lookup(self, coord: Any, num_tokens: int, block_hashes: Sequence[Any]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import ExternalCachedBlockPool
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeLookupResult,
            TailKeyBoundary,
        )

        self.counts["lookups"] += 1
        limit = coord.align_lookup_length(num_tokens)
        if not block_hashes or limit <= 0:
            return MooncakeLookupResult(0)
        stored = ExternalCachedBlockPool(coord.hash_block_size, self.keys.keys())  # type: ignore[arg-type]
        _, hit = coord.find_longest_cache_hit(block_hashes, limit, stored)
        if hit >= num_tokens:  # the last token is computed again, to sample from
            limit = coord.align_lookup_length(num_tokens - 1)
            if limit <= 0:
                return MooncakeLookupResult(0)
            _, hit = coord.find_longest_cache_hit(block_hashes, limit, stored)
        if hit:
            self.counts["hits"] += 1
        return MooncakeLookupResult(hit, (TailKeyBoundary(0, hit),) if hit else ())

    def report(self, meta: Any, known: Callable[[str], bool]) -> Any:
        """What the workers report with the output of the step whose connector metadata is ``meta``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeStoreWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        rng = self.rng
        sizes = [int(g.kv_cache_spec.block_size) for g in self.coord.kv_cache_groups] if self.coord else []
        for r in meta.requests if meta is not None else ():
            spec = r.load_spec
            if spec is not None:
                # The blocks it loads, in every group (not a window's null blocks).
                blocks = [
                    b
                    for table, bs in zip(r.block_ids, sizes, strict=False)
                    for b in table[spec.vllm_cached_tokens // bs : -(-spec.kvpool_cached_tokens // bs)]
                    if b
                ]
                # (Invalid blocks only for asynchronous loads: kvsched.vllm does not roll back the running requests
                # of a synchronous load with invalid blocks, docs/vllm.md.)
                bad = None
                if rng.random() < 0.1 and blocks and self.load_async:
                    bad = rng.choice(blocks)
                self.pending.append([rng.randrange(0, 3) if self.load_async else 0, "load", r.req_id, bad])
            if r.can_save and r.store_job_id is not None:
                self.counts["boundary puts"] += len(r.boundary_puts or ())
                self.pending.append([rng.randrange(0, 4), "save", r.store_job_id, self.saved_keys(r)])
        recving: set[str] = set()
        invalid: set[int] = set()
        failed: set[str] = set()
        saves: dict[int, int] = {}
        for item in self.take_due():
            if item[1] == "load":
                self.counts["loads"] += 1
                if self.load_async and known(item[2]):
                    recving.add(item[2])
                    if item[3] is not None and len(sizes) > 1:
                        # (Several KV cache groups: the workers report the request, vLLM's scheduler refuses
                        # block ids, which are not unique across groups there.)
                        failed.add(item[2])
                        self.counts["failed loads"] += 1
                    elif item[3] is not None:  # (of a request still loading: not of blocks freed since)
                        invalid.add(item[3])
                        self.counts["invalid blocks"] += 1
            else:
                self.counts["store jobs"] += 1
                self.keys.update(dict.fromkeys(item[3]))
                saves[item[2]] = 1
        if self.keys and rng.random() < 0.05:
            for key in rng.sample(list(self.keys), len(self.keys) // 3):
                del self.keys[key]
        if not (recving or invalid or failed or saves):
            return None
        return KVConnectorOutput(
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves=saves) if saves else None,
        )

    def saved_keys(self, r: Any) -> list[tuple[int, bytes]]:
        """The (group, hash) keys a store job of ``r`` (a ``ReqMeta``) saves: its ``token_len_chunk`` tokens cut to
        the coordinator's block size, in each group the blocks its store mask keeps that the job's block table
        holds (a window's null blocks not), each under the group's hash at the block's end."""
        coord = self.coord
        tokens = r.token_len_chunk // coord.lcm_block_size * coord.lcm_block_size
        if tokens <= 0:
            return []
        masks = coord.store_mask(tokens, 0, num_prompt_tokens=r.prefill_end_tokens)
        keys = []
        for g, group in enumerate(coord.kv_cache_groups):
            hashes = coord.block_hashes_for_spec(r.block_hashes, group.kv_cache_spec)
            table, mask = r.block_ids[g], masks[g]
            for i in range(min(tokens // group.kv_cache_spec.block_size, len(hashes), len(table))):
                if table[i] and (mask is None or mask[i]):
                    keys.append((g, bytes(hashes[i])))
        # Blocks stored under the hash of the prefix they end (Mamba boundary states), each group's key.
        for put in r.boundary_puts or ():
            if put.num_tokens % coord.hash_block_size == 0 and 0 < put.num_tokens // coord.hash_block_size <= len(
                r.block_hashes
            ):
                keys.append((put.group_id, bytes(r.block_hashes[put.num_tokens // coord.hash_block_size - 1])))
        return keys

    def compare_connectors(self, when: str, ca: Any, cb: Any) -> None:
        """Load specs, request trackers, unfinished requests, pinned saves, the next store job."""
        compare(f"{when}: Mooncake load specs", _items(ca.load_specs), _items(cb.load_specs))
        compare(f"{when}: Mooncake request trackers", _items(ca._request_trackers), _items(cb._request_trackers))
        compare(
            f"{when}: Mooncake unfinished requests",
            sorted((r, _norm(ids)) for r, (_, ids) in ca._unfinished_requests.items()),
            sorted((r, _norm(ids)) for r, (_, ids) in cb._unfinished_requests.items()),
        )
        compare(
            f"{when}: Mooncake unfinished ids", sorted(ca._unfinished_request_ids), sorted(cb._unfinished_request_ids)
        )
        compare(f"{when}: Mooncake pinned saves", _items(ca._pinned_saves), _items(cb._pinned_saves))
        compare(f"{when}: Mooncake next store job", ca._next_store_job_id, cb._next_store_job_id)
        compare(f"{when}: Mooncake pending push work", ca.has_pending_push_work(), cb.has_pending_push_work())


def _compare_pools(when: str, a: Any, b: Any) -> None:
    """The GPU block pool of both schedulers: free blocks, and each block's reference count and block hash."""
    pa, pb = a.kv_cache_manager.block_pool, b.kv_cache_manager.block_pool
    compare(f"{when}: GPU free blocks", pa.get_num_free_blocks(), pb.get_num_free_blocks())
    compare(
        f"{when}: GPU blocks (ref_cnt, block_hash)",
        [(x.ref_cnt, x.block_hash) for x in pa.blocks if not x.is_null],
        [(x.ref_cnt, x.block_hash) for x in pb.blocks if not x.is_null],
    )


class _StepFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A finished future that answers ``done()`` False for its first ``polls`` calls: a lookup in flight for
    that many polls, the same on both sides."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def done(self) -> bool:
        if self.polls > 0:
            self.polls -= 1
            return False
        return super().done()


class _StepExecutor:
    """Takes the place of UMBPStoreConnector's lookup thread pool: runs each lookup when submitted (the store as
    it is then) and answers it after 0-2 polls, drawn per submission, so both schedulers see the same."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        polls = random.Random(f"{self.seed}/umbp-lookup/{self.submitted}").choice([0, 0, 1, 2])
        self.submitted += 1
        future = _StepFuture(polls)
        try:
            future.set_result(fn(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class _UMBPSchedulerHandle:
    """A scheduler-side handle of the stand-in UMBP runtime: existence of keys in the stand-in store (now and
    then the lookup fails, drawn per call so both sides see the same), and ``clear``."""

    def __init__(self, standin: UMBPStandIn) -> None:
        self.standin = standin
        self.calls = 0

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        standin = self.standin
        n = self.calls
        self.calls += 1
        if random.Random(f"{standin.seed}/umbp-lookup-fails/{n}").random() < 0.03:
            standin.counts["failed lookups"] += 1
            raise RuntimeError("stand-in UMBP lookup failed")
        standin.counts["lookups"] += 1
        hits = [k in standin.keys for k in keys]
        if any(hits):
            standin.counts["lookups with a hit"] += 1
        return hits

    def clear(self) -> bool:
        self.standin.keys.clear()
        return True

    def close(self) -> None:
        pass


class _UMBPRuntime:
    """The stand-in UMBP runtime vLLM's ``UMBPRuntimeFactory`` builds: scheduler handles only (the workers are
    the stand-in's reports)."""

    def __init__(self, standin: UMBPStandIn) -> None:
        self.standin = standin

    def create_scheduler_handle(self, namespace: str, topology: Any, layout: Any) -> _UMBPSchedulerHandle:
        return _UMBPSchedulerHandle(self.standin)

    def create_worker_handle(self, namespace: str, topology: Any, layout: Any) -> Any:
        raise NotImplementedError("the stand-in UMBP runtime has no workers: UMBPStandIn.report plays them")


# The module of vLLM's UMBPStoreConnector (its kv_connector_module_path).
UMBP_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.umbp"
UMBP_NULL_DESTINATION = "UMBP external hit mapped a runtime object to a null destination block"


def _umbp_metadata(meta: Any) -> Any:
    """UMBPStoreConnector's metadata for the workers in a comparable form (loads, stores, preempted requests, the
    store event)."""
    return None if meta is None else _norm(meta)


class UMBPStandIn(_StoreStandIn):
    """A stand-in for the UMBP runtime (registered as vLLM's ``embedded`` UMBP runtime while the schedulers are
    built) and the workers of vLLM's UMBPStoreConnector, shared by both schedulers of a pair (every call on it is
    made alike for both).

    The store holds object keys. A lookup answers whether each key is stored (3% of lookups fail: the connector
    then finds nothing); the connector's asynchronous lookups run on a stepped executor (``_StepExecutor``). Each
    store event of a step's metadata completes 0-3 steps later: its jobs' keys enter the store, except those of a
    job that fails (one in ten events has one; the job of a request preempted since is cancelled, and fails) and
    the event is reported by one worker rank (``UMBPConnectorWorkerMetadata``, its failed objects). Now and then
    another engine publishes the objects of a prefix of a live request's blocks, in every group (a consumer's only
    source). Each
    asynchronous load completes 0-2 steps later (``finished_recving`` for requests still known), with the blocks
    of keys no longer stored (or one in ten loads, a drawn block) invalid; a preempted request's load is
    cancelled. Synchronous loads complete in their step (with ``sync_invalid``, with the blocks of keys no longer
    stored, or one in ten loads a drawn block, invalid: reported with that step's output). Now and then the store
    evicts a third of its keys."""

    name = "UMBP"

    def __init__(self, seed: int, sync_invalid: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(f"umbp-store/{seed}")
        # Synchronous loads report invalid blocks too (drawn from their own stream: the other draws stay).
        self.sync_invalid = sync_invalid
        self.sync_rng = random.Random(f"umbp-sync-invalid/{seed}")
        self.keys: dict[str, None] = {}  # insertion ordered: the draws over it do not depend on hash values
        # [steps left, "load", req_id, BlockLoadBatch] or [steps left, "store", event, [(req_id, plans)], failed]
        self.pending: list[list[Any]] = []
        self.counts = collections.Counter[str]()
        super().__init__()
        self.kv_events = False
        self.groups = 1  # the KV cache groups (with several, a failed load reports its request, not its blocks)
        self.steps = 0
        # Keys this engine's store events published (the runtime reports their evictions to its workers).
        self.local: set[str] = set()

    @contextlib.contextmanager
    def in_place(self) -> Any:
        """While the schedulers are built: vLLM's UMBP runtime registry builds the stand-in's runtime."""
        from unittest import mock

        from vllm.distributed.kv_transfer.kv_connector.v1.umbp.runtime import UMBPRuntimeFactory

        with mock.patch.dict(UMBPRuntimeFactory._builders, clear=True):
            UMBPRuntimeFactory.register("embedded", lambda config: _UMBPRuntime(self))
            yield

    def attach(self, a: Any, b: Any) -> None:
        """The built schedulers: each connector's lookup executor is a stepped one, its pool logs its calls; the
        connector module's clock (it rechecks published objects for KV cache events once a second) is the
        stand-in's, which each step moves on by 0.4 s, so both sides see the same time."""
        from unittest import mock

        from vllm.distributed.kv_transfer.kv_connector.v1.umbp import scheduler as umbp_scheduler

        for cs in self.record_pools(a, b):
            cs._lookup_executor.shutdown(wait=True)
            cs._lookup_executor = _StepExecutor(self.seed)
            self.kv_events = cs.enable_kv_cache_events
            self.groups = len(cs.kv_cache_config.kv_cache_groups)
        if UMBPStandIn._clock is not None:
            UMBPStandIn._clock.stop()  # (the previous pair's)
        UMBPStandIn._clock = mock.patch.object(umbp_scheduler, "time", types.SimpleNamespace(monotonic=self.now))
        UMBPStandIn._clock.start()

    _clock: Any = None

    def now(self) -> float:
        return self.steps * 0.4

    def report(self, meta: Any, known: Callable[[str], bool]) -> Any:
        """What the workers report with the output of the step whose connector metadata is ``meta``."""
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.distributed.kv_transfer.kv_connector.v1.umbp.connector import UMBPStoreKVEvents
        from vllm.distributed.kv_transfer.kv_connector.v1.umbp.data import (
            StoreEventResult,
            UMBPConnectorWorkerMetadata,
        )
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        from vllm.v1.outputs import KVConnectorOutput

        rng = self.rng
        recving: set[str] = set()
        invalid: set[int] = set()
        failed: set[str] = set()
        events: dict[int, Any] = {}
        if meta is not None:
            preempted = set(meta.preempted_request_ids)
            if preempted:  # the workers cancel the preempted requests' jobs
                for item in self.pending:
                    if item[1] == "store":
                        item[4].update(r for r, _ in item[3] if r in preempted)
                self.pending = [i for i in self.pending if not (i[1] == "load" and i[2] in preempted)]
            for req_id, batch in meta.load_requests.items():
                if meta.async_load:
                    self.pending.append([rng.randrange(0, 3), "load", req_id, batch])
                else:
                    self.counts["sync loads"] += 1
                    if self.sync_invalid and known(req_id):
                        # The worker loads it in this step and reports what it could not load with this
                        # step's output: the blocks of keys no longer stored and, one load in ten, a drawn one.
                        bad = {b for k, b in zip(batch.keys, batch.block_ids, strict=True) if k not in self.keys}
                        if batch.block_ids and self.sync_rng.random() < 0.1:
                            bad.add(self.sync_rng.choice(batch.block_ids))
                        invalid |= bad
                        self.counts["sync invalid blocks"] += len(bad)
            if meta.store_event >= 0:
                jobs = [(r, p) for r, p in meta.store_requests.items()]
                jobs += [(p.request_id or "", [p]) for p in meta.store_plans]
                failed: set[str] = set()
                if rng.random() < 0.1:
                    failed.add(rng.choice(jobs)[0])
                self.pending.append([rng.randrange(0, 4), "store", meta.store_event, jobs, failed])
        for item in self.take_due():
            if item[1] == "load":
                self.counts["async loads"] += 1
                batch = item[3]
                bad = {b for k, b in zip(batch.keys, batch.block_ids, strict=True) if k not in self.keys}
                if batch.block_ids and rng.random() < 0.1:
                    bad.add(rng.choice(batch.block_ids))
                if known(item[2]):
                    recving.add(item[2])
                    if bad and self.groups > 1:
                        failed.add(item[2])
                        self.counts["failed loads"] += 1
                    else:
                        invalid |= bad
                        self.counts["invalid blocks"] += len(bad)
            else:
                self.counts["store events"] += 1
                failed_objects = set()
                for req_id, plans in item[3]:
                    if req_id in item[4]:
                        self.counts["failed store jobs"] += 1
                        failed_objects.update((p.group_id, p.block_hash) for p in plans)
                    else:
                        self.keys.update(dict.fromkeys(p.key for p in plans))
                        self.local.update(p.key for p in plans)
                events[item[2]] = StoreEventResult(completed_workers=1, failed_objects=failed_objects)
        if self.schedulers is not None and rng.random() < 0.3:
            # Another engine (a prefill instance) publishes the KV of a prefix of a request's blocks.
            a = self.schedulers[0]
            cs = a.connector.connector_scheduler
            req_ids = sorted(r for r in a.requests if a.requests[r].block_hashes)
            if req_ids:
                hashes = a.requests[rng.choice(req_ids)].block_hashes
                n = rng.randrange(1, len(hashes) + 1)
                self.counts["remote publications"] += 1
                for g in cs.kv_cache_config.prefix_cacheable_group_ids:
                    # Each group's objects are keyed by the hash at the end of each of its lookup units.
                    every = cs._lookup_units[g] // cs.hash_block_size
                    self.keys.update(dict.fromkeys(cs.codec.key(hashes[i], g) for i in range(every - 1, n, every)))
        removed = []
        if self.keys and rng.random() < 0.05:
            for key in rng.sample(list(self.keys), len(self.keys) // 3):
                del self.keys[key]
                if key in self.local:
                    self.local.discard(key)
                    removed.append(key)
        self.steps += 1
        kv_events = None
        if self.kv_events:
            # The worker's events: the locally published objects evicted (the worker reports every step).
            kv_events = UMBPStoreKVEvents(
                [
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(bytes.fromhex(key.rsplit(":", 1)[1]))],
                        medium="CPU",
                        group_idx=int(key.rsplit(":", 2)[1][1:]),
                        locality="LOCAL",
                    )
                    for key in removed
                ]
            )
            self.counts["evictions reported"] += len(removed)
        if not (recving or invalid or failed or events or kv_events):
            return None
        return KVConnectorOutput(
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(store_events=events) if events else None,
            kv_cache_events=kv_events,
        )

    def compare_connectors(self, when: str, ca: Any, cb: Any) -> None:
        """Pending loads and lookups, load specs, request trackers, requests, pending finished stores, store
        events and the next event's id."""
        compare(f"{when}: UMBP pending loads", _items(ca._pending_loads), _items(cb._pending_loads))
        compare(f"{when}: UMBP load specs", _items(ca._load_specs), _items(cb._load_specs))
        compare(f"{when}: UMBP request trackers", _items(ca._request_trackers), _items(cb._request_trackers))
        compare(f"{when}: UMBP requests", sorted(ca._requests), sorted(cb._requests))
        compare(
            f"{when}: UMBP pending lookups",
            sorted((r, p.context.local_tokens, p.context.keys) for r, p in ca._pending_lookups.items()),
            sorted((r, p.context.local_tokens, p.context.keys) for r, p in cb._pending_lookups.items()),
        )
        compare(
            f"{when}: UMBP pending finished stores",
            _items(ca._pending_finished_stores),
            _items(cb._pending_finished_stores),
        )
        compare(f"{when}: UMBP store events", _items(ca._store_events), _items(cb._store_events))
        compare(f"{when}: UMBP next store event", ca._store_event_counter, cb._store_event_counter)
        compare(f"{when}: UMBP pending push work", ca.has_pending_push_work(), cb.has_pending_push_work())


class Pair:
    """vLLM's scheduler (``a``) and kvsched's (``b``) under identical calls."""

    EOS = 2

    def __init__(self, cfg: Config, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        # Draws for the output-packaging dimensions (front-end clients, stats, aborts of requests in a step in
        # flight) come from their own stream, so they leave the scheduling draws of a seed as they are.
        self.rng_out = random.Random(f"outputs/{seed}")
        # Odd runner outputs vLLM's scheduler takes (model_output), from their own stream too.
        self.rng_odd = random.Random(f"odd/{seed}")
        # Streaming-input draws, from their own stream too. The open streaming sessions: id -> the most tokens the
        # streaming session can reach with the parts given so far (its prompt and max_tokens, capped at
        # max_model_len).
        self.rng_stream = random.Random(f"stream/{seed}")
        # The simulated offload worker's delays, from their own stream too: (steps left, "load"/"store", event).
        self.rng_offload = random.Random(f"offload/{seed}")
        self.offload_events: list[tuple[int, str, int, list[str]]] = []
        self.offload_counts = collections.Counter[str]()
        self.sessions: dict[str, int] = {}
        self.stuck: list[str] = []
        # Tokens one block id covers (vLLM's scheduler block size).
        self.kv_block_size = cfg.block_size * cfg.decode_context_parallel_size
        fields = dataclasses.asdict(cfg)
        v2 = fields.pop("use_v2_model_runner")
        window = fields.pop("sliding_window")
        groups = fields.pop("kv_cache_groups")
        defer_async_loads = fields.pop("defer_async_loads")
        fields.pop("streaming")
        enc_dec = fields.pop("encoder_decoder")
        mooncake = fields.pop("mooncake_store")
        umbp = fields.pop("umbp_store")
        umbp_sync_invalid = fields.pop("umbp_sync_invalid")
        # The stand-ins for MooncakeStoreConnector's / UMBPStoreConnector's store and workers (one store, seen by
        # both sides alike).
        self.mooncake = MooncakeStandIn(seed) if mooncake is not None else None
        self.umbp = UMBPStandIn(seed, umbp_sync_invalid) if umbp is not None else None
        for name, extra in (("MooncakeStoreConnector", mooncake), ("UMBPStoreConnector", umbp)):
            if extra is not None:
                fields["kv_transfer"] = {
                    "kv_connector": name,
                    "kv_role": cfg.kv_role,
                    "kv_load_failure_policy": cfg.kv_load_failure_policy,
                    "kv_connector_extra_config": dict(extra),
                }
        if umbp is not None:  # (not in vLLM's connector registry: named by its module)
            fields["kv_transfer"]["kv_connector_module_path"] = UMBP_MODULE
        self.store = self.mooncake or self.umbp
        retention = fields.pop("prefix_cache_retention_interval")
        hash_block_size = fields.pop("hash_block_size")
        group_block_sizes = fields.pop("group_block_sizes")
        checkpoint_alignment = fields.pop("mamba_checkpoint_alignment")
        eagle_groups = fields.pop("eagle_groups")
        mla = fields.pop("mla")
        ring_block_size = fields.pop("ring_block_size")
        tokens_per_state = fields.pop("tokens_per_state")
        mixed_precision = fields.pop("mixed_precision")
        vcfg = make_vllm_config(**fields)
        # The engine core's request block hasher covers the look-ahead tokens vLLM 0.33 keys blocks by.
        self.hash_lookahead = int(getattr(vcfg, "num_hash_lookahead_tokens", 0) or 0)
        # ... and the scheduler's hash block size: with a Mamba group, the least common multiple of the groups'
        # block sizes (a Mamba block holds max_model_len tokens).
        self.hash_block = self.kv_block_size
        if "mamba" in (groups or ()) and cfg.mamba_cache_mode != "align":
            self.hash_block = math.lcm(self.kv_block_size, cfg.max_model_len)
        if hash_block_size is not None:
            self.hash_block = hash_block_size
        if group_block_sizes is not None:
            # vLLM's resolve_kv_cache_block_sizes: the hash block is the groups' greatest common divisor with prefix
            # caching, the scheduler block (their least common multiple) without.
            # (A replayed window takes no part in prefix caching: vLLM leaves its size out of the hash block.)
            hashed = [z for z, g in zip(group_block_sizes, groups or (), strict=True) if not is_replay_group(g)]
            self.hash_block = math.gcd(*hashed) if cfg.enable_prefix_caching else math.lcm(*group_block_sizes)
        # Two front-end clients in some runs (vLLM groups the outputs by client), stats off in some.
        self.num_clients = self.rng_out.choice([1, 1, 2])
        log_stats = self.rng_out.random() < 0.7
        kw = {
            "use_v2_model_runner": v2,
            "include_finished_set": True,
            "log_stats": log_stats,
            "sliding_window": window,
            "kv_cache_groups": groups,
            "prefix_cache_retention_interval": retention,
            "mamba_prefill_checkpoint_alignment": checkpoint_alignment,
            "hash_block_size": hash_block_size,
            "group_block_sizes": group_block_sizes,
            "eagle_groups": eagle_groups,
            "mla": mla,
            "ring_block_size": ring_block_size,
            "tokens_per_state": tokens_per_state,
            "mixed_precision": mixed_precision,
        }
        with self.store.in_place() if self.store is not None else contextlib.nullcontext():
            self.a = make_scheduler("vllm", vcfg, **kw)
            self.b = make_scheduler("kvsched", vcfg, **kw)
        if self.store is not None:
            self.store.attach(self.a, self.b)
        if cfg.kv_connector_divergent_hits:
            _count_diverged_hits(self.a)
        if hash_block_size is not None:
            # Both schedulers (and vLLM's coordinator) hash at the finer unit.
            assert self.a.hash_block_size == self.b.hash_block_size == hash_block_size < self.kv_block_size
            assert self.a.kv_cache_manager.coordinator.hash_block_size == hash_block_size
            global FINER_HASH_SEEDS
            FINER_HASH_SEEDS += 1
        self.ring_zeroing = False
        if "ring" in (groups or ()):
            RING_COUNTS["runs"] += 1
            RING_COUNTS["with a ring first"] += groups[0] == "ring"
            RING_COUNTS["with compressed attention"] += tokens_per_state > 1
            self.ring_zeroing = "mamba" not in groups and self.a.kv_cache_config.needs_kv_cache_zeroing
            RING_COUNTS["zeroing for mixed precisions"] += self.ring_zeroing
        if group_block_sizes is not None and len(set(group_block_sizes)) > 1:
            # vLLM's scheduler runs at the least common multiple, both hash at the greatest common divisor.
            assert self.a.block_size == self.b.block_size == math.lcm(*group_block_sizes)
            global MIXED_BLOCK_SEEDS, MIXED_LARGER_FIRST
            MIXED_BLOCK_SEEDS += 1
            cached = [z for z, g in zip(group_block_sizes, groups or (), strict=True) if not isinstance(g, str)]
            MIXED_LARGER_FIRST += cached[0] > min(cached)
        if defer_async_loads:
            self.a.defer_async_loads = self.b.defer_async_loads = True
        # kvsched's steady decoding cohorts form after some steady steps; in most runs after one, so that they
        # form and break often (drawn from their own stream).
        self.b._cohort_after = random.Random(f"cohort/{seed}").choice([1, 1, 2, self.b._cohort_after])
        if enc_dec is not None:
            from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager

            for sched in (self.a, self.b):
                sched.is_encoder_decoder = True
                sched.max_num_encoder_input_tokens = enc_dec[0]
                sched.encoder_cache_manager = EncoderDecoderCacheManager(cache_size=enc_dec[1])
        self.prefixes = [[self.rng.randrange(3, 500) for _ in range(self.rng.randrange(8, 64))] for _ in range(3)]
        # Multimodal: each prefix has an image at a fixed place (its identifier drawn per request from a small
        # pool, so equal prefix tokens come with the same image or another one).
        # (Drawn only for a multimodal run, so that the other runs' seeds keep their draws.)
        self.prefix_images = (
            [(self.rng.randrange(0, max(1, len(p) - 8)), self.rng.randrange(2, 5)) for p in self.prefixes]
            if cfg.multimodal
            else []
        )
        self.next_id = 0
        self.clock = 0.0
        # (vllm SchedulerOutput, kvsched SchedulerOutput, ids whose step is a partial prefill)
        self.in_flight: list[tuple[Any, Any, set[str]]] = []
        self.queue_size = batch_queue_size(cfg)
        self.max_in_flight = 0
        self.steps = 0
        # Structured-output requests whose grammar is still compiling: (vLLM's request, kvsched's request).
        self.compiling: list[tuple[Any, Any]] = []
        self.publishers: list[_RecordingPublisher] = []
        self.num_events = 0
        if cfg.kv_events:
            for sched in (self.a, self.b):
                sched.kv_event_publisher = _RecordingPublisher()
                self.publishers.append(sched.kv_event_publisher)
        for sched in (self.a, self.b):
            # The sampled tokens are random: the grammar accepts whatever it is given (no real compiler here).
            sched.structured_output_manager.accept_tokens = lambda request, tokens: True

    # ---- operations ------------------------------------------------------------------------------------

    def add_random_request(self) -> None:
        rng, cfg = self.rng, self.cfg
        rid = f"r{self.next_id}"
        self.next_id += 1
        room = cfg.max_model_len - 1
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.6 else []
        prompt += [rng.randrange(3, 500) for _ in range(rng.randrange(1, 80))]
        prompt = prompt[: rng.randrange(1, room)] if len(prompt) >= room else prompt
        max_tokens = rng.randrange(1, 40)
        capacity = self._capacity()
        prompt = prompt[:capacity]
        max_tokens = max(1, min(max_tokens, capacity + 1 - len(prompt)))
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": rng.choice([0, 0, 0, min(3, max_tokens)]),
            "eos_token_id": self.EOS if rng.random() < 0.5 else None,
            "stop_token_ids": [7] if rng.random() < 0.2 else [],
            "priority": rng.randrange(0, 3) if cfg.policy == "priority" else 0,
            "arrival_time": self.clock + (rng.choice([0.0, 0.5]) if rng.random() < 0.2 else 0.0),
            "cache_salt": rng.choice([None, None, None, "salt"]),
            "lora_name": rng.choice([None, None, "ada", "bob", "cy"]) if cfg.max_loras else None,
            "block_size": self.hash_block,
            "hash_lookahead_tokens": self.hash_lookahead,
            # Prompt logprobs: vLLM skips reading the prefix cache for the request.
            "prompt_logprobs": 1 if rng.random() < 0.1 else None,
            "client_index": self.rng_out.randrange(self.num_clients),
        }
        if cfg.multimodal:
            kwargs["images"] = self.random_images(prompt)
        elif cfg.encoder_decoder is not None:
            kwargs["images"] = self.random_encoder_inputs(cfg.encoder_decoder[0])
        self.clock += 1.0
        compiling = rng.random() < 0.15
        if cfg.streaming and not compiling and self.rng_stream.random() < 0.5:
            # A streaming-input session (kvsched refuses one that waits for its grammar).
            kwargs["resumable"] = True
            self.sessions[rid] = min(len(prompt) + max_tokens, cfg.max_model_len)
        ra, rb = make_request(rid, prompt, **kwargs), make_request(rid, prompt, **kwargs)
        if compiling:
            # A structured-output request whose grammar is still compiling, as vLLM's engine core adds it.
            for req in (ra, rb):
                _wait_for_grammar(req)
            self.compiling.append((ra, rb))
        self.a.add_request(ra)
        self.b.add_request(rb)
        self.check_state(f"add_request({rid})")

    def _capacity(self) -> int:
        """The most tokens a request is drawn to reach, less one: a KV cache smaller than max_model_len takes
        only requests that fit it (prompt + max_tokens - 1 tokens)."""
        cfg = self.cfg
        # (With several KV cache groups, every group may need a block per block of tokens; a Mamba group instead
        # takes 1 + num_speculative_blocks state blocks per request, whatever its length.)
        groups = cfg.kv_cache_groups or (None,)
        num_mamba = groups.count("mamba")
        pool = cfg.num_blocks - 1 - num_mamba * (1 + cfg.num_speculative_tokens)
        capacity = pool // (len(groups) - num_mamba) * self.kv_block_size
        if cfg.num_speculative_tokens and capacity < cfg.max_model_len:
            # Room for the drafts (and placeholders) past the last token: in a cache below max_model_len, vLLM
            # pads a resumed decode near the cache's end to 1 + k tokens it can never allocate (it livelocks);
            # kvsched does not pad it (docs/semantics.md). With async scheduling, a step in flight adds up to
            # 1 + k placeholders on top: a request may then ask for up to longest + 3k + 1 slots, where vLLM
            # preempts it (no 16th block) and kvsched caps its slots at the cache (docs/semantics.md, "Requests
            # that could never fit"). Requests are drawn clear of that end.
            # (Each further step in flight, with pipeline parallelism, adds as many again.)
            k = cfg.num_speculative_tokens + (cfg.speculative_method == "dflash")  # DFlash: one slot more
            capacity -= (batch_queue_size(cfg) + 1) * (k + 1)
        if not cfg.enable_chunked_prefill and (cfg.parallel_drafting or cfg.max_num_scheduled_tokens):
            # Without chunked prefill a request must fit the most tokens one step gives it (kvsched refuses the
            # others; vLLM would hold them at the head of its queue forever).
            slots = cfg.num_speculative_tokens - 1 if cfg.parallel_drafting else 0
            tokens = cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens
            capacity = min(capacity, tokens, cfg.max_num_batched_tokens - slots)
        return capacity

    def stream_input(self, rid: str | None = None, finish: bool | None = None) -> None:
        """The next part of a streaming-input session (drawn among the open ones), or the end of its input: a
        request of the streaming session's id, resumable or not, given to both schedulers' ``add_request``."""
        rng = self.rng_stream
        for gone in [r for r in self.sessions if r not in self.a.requests or self.a.requests[r].is_finished()]:
            del self.sessions[gone]  # finished (aborted, or its input ended; its blocks may wait for a KV send)
        if rid is None:
            if not self.sessions:
                return
            rid = rng.choice(sorted(self.sessions))
        if finish is None:
            finish = rng.random() < 0.2
        cfg = self.cfg
        session = self.a.requests[rid]
        # The most tokens the streaming session can hold before the part: exact while it waits for input.
        reach = session.num_tokens if session.status.name == "WAITING_FOR_STREAMING_REQ" else self.sessions[rid]
        part = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 24))]
        prompt_len = reach - 1 + len(part)
        limit = min(cfg.max_model_len - 1, self._capacity())
        if not finish and prompt_len > limit:
            part = part[: max(0, limit - (reach - 1))]
            prompt_len = reach - 1 + len(part)
            finish = not part  # no room for another part: the input ends
        if finish:
            kwargs: dict[str, Any] = {"resumable": False, "block_size": self.hash_block}
            part = [rng.randrange(3, 500)]
            del self.sessions[rid]
        else:
            max_tokens = max(1, min(rng.randrange(1, 24), self._capacity() + 1 - prompt_len))
            self.sessions[rid] = min(prompt_len + max_tokens, cfg.max_model_len)
            kwargs = {
                "resumable": True,
                "max_tokens": max_tokens,
                "eos_token_id": self.EOS if rng.random() < 0.5 else None,
                "stop_token_ids": [7] if rng.random() < 0.2 else [],
                # Under the priority policy a part keeps the streaming session's arrival time: vLLM changes the
                # arrival time (a heap key) of a request inside its waiting heap, so its order then depends on the
                # heap's layout, where kvsched keeps the key the streaming session was queued with (docs/vllm.md,
                # Streaming input).
                "arrival_time": session.arrival_time if cfg.policy == "priority" else self.clock,
                "block_size": self.hash_block,
            }
        self.clock += 1.0
        self.a.add_request(make_request(rid, part, **kwargs))
        self.b.add_request(make_request(rid, part, **kwargs))
        # (vLLM 0.32's scheduler has no has_request: its requests dict answers.)
        known = self.a.has_request(rid) if hasattr(self.a, "has_request") else rid in self.a.requests
        compare(f"has_request({rid})", known, self.b.has_request(rid))
        self.check_state(f"{'finish_input' if finish else 'append_input'}({rid})")

    # Images: identifiers img0..img5 are shared across requests, the rest are unique. An identifier always has
    # the same length (vLLM refuses a request whose cached entry's size differs). Lengths stay within the tiny
    # LLaVA's 16 tokens per image, the smallest encoder budget vLLM derives for it.
    _SHARED_IMAGES = 6

    @staticmethod
    def _image_length(identifier: str) -> int:
        return 2 + sum(map(ord, identifier)) % 14

    def random_images(self, prompt: list[int]) -> list[tuple[int, int, str]]:
        rng = self.rng
        images: list[tuple[int, int, str]] = []
        start = 0
        for prefix, (at, pool) in zip(self.prefixes, self.prefix_images, strict=True):
            if prompt[: len(prefix)] == prefix and rng.random() < 0.8:
                identifier = f"img{rng.randrange(pool)}"
                length = self._image_length(identifier)
                if at + length <= len(prompt):
                    images.append((at, length, identifier))
                    start = at + length
                break
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if rng.random() < 0.5:
                identifier = f"img{rng.randrange(self._SHARED_IMAGES)}"
            else:
                identifier = f"u{self.next_id}-{len(images)}"
            length = self._image_length(identifier)
            if start + length > len(prompt):
                break
            offset = rng.randrange(start, len(prompt) - length + 1)
            images.append((offset, length, identifier))
            start = offset + length
        return images

    def random_encoder_inputs(self, budget: int) -> list[tuple[int, int, str]]:
        """An encoder-decoder request's encoder inputs (all at position 0, as vLLM's encoder-decoder models place
        them): none, or one or two whose tokens together fit the encoder budget (a request above it would never
        be scheduled by vLLM; kvsched.vllm finishes it with an error)."""
        rng = self.rng
        k = rng.choice([0, 1, 1, 1, 2])
        total = rng.randrange(max(k, budget // 3), budget + 1) if k else 0
        sizes = [total] if k == 1 else ([(cut := rng.randrange(1, total)), total - cut] if k == 2 else [])
        return [(0, size, f"enc{self.next_id}-{i}") for i, size in enumerate(sizes)]

    def grammar_ready(self, everything: bool = False) -> None:
        """The grammar of one (or every) compiling request is ready: vLLM's StructuredOutputManager sets it on
        the request between steps; each scheduler sees it at its next schedule()."""
        while self.compiling:
            ra, rb = self.compiling.pop(self.rng.randrange(len(self.compiling)))
            for req in (ra, rb):
                req.structured_output_request.grammar = _ReadyGrammar()
            if not everything:
                break

    def abort_random(self) -> None:
        live = sorted(self.a.requests)
        if not live:
            return
        ids = self.rng.sample(live, k=min(len(live), self.rng.randrange(1, 3)))
        if self.rng.random() < 0.2:
            ids.append("unknown-id")
        from vllm.v1.request import RequestStatus

        ra = self.a.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        rb = self.b.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        compare("finish_requests", [r.request_id for r in ra], [r.request_id for r in rb])
        self.check_state(f"finish_requests({ids})")

    def abort_resident_session(self) -> None:
        """In the drain, after a step that scheduled nothing: streaming-input sessions that kept their KV while
        waiting can hold so much of the KV cache that none of them can resume (both schedulers then wait
        forever, as vLLM's own does); the driver aborts the first such session, as a client would give up."""
        from vllm.v1.request import RequestStatus

        for rid, request in self.a.requests.items():
            if request.resumable and request.num_computed_tokens > 0 and request.status == RequestStatus.WAITING:
                ra = self.a.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                rb = self.b.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                compare("finish_requests (resident session)", [r.request_id for r in ra], [r.request_id for r in rb])
                self.check_state(f"finish_requests({rid}) resident session")
                return

    def abort_in_flight(self) -> None:
        """Abort requests of the newest step in flight, as the engine does when a client disconnects while the
        model runs (its output then arrives for requests that are already gone)."""
        scheduled = sorted(self.in_flight[-1][0].num_scheduled_tokens) if self.in_flight else []
        if not scheduled:
            return
        rng = self.rng_out
        ids = scheduled if rng.random() < 0.3 else rng.sample(scheduled, k=rng.randrange(1, len(scheduled) + 1))
        from vllm.v1.request import RequestStatus

        ra = self.a.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        rb = self.b.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        compare("finish_requests (in flight)", [r.request_id for r in ra], [r.request_id for r in rb])
        self.check_state(f"finish_requests({ids}) in flight")

    def pause_or_resume(self) -> None:
        from vllm.v1.core.sched.interface import PauseState

        states = [PauseState.UNPAUSED, PauseState.UNPAUSED, PauseState.PAUSED_NEW, PauseState.PAUSED_ALL]
        state = self.rng.choice(states)
        self.a.set_pause_state(state)
        self.b.set_pause_state(state)
        compare("pause_state", self.a.pause_state, self.b.pause_state)
        self.check_state(f"set_pause_state({state.name})")

    def reset_prefix_cache(self) -> None:
        reset_running = self.rng.random() < 0.5
        kw = {}
        if self.mooncake is not None:
            # Not the running requests: vLLM's MooncakeStoreConnector fails (TypeError or AssertionError in
            # build_connector_meta) when a request the reset preempted is scheduled again in the next step, as it
            # drops the request it was just told about (update_state_after_alloc) for being in preempted_req_ids.
            reset_running = False
        # Sometimes the store is reset too (drawn from the stand-in's stream).
        if self.store is not None and self.store.rng.random() < 0.5:
            kw["reset_connector"] = True
        # With KV transfers holding blocks, a reset that preempts every running request still fails: vLLM raises.
        ra = rb = "raised"
        with contextlib.suppress(RuntimeError):
            ra = self.a.reset_prefix_cache(reset_running_requests=reset_running, **kw)
        with contextlib.suppress(RuntimeError):
            rb = self.b.reset_prefix_cache(reset_running_requests=reset_running, **kw)
        compare(f"reset_prefix_cache({reset_running})", ra, rb)
        self.check_state(f"reset_prefix_cache({reset_running})")

    def schedule(self) -> None:
        # Sometimes a step vLLM's data-parallel coordinator marks throttled (prefill balancing).
        throttle = self.rng.random() < 0.15
        try:
            so_a = self.a.schedule(throttle_prefills=throttle)
        except AssertionError as exc:
            if isinstance(exc, Divergence):
                raise
            # A bug of vLLM's own scheduler (vLLM 0.32 can count fewer LoRAs than are running and then assert that
            # a step stays within max_loras): nothing to compare against from here on.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            so_b = self.b.schedule(throttle_prefills=throttle)
            loras = {
                self.b.requests[rid].lora_request.lora_int_id
                for rid in so_b.num_scheduled_tokens
                if self.b.requests[rid].lora_request is not None
            }
            raise VllmStopped(
                f"step {self.steps}: vLLM's scheduler failed its assertion `{frame.line}` "
                f"({Path(frame.filename).name}:{frame.lineno}); kvsched's step there schedules {len(loras)} LoRAs "
                f"(max_loras {self.cfg.max_loras})"
            ) from exc
        except ValueError as exc:
            # A bug of vLLM's own scheduler: an align-mode Mamba group's count of a new request's blocks leaves out
            # the block its KV load's state takes, and the pool runs dry (block_pool.get_new_blocks raises); the
            # core fails that allocation instead. Nothing to compare against from here on.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            if not str(exc).startswith("Cannot get") or self.cfg.mamba_cache_mode != "align":
                raise
            self.b.schedule(throttle_prefills=throttle)
            raise VllmStopped(
                f"step {self.steps}: vLLM's scheduler raised `{exc}` ({Path(frame.filename).name}:{frame.lineno}), "
                "its align-mode Mamba count one block short after a KV load; kvsched's step there goes on (the core "
                "fails an allocation its pool cannot hold)"
            ) from exc
        except RuntimeError as exc:
            # A bug of vLLM's UMBP connector: for a sliding window of one token the window group's prefix hit ends
            # on a block the window no longer needs, which the allocation of the external tokens leaves null, and
            # the connector's load plan raises on that null destination. kvsched drives the same connector with
            # the same blocks, so its step must raise the same.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            if self.umbp is None or not str(exc).startswith(UMBP_NULL_DESTINATION):
                raise
            groups = self.cfg.kv_cache_groups or (self.cfg.sliding_window,)
            windows = sorted({g for g in groups if isinstance(g, int)})
            try:
                self.b.schedule(throttle_prefills=throttle)
            except RuntimeError as exc_b:
                compare(f"step {self.steps} UMBP connector raise", str(exc), str(exc_b))
            else:
                raise Divergence(
                    f"step {self.steps}: vLLM's UMBP connector raised `{exc}`, kvsched's step went on"
                ) from exc
            raise VllmStopped(
                f"step {self.steps}: vLLM's UMBP connector raised `{exc}` ({Path(frame.filename).name}:"
                f"{frame.lineno}), windows of {windows} tokens; kvsched's step raised the same"
            ) from exc
        so_b = self.b.schedule(throttle_prefills=throttle)
        compare(f"step {self.steps} SchedulerOutput", so_a, so_b)
        if self.ring_zeroing:
            RING_COUNTS["blocks zeroed there"] += len(so_a.new_block_ids_to_zero or ())
        for new in so_a.scheduled_new_reqs:
            if getattr(new, "replay_start", 0):
                REPLAY_COUNTS["admissions replaying"] += 1
        if self.mooncake is not None:
            compare(
                f"step {self.steps} MooncakeStoreConnector metadata",
                _mooncake_metadata(so_a.kv_connector_metadata),
                _mooncake_metadata(so_b.kv_connector_metadata),
            )
        if self.umbp is not None:
            compare(
                f"step {self.steps} UMBPStoreConnector metadata",
                _umbp_metadata(so_a.kv_connector_metadata),
                _umbp_metadata(so_b.kv_connector_metadata),
            )
        global PREFIX_HITS, PARTIAL_BLOCK_HITS, BLOCK_COPIES
        PREFIX_HITS += sum(r.num_computed_tokens > 0 for r in so_a.scheduled_new_reqs)
        PARTIAL_BLOCK_HITS += sum(r.num_computed_tokens % self.a.block_size > 0 for r in so_a.scheduled_new_reqs)
        BLOCK_COPIES += len(getattr(so_a, "kv_cache_block_copies", None) or ())
        # What the runner will sample is decided now: a request whose step is a partial prefill gets nothing
        # (read right after schedule(), before a later step changes the flag).
        chunks = {rid for rid in so_a.num_scheduled_tokens if self.a.requests[rid].is_prefill_chunk}
        self.in_flight.append((so_a, so_b, chunks))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        self.check_state(f"step {self.steps} schedule")

    def engine_step(self) -> None:
        """One call of vLLM's ``EngineCore.step_with_batch_queue`` (pipeline parallelism): a step is scheduled
        while the scheduler has requests; the oldest step in flight is applied only once the queue is full, or
        the step scheduled nothing and nothing is left to schedule. A step whose sampling waits for the previous
        step's tokens (``pending_structured_output_tokens``) joins the queue after the oldest step is applied."""
        compare(f"step {self.steps} has_requests", self.a.has_requests(), self.b.has_requests())
        if self.a.has_requests():
            self.schedule()
            if self.rng_out.random() < 0.05:
                self.abort_in_flight()
            so = self.in_flight[-1][0]
            if not so.pending_structured_output_tokens:
                executed = so.total_num_scheduled_tokens > 0
                if len(self.in_flight) < self.queue_size and (executed or self.a.has_requests()):
                    return
            elif len(self.in_flight) == 1:
                return  # (placeholders mean an earlier step is in flight: not reached)
        elif not self.in_flight:
            return
        self.update_oldest()

    def random_token(self) -> int:
        r = self.rng.random()
        return self.EOS if r < 0.06 else (7 if r < 0.09 else self.rng.randrange(3, 500))

    def model_output(self, so: Any, chunks: set[str]) -> Any:
        """Sampled tokens for every scheduled request whose step completes its known tokens: with drafts
        scheduled, a random number of them accepted (a -1 draft never is; a placeholder's value is the
        runner's, so random), then one more token."""

        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        spec = so.scheduled_spec_decode_tokens
        for rid in req_ids:
            if rid in chunks:
                sampled.append(self.odd_output(rid, True, 0, []))
                continue
            drafts = spec.get(rid, ())
            accepted = self.rng.randrange(0, len(drafts) + 1) if drafts else 0
            tokens: list[int] = []
            for d in drafts[:accepted]:
                if d < 0 and not self.cfg.async_scheduling:
                    break  # n-gram padding: rejected
                tokens.append(d if d >= 0 else self.random_token())
            tokens.append(self.random_token())
            sampled.append(self.odd_output(rid, False, len(drafts), tokens))
        return runner_output(
            req_ids,
            sampled,
            kv_connector_output=(
                self.store.report(so.kv_connector_metadata, lambda rid: rid in self.a.requests)
                if self.store is not None
                else self.offload_transfers(so)
                if self.cfg.cpu_offload_blocks is not None
                else self.transfers(so)
                if self.cfg.kv_connector_seed is not None
                else None
            ),
        )

    def odd_output(self, rid: str, chunk: bool, num_drafts: int, tokens: list[int]) -> list[int]:
        """Now and then, what a mock runner returns that vLLM's own runners would not and vLLM's scheduler takes
        all the same: tokens for a partial prefill (synchronous only), more than 1 + the drafts scheduled (up to 1 +
        num_speculative_tokens, which the KV slots allocated for the step hold; without drafts, synchronous
        only: vLLM's asynchronous scheduler asserts that its placeholders stay non-negative), or nothing for a
        decode (its request then has nothing left to schedule, as in vLLM: it is aborted after the update, as
        the engine does for a request whose output failed)."""
        if RULES.version == "0.32":
            # Compared on vLLM 0.33 only: on 0.32, after empty decode outputs, a later prefill's
            # num_cache_creation_tokens can differ (vLLM 0, kvsched 1), not explained yet.
            return tokens
        rng = self.rng_odd
        if rng.random() >= 0.03:
            return tokens
        k = self.cfg.num_speculative_tokens or 0
        if chunk:
            if self.cfg.async_scheduling:  # vLLM's placeholders of the step after it would go negative
                return tokens
            return [self.random_token() for _ in range(rng.randrange(1, 3))]
        r = rng.random()
        if r < 0.4:
            self.stuck.append(rid)
            return []
        if num_drafts and len(tokens) < 1 + k:
            # Tokens beyond the drafts count as computed: no further than the KV slots the request holds
            # (past them vLLM would count computed tokens it has no KV for; kvsched refuses the output).
            request = self.a.requests.get(rid)
            if request is None or request.is_finished():
                return tokens
            # (The blocks of the first attention group of the smallest blocks that is not a ring or a replayed
            # window, at its block size: a Mamba group holds its state blocks whatever the length, a ring one block,
            # a replayed window's blocks may be smaller, a group of larger blocks may cover more slots.)
            groups = self.cfg.kv_cache_groups or (None,)
            sizes = self.cfg.group_block_sizes or (self.kv_block_size,) * len(groups)
            candidates = [g for g, w in enumerate(groups) if w not in ("mamba", "ring") and not is_replay_group(w)]
            attention = min(candidates, key=lambda g: sizes[g])
            size = sizes[attention]
            slots = len(self.a.kv_cache_manager.get_block_ids(rid)[attention]) * size
            room = min(1 + k - len(tokens), slots - (request.num_computed_tokens - num_drafts + len(tokens) - 1))
            if room > 0:
                return tokens + [self.random_token() for _ in range(rng.randrange(1, 1 + room))]
            return tokens
        if not num_drafts and not self.cfg.async_scheduling:
            return tokens + [self.random_token() for _ in range(rng.randrange(1, 3))]
        return tokens

    def transfers(self, so: Any) -> Any:
        """What the workers report about KV transfers with the output of step ``so``
        (``RandomKVConnector.report``: loads started by that step or earlier over, failed whole or with an
        invalid block; sends over). Each connector forgets what is reported when its scheduler hands it the
        report."""
        meta = so.kv_connector_metadata
        if self.cfg.kv_connector_multi:
            # MultiConnector's metadata holds its children's, in order: the RandomKVConnector is the last.
            meta = meta.metadata[-1] if meta is not None else None
        return _connectors(self.a)[-1].report(self.rng, meta, self.kv_block_size)

    def offload_transfers(self, so: Any) -> Any:
        """What SimpleCPUOffloadConnector's workers report with the output of step ``so``: the load and store
        events its metadata started finish after 0-2 more steps (drawn), as the worker's ``get_finished`` reports
        them: the requests of each finished load event that are still known (vLLM asserts on others), and each
        finished store event once (one worker)."""
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        meta = so.kv_connector_metadata
        rng = self.rng_offload
        if meta is not None:
            self.count_offload(meta)
            if meta.load_event >= 0:
                reqs = list(meta.load_event_to_reqs.get(meta.load_event, ()))
                self.offload_events.append((rng.randrange(0, 3), "load", meta.load_event, reqs))
            if meta.store_event >= 0:
                self.offload_events.append((rng.randrange(0, 3), "store", meta.store_event, []))
        recving: set[str] = set()
        stores: dict[int, int] = {}
        left = []
        for wait, kind, event, reqs in self.offload_events:
            if wait > 0:
                left.append((wait - 1, kind, event, reqs))
            elif kind == "load":
                recving.update(r for r in reqs if r in self.a.requests)
                self.offload_counts["loads"] += 1
            else:
                stores[event] = 1
                self.offload_counts["stores"] += 1
        self.offload_events = left
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=stores) if stores else None,
        )

    def count_offload(self, meta: Any) -> None:
        """Counts a step's offload metadata on vLLM's side (``OFFLOAD_COUNTS``)."""
        from vllm.v1.core.kv_cache_utils import get_group_id

        if meta.load_event >= 0:
            OFFLOAD_COUNTS["load events"] += 1
            OFFLOAD_COUNTS["loaded blocks"] += len(meta.load_gpu_blocks)
        if meta.store_event >= 0:
            OFFLOAD_COUNTS["store events"] += 1
            groups = self.cfg.kv_cache_groups or (self.cfg.sliding_window,)
            blocks = self.a.kv_cache_manager.block_pool.blocks
            for bid in meta.store_gpu_blocks:
                block = blocks[bid]
                g = get_group_id(block.block_hash) if block.block_hash is not None else 0
                kind = "window" if isinstance(groups[g], int) else "Mamba" if groups[g] == "mamba" else "full attention"
                OFFLOAD_COUNTS[f"stored blocks ({kind})"] += 1
                if block.ref_cnt == 1:
                    OFFLOAD_COUNTS[f"stored blocks no request held ({kind})"] += 1

    def compare_offload(self, when: str) -> None:
        """SimpleCPUOffloadConnector's scheduler-side state on both sides, and the GPU pool as it sees it: each
        block's reference count and vLLM block hash."""
        ma, mb = self.a.connector.scheduler_manager, self.b.connector.scheduler_manager
        if ma is None:
            return
        compare(f"{when}: offload loads", sorted(ma._reqs_to_load), sorted(mb._reqs_to_load))
        compare(
            f"{when}: offload stores",
            {e: (t.gpu_block_ids, t.cpu_block_ids) for e, t in ma._store_event_to_blocks.items()},
            {e: (t.gpu_block_ids, t.cpu_block_ids) for e, t in mb._store_event_to_blocks.items()},
        )
        compare(f"{when}: offload pending hits", sorted(ma._pending_cpu_hits), sorted(mb._pending_cpu_hits))
        compare(
            f"{when}: CPU free blocks", ma.cpu_block_pool.get_num_free_blocks(), mb.cpu_block_pool.get_num_free_blocks()
        )
        compare(f"{when}: boundary stats", ma.boundary_store_stats, mb.boundary_store_stats)
        pa, pb = self.a.kv_cache_manager.block_pool, self.b.kv_cache_manager.block_pool
        compare(f"{when}: GPU free blocks", pa.get_num_free_blocks(), pb.get_num_free_blocks())
        blocks_a, blocks_b = pa.blocks, pb.blocks
        if RULES.version == "0.32":
            # vLLM 0.32's pool counts references of its null block (touch adds one, a window's frees of its null
            # blocks take them off: it goes below 0), a count it calls not maintained and never reads: left out.
            blocks_a, blocks_b = blocks_a[1:], blocks_b[1:]
        compare(
            f"{when}: GPU blocks (ref_cnt, block_hash, block_hash_num_tokens)",
            [(x.ref_cnt, x.block_hash, x.block_hash_num_tokens) for x in blocks_a],
            [(x.ref_cnt, x.block_hash, x.block_hash_num_tokens) for x in blocks_b],
        )

    def update_oldest(self) -> None:
        so_a, so_b, chunks = self.in_flight.pop(0)
        mro = self.model_output(so_a, chunks)
        out_a = self.a.update_from_output(so_a, copy.deepcopy(mro))
        out_b = self.b.update_from_output(so_b, copy.deepcopy(mro))
        compare(f"step {self.steps} EngineCoreOutputs", out_a, out_b)
        if self.publishers:
            pa, pb = self.publishers
            compare(f"step {self.steps} KV event batches", len(pa.batches), len(pb.batches))
            if pa.batches:
                self.num_events += len(pa.batches[-1])
                batch_a, batch_b = pa.batches.pop(), pb.batches.pop()
                groups = self.cfg.kv_cache_groups or ()
                if "mamba" in groups:
                    for event in batch_a:
                        g = getattr(event, "group_idx", None)
                        where = "Mamba" if g is not None and groups[g] == "mamba" else "attention"
                        MAMBA_EVENT_COUNTS[f"{type(event).__name__} ({where})"] += 1
                sizes = self.cfg.group_block_sizes or ()
                if len(set(sizes)) > 1:
                    # Groups of different block sizes: the stored runs of blocks larger than the hash block, the
                    # prompt tail entries (one hash block in a group of larger blocks) and the removals.
                    for event in batch_a:
                        g = getattr(event, "group_idx", None)
                        if g is None or sizes[g] == sizes[0]:
                            continue
                        if type(event).__name__ == "BlockStored":
                            kind = "stored runs of larger blocks" if event.block_size == sizes[g] else "tail entries"
                            MAMBA_EVENT_COUNTS[kind] += 1
                        elif type(event).__name__ == "BlockRemoved":
                            MAMBA_EVENT_COUNTS["removals of larger blocks or tail entries"] += 1
                compare(
                    f"step {self.steps} KV events", list(map(_event_fields, batch_a)), list(map(_event_fields, batch_b))
                )
        self.check_state(f"step {self.steps} update")
        if self.cfg.num_speculative_tokens and not self.cfg.async_scheduling:
            self.propose_drafts(so_a)
        if self.stuck:
            from vllm.v1.request import RequestStatus

            ids, self.stuck = self.stuck, []
            ra = self.a.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            rb = self.b.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            compare("finish_requests (empty output)", [r.request_id for r in ra], [r.request_id for r in rb])
            self.check_state(f"finish_requests({ids}) after an empty output")

    def propose_drafts(self, so: Any) -> None:
        """What vLLM's engine does after a synchronous step with a drafter: the runner's drafts for the requests
        of that step (finished or prefill-chunk ones included, as the runner sends them) via
        ``update_draft_token_ids``. Drafts are random: k of them, fewer, none, or n-gram's -1 padding."""
        from vllm.v1.outputs import DraftTokenIds

        rng, k = self.rng, self.cfg.num_speculative_tokens
        req_ids = list(so.num_scheduled_tokens)
        drafts: list[list[int]] = []
        for _ in req_ids:
            r = rng.random()
            n = k if r < 0.6 else (0 if r < 0.7 else rng.randrange(0, k + 1))
            draft = [rng.randrange(3, 500) for _ in range(n)]
            if r > 0.9 and draft:
                cut = rng.randrange(0, len(draft))
                draft[cut:] = [-1] * (len(draft) - cut)
            drafts.append(draft)
        ids = DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts)
        self.a.update_draft_token_ids(copy.deepcopy(ids))
        self.b.update_draft_token_ids(copy.deepcopy(ids))
        self.check_state(f"step {self.steps} update_draft_token_ids")

    # ---- state -----------------------------------------------------------------------------------------

    def check_state(self, when: str) -> None:
        a, b = self.a, self.b
        compare(f"{when}: live requests", sorted(a.requests), sorted(b.requests))
        for rid, ra in a.requests.items():
            rb = b.requests[rid]
            if _request_fast(ra) == _request_fast(rb):
                continue
            for f in REQUEST_FIELDS:
                va, vb = getattr(ra, f), getattr(rb, f)
                if not _plain_equal(va, vb):
                    compare(f"{when}: request {rid}.{f}", va, vb)
            if ra.status == ra.status.RUNNING:
                compare(
                    f"{when}: request {rid} block tables",
                    [list(t) for t in a.kv_cache_manager.get_block_ids(rid)],
                    [list(t) for t in b.kv_cache_manager.get_block_ids(rid)],
                )
        compare(f"{when}: get_request_counts", a.get_request_counts(), b.get_request_counts())
        compare(f"{when}: num unfinished", a.get_num_unfinished_requests(), b.get_num_unfinished_requests())
        compare(f"{when}: has_finished", a.has_finished_requests(), b.has_finished_requests())
        compare(f"{when}: kv usage", a.get_kv_cache_usage(), b.get_kv_cache_usage())
        if self.store is not None:
            self.store.compare(when)
        elif self.cfg.cpu_offload_blocks is not None:
            self.compare_offload(when)
        elif a.connector is not None:
            conns = _connectors(a)
            for i, (ca, cb) in enumerate(zip(conns, _connectors(b), strict=True)):
                compare(f"{when}: KV connector {i} calls", ca.calls, cb.calls)
                if len(set(self.cfg.group_block_sizes or ())) > 1 and ca is conns[-1]:
                    # (the seeded connector: a MultiConnector's passive first child logs the same calls)
                    _count_mixed_block_allocs(ca.calls)
                ca.calls.clear()
                cb.calls.clear()
        if a.ec_connector is not None:
            compare(f"{when}: EC connector calls", a.ec_connector.calls, b.ec_connector.calls)
            a.ec_connector.calls.clear()
            b.ec_connector.calls.clear()
        if self.cfg.encoder_decoder is not None:
            compare(
                f"{when}: encoder-decoder free slots",
                a.encoder_cache_manager.num_free_slots,
                b.core.encoder_decoder_free_slots,
            )
        b.core.check_invariants()

    # ---- a whole run -----------------------------------------------------------------------------------

    def run(self, num_steps: int) -> None:
        rng = self.rng
        for _ in range(rng.randrange(1, 6)):
            self.add_random_request()
        for _ in range(num_steps):
            self.steps += 1
            r = rng.random()
            if r < 0.35:
                for _ in range(rng.randrange(1, 4)):
                    self.add_random_request()
            if rng.random() < 0.04:
                self.abort_random()
            if rng.random() < 0.03:
                self.pause_or_resume()
            if rng.random() < 0.02:
                self.reset_prefix_cache()
            if self.compiling and rng.random() < 0.25:
                self.grammar_ready()
            if self.sessions and self.rng_stream.random() < 0.2:
                self.stream_input()
            if self.cfg.pipeline_parallel_size > 1:
                self.engine_step()
                if not self.a.has_requests() and rng.random() < 0.5:
                    self.add_random_request()
                continue
            self.schedule()
            if self.rng_out.random() < 0.05:
                self.abort_in_flight()
            if self.cfg.async_scheduling:
                # vLLM's batch queue: step N+1 is scheduled before step N's output is applied.
                if len(self.in_flight) > 1:
                    self.update_oldest()
            else:
                self.update_oldest()
            if not self.a.has_requests() and rng.random() < 0.5:
                self.add_random_request()
        while self.in_flight:
            self.update_oldest()
        self.grammar_ready(everything=True)
        for rid in sorted(self.sessions):
            if rid in self.a.requests:
                self.stream_input(rid, finish=True)
        # Unpause and drain: every request finishes on both sides, and every block comes back.
        from vllm.v1.core.sched.interface import PauseState

        self.a.set_pause_state(PauseState.UNPAUSED)
        self.b.set_pause_state(PauseState.UNPAUSED)
        idle_streak, last_state = 0, None
        for _ in range(4 * self.cfg.max_model_len * (len(self.a.requests) + 1)):
            if not (self.a.has_requests() or self.b.has_requests()):
                break
            self.steps += 1
            self.schedule()
            idle = not self.in_flight[-1][0].total_num_scheduled_tokens
            while self.in_flight:
                self.update_oldest()
            if idle and self.cfg.streaming:
                self.abort_resident_session()
            # A stall is for good once vLLM's scheduler has scheduled nothing for DRAIN_STALL_STEPS steps in a row
            # with every request where it was (asynchronous loads and delayed frees end within a few steps).
            state = sorted((rid, r.status, r.num_computed_tokens) for rid, r in self.a.requests.items())
            idle_streak = idle_streak + 1 if idle and state == last_state else 0
            last_state = state
            if idle_streak >= DRAIN_STALL_STEPS:
                break
        if self.a.requests:
            # vLLM's own scheduler can stall for good: a request whose asynchronous KV load is over stays
            # WAITING_FOR_REMOTE_KVS, holding its blocks, while the waiting request ahead of it under the priority
            # policy cannot get blocks, so the admission pass never reaches it. kvsched must stall the same way.
            compare("stalled in the drain", sorted(self.a.requests), sorted(self.b.requests))
            for rid, ra in self.a.requests.items():
                compare(f"stalled in the drain: {rid}.status", ra.status, self.b.requests[rid].status)
            statuses = collections.Counter(r.status.name for r in self.a.requests.values())
            raise VllmStopped(
                f"the drain: vLLM's scheduler stalls with {len(self.a.requests)} requests ({dict(statuses)}), none "
                "schedulable; kvsched stalls identically"
            )
        compare("drained", sorted(self.b.requests), [])
        # Blocks SimpleCPUOffloadConnector keeps pinned for ever (loads of requests that finished before the
        # load was registered) are pinned on both sides: the free count is vLLM's.
        free = self.cfg.num_blocks - 1
        if self.cfg.cpu_offload_blocks is not None:
            free = self.a.kv_cache_manager.block_pool.get_num_free_blocks()
        compare("free blocks", self.b.core.num_free_blocks, free)


def run_seed(
    seed: int,
    steps: int,
    *,
    async_scheduling: bool,
    v2: bool,
    num_speculative_tokens: int | None = None,
    connector: bool = False,
    kv_role: str = "kv_both",
    sync_invalid: bool = False,
    multi_connector: bool = False,
    divergent_hits: bool = False,
    kv_events: bool = False,
    sliding_window: bool = False,
    hybrid: bool = False,
    mamba: bool = False,
    mamba_align: bool = False,
    mamba_prefix_caching: bool = False,
    mamba_retention: int | None = None,
    mamba_checkpoints: bool = False,
    retention: int | None = None,
    chunked_local: bool = False,
    multimodal: bool = False,
    defer_async_loads: bool = False,
    budgets: bool = False,
    ec_connector: bool = False,
    streaming: bool = False,
    pp: bool = False,
    eagle: bool = False,
    dflash: bool = False,
    eagle_drop: bool = False,
    eagle_lookahead: bool = False,
    eagle_groups: bool = False,
    mtp: bool = False,
    dcp: int = 1,
    pcp: int = 1,
    mla: bool = False,
    ring: bool = False,
    replay: bool = False,
    replay_first: bool = False,
    encoder_decoder: bool = False,
    cpu_offload: bool = False,
    lazy_offload: bool = False,
    mooncake_store: bool = False,
    umbp_store: bool = False,
    block_sizes: tuple[int, ...] = (),
    hash_block_size: int | None = None,
    group_block_factors: tuple[int, ...] = (),
    first_group_factor: int = 0,
) -> Config:
    """One seeded run; ``num_speculative_tokens`` overrides the drawn number of drafts per step (0: none);
    ``connector`` adds a seeded ``RandomKVConnector`` in the role ``kv_role`` (``divergent_hits``: claiming
    ``supports_divergent_local_hybrid_hits``; ``multi_connector``: as the second
    child of vLLM's ``MultiConnector``, after a passive one); ``kv_events`` turns KV cache
    events on and compares the published batches; ``sliding_window`` makes the model's KV cache group a sliding
    window of a drawn size (from its own stream: the seed's other draws stay as they are); ``hybrid`` gives the
    model several KV cache groups instead (full attention and sliding windows, drawn from their own stream);
    ``chunked_local`` draws layouts with chunked-local groups (Llama 4) instead; ``mamba`` a hybrid Mamba model's
    (Mamba groups with full attention and sometimes a window, prefix caching off: vLLM's mamba_cache_mode "none";
    with ``mamba_align``, its mode "align": block-sized Mamba blocks, block-aligned prefill chunks; with
    ``mamba_prefix_caching`` too, prefix caching on: Mamba prefix hits and cached states; ``mamba_checkpoints``
    their prefill checkpoints, the alignment drawn per seed among one token and one to three blocks, from its own
    stream); ``retention`` (or its old name ``mamba_retention``) vLLM's sparse retention of cached Mamba states and
    sliding-window blocks, the interval in blocks (0: what a later request can resume at only; -1: drawn per seed
    among dense, 0 and 1 to 3 blocks, from its own stream; 0 instead of a positive interval on a layout with
    neither);
    ``multimodal`` schedules a tiny LLaVA whose requests carry images; ``ec_connector`` adds a seeded
    ``RandomECConnector``; ``budgets`` draws parallel drafting (extra query slots per scheduled request) and a
    token budget below the input budget, from their own stream; ``streaming`` makes some requests
    streaming-input sessions; ``pp`` draws a pipeline-parallel size of 2-4 (from its own stream) and keeps steps
    in flight as vLLM's engine does with it (``Pair.engine_step``); ``eagle`` gives every run an EAGLE drafter (1-4
    drafts) with vLLM's default prefix-cache rules for it (``eagle_drop``: with the trailing-block drop wherever
    the layout draws between it and look-ahead hashes; ``eagle_lookahead``: with the look-ahead hashes there on
    vLLM 0.33; ``eagle_groups``: with ``mamba_prefix_caching``, the
    attention groups marked as the drafter's, one of each kind, the Mamba groups not, as vLLM's planner marks a
    hybrid Mamba model's MTP layers); ``mtp`` makes it a multi-module MTP drafter with 2-4 drafts (drawn from its
    own stream): vLLM's prefill lookahead of that many tokens; ``dcp`` / ``pcp``: vLLM's decode / prefill context
    parallel sizes (the drawn block size is per DCP rank, the pool shrunk by the DCP size to keep its pressure);
    ``mla``: the model's full-attention and sliding-window groups are multi-head latent attention's (DeepSeek, Kimi);
    ``mooncake_store``: vLLM's MooncakeStoreConnector in the role ``kv_role``, its options (asynchronous loads and
    lookups, lookups off, decode saves) and load failure policy drawn from their own stream, a stand-in store in
    place of the Mooncake store and its workers (``MooncakeStandIn``); ``umbp_store``: vLLM 0.33's
    UMBPStoreConnector likewise (asynchronous loads and lookups, lookups off, decode saves drawn), a stand-in UMBP
    runtime and workers (``UMBPStandIn``; with ``sync_invalid`` its synchronous loads report invalid blocks too, as
    the RandomKVConnector's do with ``connector``); ``block_sizes``: the block size is drawn
    from these instead (from its own stream); ``hash_block_size`` (with ``hybrid``): the requests' hash block
    (vLLM's ``prefix_match_unit``), a divisor of the block size below it, -1 to draw one per seed (its own
    stream; block size 1 keeps its block), with prefix caching on."""
    rng = random.Random(seed * 7919 + 17)
    block_size = random.Random(f"block/{seed}").choice(block_sizes) if block_sizes else None
    cfg = random_config(rng, async_scheduling=async_scheduling, v2=v2, block_size=block_size)
    if sliding_window:
        cfg.sliding_window = random.Random(f"window/{seed}").choice([1, 3, 8, cfg.block_size, 20, 33, 64, 100])
    if hybrid or chunked_local:
        if chunked_local:
            cfg.kv_cache_groups = random_chunked_groups(random.Random(f"chunked/{seed}"), cfg.block_size)
        else:
            cfg.kv_cache_groups = random_groups(random.Random(f"groups/{seed}"), cfg.block_size)
        # vLLM sizes the pool for every group: as many blocks per group as the drawn single-group cache.
        cfg.num_blocks = 1 + (cfg.num_blocks - 1) * len(cfg.kv_cache_groups)
        if group_block_factors:
            # Groups of different block sizes: group g (from 1) has the (g - 1)-th factor (the last repeated) times
            # the first group's block; -1 draws a factor in 1..4 per group (own stream). Group 0 keeps the block size.
            frng = random.Random(f"groupblock/{seed}")
            factors = [
                frng.choice([1, 2, 3, 4]) if f < 0 else f
                for f in (
                    group_block_factors[min(g - 1, len(group_block_factors) - 1)]
                    for g in range(1, len(cfg.kv_cache_groups))
                )
            ]
            # (Groups of one kind and window have one spec, so one block size: the first such group's.)
            groups, sizes = cfg.kv_cache_groups, [cfg.block_size]
            for g in range(1, len(groups)):
                same = groups.index(groups[g])
                sizes.append(sizes[same] if same < g else cfg.block_size * factors[g - 1])
            # The larger blocks first (MiMo-V2's layout: its full-attention layers' pages are the smaller, so vLLM
            # raises their block size, and they come first): group 0's block times the first group factor, and the
            # first group of another kind keeps the block size when no other group does.
            kinds = [g for g in range(1, len(groups)) if groups[g] != groups[0] and not isinstance(groups[g], str)]
            if first_group_factor and kinds:
                f0 = (
                    random.Random(f"firstgroup/{seed}").choice([2, 3, 4])
                    if first_group_factor < 0
                    else first_group_factor
                )
                if not any(sizes[g] == cfg.block_size for g in kinds):
                    sizes = [cfg.block_size if w == groups[kinds[0]] else z for z, w in zip(sizes, groups, strict=True)]
                sizes = [cfg.block_size * f0 if w == groups[0] else z for z, w in zip(sizes, groups, strict=True)]
            cfg.group_block_sizes = tuple(sizes)
    if mamba:
        cfg.kv_cache_groups = random_mamba_groups(random.Random(f"mamba/{seed}"), cfg.block_size)
        cfg.enable_prefix_caching = False  # vLLM's mode "none" (with prefix caching it switches to "align")
        # The attention groups' blocks as the drawn single-group cache, and a state block per request per Mamba
        # group on top.
        num_attn = sum(g != "mamba" for g in cfg.kv_cache_groups)
        cfg.num_blocks = 1 + (cfg.num_blocks - 1) * num_attn + cfg.max_num_seqs // 2
        if mamba_align:
            # Two running states and the speculative blocks per request per Mamba group.
            cfg.mamba_cache_mode = "align"
            num_mamba = len(cfg.kv_cache_groups) - num_attn
            cfg.num_blocks += cfg.max_num_seqs * num_mamba
            cfg.enable_prefix_caching = mamba_prefix_caching
            if mamba_checkpoints:
                align = random.Random(f"checkpoints/{seed}").choice([1, 1, 2, 2, 3])
                cfg.mamba_checkpoint_alignment = 1 if align == 1 and seed % 2 else align * cfg.block_size
    # vLLM's sparse retention of cached Mamba states and sliding-window blocks, the interval in blocks (-1: drawn
    # per seed from its own stream). vLLM refuses an interval above 0 without a window or Mamba group: 0 there.
    blocks = retention if retention is not None else mamba_retention
    if blocks is not None:
        if blocks < 0:
            blocks = random.Random(f"retention/{seed}").choice([None, 0, 0, 1, 2, 3])
        groups = cfg.kv_cache_groups or ()
        if blocks and not (cfg.sliding_window or any(isinstance(g, int) or g == "mamba" for g in groups)):
            blocks = 0
        if blocks is not None:
            # (a multiple of the scheduler block: the groups' block sizes' least common multiple)
            cfg.prefix_cache_retention_interval = blocks * math.lcm(cfg.block_size, *(cfg.group_block_sizes or ()))
    # (A Mamba draw with a window beside it keeps the block's unit: kvsched.vllm refuses the finer one there.)
    mamba_window = mamba and any(g not in (None, "mamba") for g in cfg.kv_cache_groups or ())
    if hash_block_size is not None and not mamba_window:
        units = [d for d in range(1, cfg.block_size) if cfg.block_size % d == 0]
        if hash_block_size < 0:
            cfg.hash_block_size = random.Random(f"hashblock/{seed}").choice(units) if units else None
        elif hash_block_size in units:
            cfg.hash_block_size = hash_block_size
        else:
            raise ValueError(f"hash block size {hash_block_size} is not a divisor below block size {cfg.block_size}")
        # Prefix caching on: without it (and without a KV connector) vLLM's engine hashes at the scheduler block.
        cfg.enable_prefix_caching = True
    if ring:
        # Compressor rings (DeepSeek V4.1, GLM-5, Qwen4, Step 5: CircularBufferSpec groups, one block per request):
        # one or two at drawn places among the drawn groups, a ring of rows that divide the block, compressed
        # full-attention groups and mixed precisions in some runs (own stream).
        grng = random.Random(f"ring/{seed}")
        groups = list(cfg.kv_cache_groups or (cfg.sliding_window,))
        cfg.sliding_window = None
        sizes = list(cfg.group_block_sizes) if cfg.group_block_sizes is not None else None
        for _ in range(grng.choice([1, 1, 2])):
            at = grng.randrange(len(groups) + 1)
            groups.insert(at, "ring")
            if sizes is not None:
                # (a ring's spec has its rows as its block size; the driver keeps the group's entry the block size)
                sizes.insert(at, cfg.block_size)
        cfg.kv_cache_groups = tuple(groups)
        if sizes is not None:
            cfg.group_block_sizes = tuple(sizes)
        cfg.ring_block_size = grng.choice([r for r in (1, 2, 4, 8, 16) if cfg.block_size % r == 0])
        unit = cfg.hash_block_size or cfg.block_size
        cfg.tokens_per_state = grng.choice([t for t in (1, 1, 2, 4) if unit % t == 0])
        cfg.mixed_precision = grng.random() < 0.5
        cfg.num_blocks += cfg.max_num_seqs * groups.count("ring")
    if replay:
        # DeepSeek V4.1's bounded prefix replay: the drawn layout's sliding windows of one size (a drawn window
        # added when it has none) become windows rebuilt by replay (SlidingWindowMLASpec with bounded_replay),
        # after a full-attention group (own stream).
        rrng = random.Random(f"replay/{seed}")
        groups = list(cfg.kv_cache_groups or (cfg.sliding_window,))
        drawn = len(groups)
        # (with groups of different block sizes, an added group has the block size)
        sizes = list(cfg.group_block_sizes) if cfg.group_block_sizes is not None else None
        cfg.sliding_window = None
        windows = [g for g in groups if isinstance(g, int) and not isinstance(g, bool)]
        if windows:
            window = rrng.choice(windows)
        else:
            window = rrng.choice([1, 3, 8, cfg.block_size, 2 * cfg.block_size, 20, 33])
            at = rrng.randrange(len(groups) + 1)
            groups.insert(at, window)
            if sizes is not None:
                sizes.insert(at, cfg.block_size)
        groups = [f"replay:{window}" if g == window else g for g in groups]
        first = next(i for i, g in enumerate(groups) if g not in ("ring", "mamba"))
        added_full = groups[first] is not None
        if added_full:
            groups.insert(first, None)
            if sizes is not None:
                sizes.insert(first, cfg.block_size)
        cfg.kv_cache_groups = tuple(groups)
        if sizes is not None:
            if added_full:
                # Groups of one spec have one block size: every full-attention group the added one's.
                sizes = [cfg.block_size if g is None else z for g, z in zip(groups, sizes, strict=True)]
            cfg.group_block_sizes = tuple(sizes)
        if replay_first:
            # DeepSeek V4.1's own layout: a replayed window first, before the full-attention group that hashes
            # (its sliding-window cache comes from the first layer's), the replayed windows' blocks smaller than
            # the block (that cache holds 32 tokens a block), or in some runs of a size that does not divide it.
            at = next(i for i, g in enumerate(groups) if is_replay_group(g))
            groups.insert(0, groups.pop(at))
            sizes = sizes if sizes is not None else [cfg.block_size] * len(groups)
            sizes.insert(0, sizes.pop(at))
            smaller = [d for d in range(1, cfg.block_size) if cfg.block_size % d == 0]
            size = rrng.choice(smaller * 3 + [3, 6]) if smaller else rrng.choice([3, 6])
            sizes = [size if is_replay_group(g) else z for g, z in zip(groups, sizes, strict=True)]
            cfg.kv_cache_groups = tuple(groups)
            cfg.group_block_sizes = tuple(sizes)
            REPLAY_COUNTS["runs with a replayed window first"] += 1
            REPLAY_COUNTS["runs whose replayed blocks do not divide the block"] += cfg.block_size % size != 0
        # (as many blocks per group as the drawn layout's; as many tokens for replayed windows of smaller blocks)
        per_group = (cfg.num_blocks - 1) // drawn
        cfg.num_blocks = 1 + (cfg.num_blocks - 1) * len(groups) // drawn
        if replay_first:
            cfg.num_blocks += sum(
                per_group * (-(-cfg.block_size // z) - 1)
                for g, z in zip(groups, sizes, strict=True)
                if is_replay_group(g)
            )
        REPLAY_COUNTS["runs"] += 1
    if encoder_decoder:
        # A cross-attention group beside the decoder's (vLLM sizes the pool for both), no prefix caching (vLLM
        # turns it off for encoder-decoder models), a small encoder budget and slot count (own stream).
        erng = random.Random(f"encdec/{seed}")
        cfg.kv_cache_groups = (None, "cross")
        cfg.num_blocks = 1 + (cfg.num_blocks - 1) * 2
        cfg.enable_prefix_caching = False
        budget = erng.choice([4, 8, 16, 32])
        cfg.encoder_decoder = (budget, erng.choice([budget, budget, 2 * budget, 3 * budget // 2]))
    if cpu_offload:
        # A CPU pool of a quarter of the GPU pool up to twice it (own stream), prefix caching on (the connector
        # offloads nothing without it).
        orng = random.Random(f"offload/{seed}")
        if cfg.kv_cache_groups and None not in cfg.kv_cache_groups:
            # vLLM's connector matches prefixes in a full-attention group and asserts one: a window becomes one.
            groups = list(cfg.kv_cache_groups)
            groups[random.Random(f"offload-fa/{seed}").randrange(len(groups))] = None
            cfg.kv_cache_groups = tuple(groups)
        cfg.cpu_offload_blocks = max(2, int(cfg.num_blocks * orng.choice([0.25, 0.5, 1.0, 2.0])))
        cfg.cpu_offload_lazy = lazy_offload
        cfg.enable_prefix_caching = True
    if mooncake_store:
        mrng = random.Random(f"mooncake/{seed}")
        cfg.kv_role = kv_role
        cfg.kv_load_failure_policy = mrng.choice(["recompute", "fail"])
        cfg.mooncake_store = {
            "load_async": mrng.random() < 0.7,
            "lookup_async": mrng.random() < 0.5,
            "enable_lookup": mrng.random() < 0.9,
            "save_decode_cache": mrng.random() < 0.3,
        }
    if umbp_store:
        urng = random.Random(f"umbp/{seed}")
        cfg.kv_role = kv_role
        cfg.kv_load_failure_policy = urng.choice(["recompute", "fail"])
        cfg.umbp_store = {
            "key_namespace": "kvsched-driver",
            "load_async": urng.random() < 0.7,
            "lookup_async": urng.random() < 0.5,
            "enable_lookup": urng.random() < 0.9,
            "save_decode_cache": urng.random() < 0.3,
        }
        cfg.umbp_sync_invalid = sync_invalid
    if connector:
        cfg.kv_connector_seed = seed
        cfg.kv_connector_sync_invalid = sync_invalid
        cfg.kv_load_failure_policy = rng.choice(["recompute", "fail"])
        cfg.kv_role = kv_role
        cfg.kv_connector_multi = multi_connector
        cfg.kv_connector_divergent_hits = divergent_hits
        cfg.defer_async_loads = defer_async_loads
    if num_speculative_tokens is not None:
        cfg.num_speculative_tokens = num_speculative_tokens
    if budgets:
        brng = random.Random(f"budgets/{seed}")
        k = cfg.num_speculative_tokens = cfg.num_speculative_tokens or brng.choice([2, 3, 4])
        if cfg.speculative_method == "ngram_gpu" and not cfg.async_scheduling:
            cfg.speculative_method = brng.choice(["ngram", "eagle"])
        # k - 1 query slots per request must leave room for a token: vLLM refuses the config otherwise.
        cfg.parallel_drafting = cfg.max_num_batched_tokens > k and brng.random() < 0.8
        if brng.random() < 0.6:
            budget = cfg.max_num_batched_tokens
            cfg.max_num_scheduled_tokens = brng.randrange(max(1, budget // 4), budget)
    if streaming and RULES.version == "0.32":
        # Not driven on vLLM 0.32: a streaming session's part that stops inside accepted drafts. vLLM 0.32 does not cut
        # num_computed_tokens back at such a stop, and its next part then keeps the outputs up to that count (the
        # stop token included) and counts some of the part's tokens as computed, with no KV written for them.
        # kvsched follows vLLM 0.33's rule there (docs/vllm.md).
        cfg.num_speculative_tokens = 0
    if not cfg.num_speculative_tokens:
        cfg.per_request_spec_decode_metrics = "none"  # vLLM refuses it without a drafter
    if cfg.speculative_method == "eagle" and cfg.policy == "priority" and v2 and RULES.skip_drafts:
        cfg.speculative_method = "ngram_gpu"  # refused by kvsched.vllm (skip_drafts after in-step preemptions)
    cfg.kv_events = kv_events
    cfg.streaming = streaming
    # vLLM's default EAGLE prefix-cache rules in most EAGLE runs (from their own stream: the other draws stay). Not
    # with a window or several groups, nor streaming input (kvsched refuses both with them).
    eagle = eagle or mtp
    if eagle:
        erng = random.Random(f"eagle/{seed}")
        cfg.speculative_method = "eagle"
        cfg.num_speculative_tokens = erng.choice([1, 2, 3, 4])
        if mtp:
            cfg.multi_module_mtp = True
            cfg.num_speculative_tokens = random.Random(f"mtp/{seed}").choice([2, 3, 4])
        cfg.per_request_spec_decode_metrics = erng.choice(["none", "summary", "detailed"])
        if cfg.policy == "priority" and v2 and RULES.skip_drafts:
            cfg.policy = "fcfs"  # refused by kvsched.vllm (skip_drafts after in-step preemptions)
    # (With Mamba groups prefix caching is off: vLLM's default rules, on, act on nothing.)
    if cfg.speculative_method == "eagle" and not (
        cfg.sliding_window or (cfg.kv_cache_groups and not (mamba and not mamba_align)) or streaming
    ):
        cfg.eagle_block_drop = eagle or random.Random(f"eagle/{seed}").random() < 0.7
    elif eagle and (cfg.sliding_window or (hybrid or chunked_local) or (mamba_align and mamba_prefix_caching)):
        # Over a window or several groups (align-mode Mamba groups with prefix caching among them): look-ahead
        # hashes or (half the runs on vLLM 0.33, always on 0.32) the trailing-block drop, drawn from their own
        # stream. vLLM has no drop with chunked-local attention (its
        # manager asserts none reaches it): those layouts run the look-ahead hashes only.
        chunked = any(isinstance(g, str) and g.startswith("chunked:") for g in cfg.kv_cache_groups or ())
        drop = RULES.version == "0.32" or eagle_drop or random.Random(f"eagle-drop/{seed}").random() < 0.5
        drop &= not eagle_lookahead or RULES.version == "0.32"
        cfg.eagle_block_drop = not (chunked and drop and RULES.version == "0.32")
        cfg.lookahead_block_hashes = chunked or not drop or RULES.version == "0.32"
        if eagle_groups and mamba_prefix_caching and cfg.kv_cache_groups:
            # The drafter's layers sit in one attention group of each kind (vLLM's planner marks the groups that
            # hold draft layers); the Mamba groups hold none.
            first: dict[int | str | None, int] = {}
            for g, w in enumerate(cfg.kv_cache_groups):
                if w not in ("mamba", "ring"):
                    first.setdefault(w, g)
            cfg.eagle_groups = tuple(sorted(first.values()))
        windows_only = cfg.sliding_window or None not in (cfg.kv_cache_groups or [None])
        if mtp and cfg.lookahead_block_hashes and windows_only and RULES.version != "0.32":
            # Look-ahead hashes of several tokens over windows without full attention: vLLM's window lookup reads
            # past the request's hashes (kvsched.vllm refuses it): the drop instead.
            cfg.lookahead_block_hashes = False
    if dflash and cfg.speculative_method == "eagle":
        # The drafter taken for a DFlash one: k + 1 lookahead slots; on vLLM 0.33 none of EAGLE's prefix-cache rules
        # (its drafts do not read the next token), on 0.32 the same rules as EAGLE's.
        cfg.speculative_method = "dflash"
    if multimodal:
        cfg.multimodal = True
        # vLLM 0.32's disable_chunked_mm_input differs from 0.33's at an input's first token (kvsched refuses it).
        cfg.disable_chunked_mm_input = RULES.version != "0.32" and rng.random() < 0.3
        if cfg.speculative_method == "eagle" and cfg.disable_chunked_mm_input and cfg.num_speculative_tokens:
            # A chunk stopped before an image leaves the drafter's prefill lookahead before it: the next chunk must
            # cover both (kvsched refuses an image it could never; vLLM would hold the request forever).
            lookahead = cfg.num_speculative_tokens if cfg.multi_module_mtp else 1
            if 0 < cfg.long_prefill_token_threshold < 15 + lookahead:
                cfg.long_prefill_token_threshold = 48
    if ec_connector:
        cfg.ec_connector_seed = seed
    if pp:
        cfg.pipeline_parallel_size = random.Random(f"pp/{seed}").choice([2, 3, 4])
    if mamba:
        # One request's state blocks (1 + num_speculative_blocks per Mamba group, the drafts' count) on top, so the
        # attention groups keep at least the drawn single-group cache for it.
        cfg.num_blocks += cfg.kv_cache_groups.count("mamba") * (1 + cfg.num_speculative_tokens)  # type: ignore[union-attr]
    cfg.mla = mla
    if dcp > 1 or pcp > 1:
        cfg.decode_context_parallel_size = dcp
        cfg.prefill_context_parallel_size = pcp
        cfg.num_blocks = max(3, 1 + (cfg.num_blocks - 1) // dcp)
    if os.environ.get("KVSCHED_DRIVER_SHOW_CONFIG"):
        print(cfg, flush=True)
    pair = Pair(cfg, seed)
    pair.run(steps)
    if cpu_offload and pair.a.connector.scheduler_manager is not None:
        OFFLOAD_COUNTS["boundary states stored"] += pair.a.connector.scheduler_manager.boundary_store_stats.stored
    if pair.mooncake is not None:
        MOONCAKE_COUNTS.update(pair.mooncake.counts)
    if pair.umbp is not None:
        UMBP_COUNTS.update(pair.umbp.counts)
    return cfg


def _count_diverged_hits(sched: Any) -> None:
    """Counts in ``DIVERGED_HITS`` the local hits of vLLM's scheduler ``sched`` that diverged across its groups, and
    those it replaced by the usual hit (its next ``get_computed_blocks`` call comes right after the diverged
    lookup)."""
    lookup, usual = sched._get_local_prefix_cache_hit, sched.kv_cache_manager.get_computed_blocks
    pending = [False]

    def counted_lookup(*args: Any, **kw: Any) -> Any:
        pending[0] = False
        out = lookup(*args, **kw)
        if out[3]:
            DIVERGED_HITS["diverged"] += 1
            pending[0] = True
        return out

    def counted_usual(*args: Any, **kw: Any) -> Any:
        if pending[0]:
            DIVERGED_HITS["replaced"] += 1
            pending[0] = False
        return usual(*args, **kw)

    sched._get_local_prefix_cache_hit = counted_lookup
    sched.kv_cache_manager.get_computed_blocks = counted_usual


def random_groups(rng: random.Random, block_size: int) -> tuple[int | None, ...]:
    """A hybrid model's KV cache groups: mostly one full-attention group and one window (gpt-oss, Gemma 2), else
    2-4 groups mixing full attention and one or two windows in any order (Gemma 3: several window groups)."""
    windows = [1, 3, 8, block_size, 20, 33, 64, 100]
    if rng.random() < 0.5:
        return (None, rng.choice(windows))
    kinds = [None, *rng.sample(windows, rng.choice([1, 2]))]
    groups = [rng.choice(kinds) for _ in range(rng.randrange(2, 5))]
    if all(g is None for g in groups):
        groups[rng.randrange(len(groups))] = kinds[1]
    return tuple(groups)


def random_mamba_groups(rng: random.Random, block_size: int) -> tuple[int | str | None, ...]:
    """A hybrid Mamba model's KV cache groups, in vLLM's order (its layers' order): Mamba groups first and one
    full-attention group (Qwen3-Next, Nemotron-H, Granite 4: 1 to 3 Mamba groups), Mamba around full attention,
    full attention first, or a window beside them."""
    return rng.choice(
        [
            ("mamba", None),
            ("mamba", "mamba", "mamba", None),
            ("mamba", None, "mamba"),
            (None, "mamba"),
            ("mamba", rng.choice([3, 8, block_size, 33]), None),
        ]
    )


def random_chunked_groups(rng: random.Random, block_size: int) -> tuple[int | str | None, ...]:
    """A hybrid model with chunked-local attention: mostly one full-attention group and one chunked-local group
    (Llama 4), else 2-4 groups mixing full attention, one or two chunk sizes and sometimes a sliding window, in
    any order (at least one full-attention group: kvsched.vllm refuses chunked-local groups without one)."""
    chunks = [f"chunked:{c}" for c in (1, 3, 8, block_size, 2 * block_size, 20, 33, 64)]
    if rng.random() < 0.5:
        groups: list[int | str | None] = [None, rng.choice(chunks)]
        rng.shuffle(groups)
        return tuple(groups)
    kinds: list[int | str | None] = [None, *rng.sample(chunks, rng.choice([1, 2]))]
    if rng.random() < 0.4:
        kinds.append(rng.choice([3, 8, block_size, 20, 64]))
    groups = [rng.choice(kinds) for _ in range(rng.randrange(2, 5))]
    while None not in groups or not any(isinstance(g, str) for g in groups):
        groups[rng.randrange(len(groups))] = rng.choice([None, kinds[1]])
    return tuple(groups)


def main(argv: list[str] | None = None) -> int:
    if argv is None and "PYTHONHASHSEED" not in os.environ:
        # Block ids and which seeds vLLM's own scheduler stalls on depend on set iteration order: a fixed hash seed
        # makes every run of a seed the same. Set PYTHONHASHSEED to run under another.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", default=None, help="default: sync-v1,sync-v2,async-v1,async-v2 (with --pp: no async-v1)")
    p.add_argument("--connector", action="store_true", help="with a seeded RandomKVConnector")
    p.add_argument(
        "--sync-invalid",
        action="store_true",
        help="the RandomKVConnector (with --connector) or the UMBP stand-in workers (with --umbp-store: the "
        "blocks of keys no longer stored, and a drawn block in one load in ten) also report invalid blocks of "
        "synchronous loads",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="with vLLM's SimpleCPUOffloadConnector (eager offload, a CPU pool of a quarter to twice the GPU pool, "
        "prefix caching on): loads and stores are reported over 0-2 steps later by a simulated worker; the "
        "connector's state and every GPU block's reference count and block hash are compared; with --hybrid, "
        "over full attention and sliding windows (a full-attention group in every layout: the connector needs "
        "one); with --mamba --mamba-align --mamba-prefix-caching, over Mamba groups (their states stored through "
        "the boundary hand-offs); not with --connector or --sliding-window",
    )
    p.add_argument(
        "--lazy-offload",
        action="store_true",
        help="with --cpu-offload: the connector's lazy mode (it walks the GPU free block queue from a cursor and "
        "offloads the cached blocks next in line for eviction)",
    )
    p.add_argument(
        "--mooncake-store",
        action="store_true",
        help="with vLLM's MooncakeStoreConnector (its options and load failure policy drawn per seed), a stand-in "
        "store in place of the Mooncake store and its workers: lookups answered from the block hashes its store "
        "jobs saved, jobs and loads reported over 0-3 steps later, some loads with an invalid block; the connector's "
        "metadata and state, its touch / free_blocks calls on the block pool and every GPU block's reference count "
        "and block hash are compared; with --kv-roles; not with --connector or --cpu-offload",
    )
    p.add_argument(
        "--umbp-store",
        action="store_true",
        help="with vLLM 0.33's UMBPStoreConnector (its options and load failure policy drawn per seed), a stand-in "
        "UMBP runtime registered with vLLM's UMBPRuntimeFactory and stand-in workers: lookups answered from the keys "
        "its store events saved (some lookups failing), events and loads reported over 0-3 steps later, some loads "
        "with invalid blocks, some store jobs failing; the connector's metadata and state, its touch / free_blocks "
        "calls on the block pool and every GPU block's reference count and block hash are compared; with "
        "--kv-roles; with --kv-events, the connector's events and the worker's evictions in the published batches; "
        "not with --connector, --cpu-offload, --mooncake-store, --sliding-window, "
        "--hybrid, --mamba, --enc-dec and --pp",
    )
    p.add_argument(
        "--kv-roles",
        default="kv_both",
        help="with --connector, --mooncake-store or --umbp-store: the connector's roles, comma-separated (kv_producer, "
        "kv_consumer, kv_both); each mode runs every seed once per role",
    )
    p.add_argument(
        "--multi-connector",
        action="store_true",
        help="with --connector: the RandomKVConnector is the second child of vLLM's MultiConnector, after a passive "
        "one (bound to each scheduler's KV cache manager: kvsched's read-only view)",
    )
    p.add_argument(
        "--divergent-hits",
        action="store_true",
        help="with --connector: the RandomKVConnector claims supports_divergent_local_hybrid_hits (vLLM's NIXL and "
        "MoRI-IO do); with --mamba-prefix-caching both schedulers look a new request's local hit up group by group "
        "(prints how many lookups had a diverged hit)",
    )
    p.add_argument("--kv-events", action="store_true", help="KV cache events on, published batches compared")
    p.add_argument(
        "--sliding-window",
        action="store_true",
        help="a sliding-window model (one SlidingWindowSpec group, a window drawn per seed); with --connector in "
        "every role",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="a hybrid model: several KV cache groups (full attention and sliding windows, drawn per seed); with "
        "--connector in every role",
    )
    p.add_argument(
        "--mamba",
        action="store_true",
        help="a hybrid Mamba model: Mamba KV cache groups (vLLM's mamba_cache_mode 'none', prefix caching off) with "
        "full attention and sometimes a window, drawn per seed; not with --sliding-window, --hybrid or --mm; with "
        "--kv-events (and --mamba-prefix-caching, where the Mamba groups cache states) prints the events compared per "
        "kind and group kind",
    )
    p.add_argument(
        "--mamba-align",
        action="store_true",
        help="with --mamba: vLLM's mamba_cache_mode 'align' (block-sized Mamba state blocks, block-aligned prefill "
        "chunks; prefix caching off)",
    )
    p.add_argument(
        "--mamba-prefix-caching",
        action="store_true",
        help="with --mamba-align: prefix caching on (vLLM's default for hybrid Mamba models: Mamba prefix hits, "
        "cached states at block boundaries, shared-prefix junction stops); prints the admissions with a prefix hit",
    )
    p.add_argument(
        "--mamba-retention",
        type=int,
        default=None,
        metavar="BLOCKS",
        help="with --mamba-prefix-caching: vLLM's sparse retention of cached Mamba states "
        "(prefix_cache_retention_interval, its engine default 0), the interval in blocks: 0 keeps the states a later "
        "request can resume at only, N also one every N blocks; -1 draws it per seed (dense, 0, 1-3 blocks); "
        "default: dense (None); --retention is the same for windows too",
    )
    p.add_argument(
        "--retention",
        type=int,
        default=None,
        metavar="BLOCKS",
        help="with --sliding-window, --hybrid or --mamba-prefix-caching: vLLM's sparse retention of "
        "cached sliding-window blocks and Mamba states (prefix_cache_retention_interval, its engine default 0), the "
        "interval in blocks: 0 keeps what a later request can resume at only (a window's blocks a hit there needs), "
        "N also that at the end of every N blocks (0 on a layout without a window); -1 draws it per seed (dense, 0, "
        "1-3 blocks); default: dense (None)",
    )
    p.add_argument(
        "--group-block-factors",
        default=None,
        metavar="F1,F2,...",
        help="with --hybrid: KV cache groups of different block sizes (vLLM's engine raises the block size of the "
        "groups with smaller pages): group g's block size is the drawn block size times F_g (the last factor "
        "repeated; the first group keeps the block size), -1 draws a factor in 1..4 per group and seed",
    )
    p.add_argument(
        "--first-group-factor",
        type=int,
        default=0,
        metavar="F",
        help="with --group-block-factors: the first KV cache group's block size is the drawn block size times F "
        "(-1: drawn in 2..4 per seed), and the first group of another kind keeps the block size when no other "
        "group does (vLLM lists the group of the larger blocks first: MiMo-V2)",
    )
    p.add_argument(
        "--mamba-checkpoints",
        action="store_true",
        help="with --mamba-prefix-caching: the Mamba groups declare prefill checkpoints (vLLM 0.33's Mamba2 and "
        "Gated DeltaNet layers: the last prefill chunk exports a block-boundary state into an extra block), the "
        "alignment drawn per seed (one token, one to three blocks)",
    )
    p.add_argument(
        "--chunked-local",
        action="store_true",
        help="with --hybrid: layouts with chunked-local attention groups (Llama 4: full attention and chunks of a "
        "drawn size, sometimes a sliding window too)",
    )
    p.add_argument("--mm", action="store_true", help="a multimodal model: requests with images")
    p.add_argument("--ec", action="store_true", help="with a seeded RandomECConnector (with --mm: images loaded)")
    p.add_argument(
        "--defer-async-loads",
        action="store_true",
        help="with --connector: asynchronous loads admitted while a step is in flight are registered once it is "
        "processed (vLLM 0.33's defer_async_loads, set on both schedulers; acts with the consumer roles' deferred "
        "frees under async scheduling)",
    )
    p.add_argument(
        "--budgets",
        action="store_true",
        help="speculative decoding with parallel drafting (k - 1 extra query slots per scheduled request from "
        "max_num_batched_tokens) and a token budget (max_num_scheduled_tokens) below the input budget",
    )
    p.add_argument(
        "--streaming",
        action="store_true",
        help="some requests are streaming-input sessions (resumable): parts appended while they run, wait or wait "
        "for input, input ended at random (not with --mm, which kvsched.vllm refuses for them)",
    )
    p.add_argument(
        "--pp",
        action="store_true",
        help="pipeline parallelism: a pipeline-parallel size of 2-4 drawn per seed, steps kept in flight as vLLM's "
        "engine does with it (its batch queue: the size, plus one with async scheduling on model runner V2); not "
        "with async-v1, which vLLM refuses with pipeline parallelism",
    )
    p.add_argument(
        "--eagle",
        action="store_true",
        help="every run with an EAGLE drafter and vLLM's default prefix-cache rules for it (look-ahead block hashes; "
        "the trailing-block drop with --connector and on vLLM 0.32; with --mamba without --mamba-prefix-caching, "
        "whose prefix caching is off, they act on nothing); with --sliding-window, --hybrid or "
        "--mamba-prefix-caching, half the runs on vLLM 0.33 with the drop instead of "
        "the look-ahead hashes (disable_lookahead_block_hashes; not with chunked-local groups, where vLLM has no "
        "drop); with --mm the drafter's prefill lookahead widens the encoder window; not with --streaming",
    )
    p.add_argument(
        "--dflash",
        action="store_true",
        help="with --eagle: the drafter taken for a DFlash one (k + 1 lookahead slots, vLLM's cap on drafting "
        "requests)",
    )
    p.add_argument(
        "--eagle-drop",
        action="store_true",
        help="with --eagle: the runs that draw between the trailing-block drop and vLLM 0.33's look-ahead hashes all "
        "take the drop",
    )
    p.add_argument(
        "--eagle-lookahead",
        action="store_true",
        help="with --eagle on vLLM 0.33: the runs that draw between the trailing-block drop and the look-ahead "
        "hashes all take the look-ahead hashes",
    )
    p.add_argument(
        "--eagle-groups",
        action="store_true",
        help="with --eagle and --mamba-prefix-caching: vLLM's is_eagle_group marks one attention group of each kind "
        "(the drafter's layers, as vLLM's planner marks an MTP model's), the Mamba groups not",
    )
    p.add_argument(
        "--mla",
        action="store_true",
        help="multi-head latent attention (DeepSeek, Kimi): the full-attention and sliding-window KV cache groups "
        "are MLAAttentionSpec and SlidingWindowMLASpec groups",
    )
    p.add_argument(
        "--ring",
        action="store_true",
        help="compressor rings (DeepSeek V4.1, GLM-5, Qwen4, Step 5): one or two CircularBufferSpec groups (one "
        "block per request, never cached) placed among the drawn groups, a ring size dividing the block, "
        "compressed full-attention groups (tokens_per_state) and mixed precisions drawn per seed; not with DCP, "
        "which kvsched.vllm refuses with rings",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="bounded prefix replay (DeepSeek V4.1): the drawn layout's sliding windows of one size, or a drawn "
        "window, become SlidingWindowMLASpec groups with bounded_replay after a full-attention group; not with "
        "Mamba or cross-attention groups, which kvsched.vllm refuses with replay",
    )
    p.add_argument(
        "--replay-first",
        action="store_true",
        help="with --replay, DeepSeek V4.1's own layout: a replayed window first (before the full-attention group "
        "that hashes), the replayed windows' blocks smaller than the block (a divisor of it, or in some runs 3 or 6 "
        "tokens), drawn per seed",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="as --eagle, with a multi-module MTP drafter of 2-4 modules (one per draft, drawn per seed): vLLM's "
        "prefill lookahead of that many tokens (chunks never end within it of the known tokens, the reprefillable "
        "tail stays out of the prefix cache, windows keep that many tokens less one below them; with --mm the "
        "encoder window reaches that many tokens past a chunk); not with --streaming or --mamba-prefix-caching",
    )
    p.add_argument(
        "--dcp",
        type=int,
        default=1,
        help="vLLM's decode context parallel size: one block id covers block_size tokens on each "
        "DCP rank; not with --connector, --sliding-window or --hybrid, which kvsched.vllm refuses with it",
    )
    p.add_argument(
        "--pcp",
        type=int,
        default=1,
        help="vLLM's prefill context parallel size (with --dcp: DCP 1 or the PCP size); vLLM runs it on model "
        "runner V2 only (the modes default to sync-v2,async-v2)",
    )
    p.add_argument(
        "--enc-dec",
        action="store_true",
        help="an encoder-decoder model: a full-attention and a cross-attention KV cache group, requests with encoder "
        "inputs, encoder-decoder scheduling with a small encoder budget and EncoderDecoderCacheManager; not with "
        "--connector, --kv-events, --sliding-window, --hybrid, --mm, --ec or --streaming",
    )
    p.add_argument(
        "--block-sizes",
        default="",
        help="comma-separated block sizes (per DCP rank) to draw each seed's from, e.g. 3,12,272 (default: 4, 8 or "
        "16); a size above 16 scales the drawn model length and token budget with it",
    )
    p.add_argument(
        "--hash-block-size",
        type=int,
        default=None,
        metavar="N",
        help="with --hybrid or --mamba-prefix-caching: the requests' hash block (vLLM's hash_block_size, set "
        "through prefix_match_unit), N tokens, a divisor of every drawn block size below it; -1 draws one per seed; "
        "prefix caching on; with Mamba groups, prefix hits end inside a block (a draw with a window beside them "
        "keeps the block's unit); not with --connector, --kv-events or --eagle (kvsched.vllm refuses them with a "
        "hash block smaller than the block)",
    )
    args = p.parse_args(argv)
    args.eagle = args.eagle or args.mtp  # (--mtp is --eagle with a multi-module MTP drafter)
    block_sizes = tuple(int(b) for b in args.block_sizes.split(",") if b)
    group_block_factors = tuple(int(f) for f in (args.group_block_factors or "").split(",") if f)
    if group_block_factors and (not args.hybrid or args.chunked_local):
        p.error("--group-block-factors goes with --hybrid (without --chunked-local)")
    if any(f == 0 or f < -1 for f in group_block_factors):
        p.error("--group-block-factors takes factors >= 1 or -1 (drawn)")
    if args.first_group_factor and (not group_block_factors or args.first_group_factor < -1):
        p.error("--first-group-factor takes a factor >= 1 or -1 (drawn) and goes with --group-block-factors")
    if any(b < 1 for b in block_sizes):
        p.error("--block-sizes takes sizes >= 1")
    if args.modes is None:
        if args.pcp > 1:
            args.modes = "sync-v2,async-v2"
        else:
            args.modes = "sync-v1,sync-v2,async-v2" if args.pp else "sync-v1,sync-v2,async-v1,async-v2"
    if (args.dcp > 1 or args.pcp > 1) and (args.sliding_window or args.hybrid):
        p.error("--dcp and --pcp go without --sliding-window and --hybrid")
    if args.pcp > 1 and any(m.endswith("-v1") for m in args.modes.split(",")):
        p.error("--pcp goes with model runner V2 only (vLLM runs prefill context parallelism there only)")
    if args.pp and "async-v1" in args.modes.split(","):
        p.error(
            "--pp goes without async-v1 (vLLM refuses async scheduling on model runner V1 with pipeline parallelism)"
        )
    if args.dflash and (not args.eagle or args.mtp):
        p.error("--dflash goes with --eagle, without --mtp")
    if (args.eagle or args.mtp) and args.streaming:
        p.error("--eagle and --mtp go without --streaming")
    if args.enc_dec and (
        args.connector
        or args.kv_events
        or args.sliding_window
        or args.hybrid
        or args.mamba
        or args.mm
        or args.ec
        or args.streaming
    ):
        p.error(
            "--enc-dec goes without --connector, --kv-events, --sliding-window, --hybrid, --mamba, --mm, --ec, "
            "--streaming"
        )
    if args.streaming and args.mm:
        p.error("--streaming goes without --mm")
    if args.hybrid and (args.sliding_window or args.mm):
        p.error("--hybrid goes without --sliding-window and --mm")
    if args.connector and args.hybrid and args.chunked_local:
        p.error("--connector goes without --chunked-local (kvsched.vllm refuses connectors with chunked-local groups)")
    if args.mamba_align and not args.mamba:
        p.error("--mamba-align goes with --mamba")
    if args.mamba_prefix_caching and not args.mamba_align:
        p.error("--mamba-prefix-caching goes with --mamba-align")
    if args.mamba_retention is not None and not args.mamba_prefix_caching:
        p.error("--mamba-retention goes with --mamba-prefix-caching")
    if (args.eagle_drop or args.eagle_groups or args.eagle_lookahead) and not args.eagle:
        p.error("--eagle-drop, --eagle-lookahead and --eagle-groups go with --eagle")
    if args.eagle_drop and args.eagle_lookahead:
        p.error("--eagle-drop and --eagle-lookahead exclude each other")
    if args.eagle_groups and not args.mamba_prefix_caching:
        p.error("--eagle-groups goes with --mamba-prefix-caching")
    if args.mamba_checkpoints and not args.mamba_prefix_caching:
        p.error("--mamba-checkpoints goes with --mamba-prefix-caching")
    if args.retention is not None and args.mamba_retention is not None:
        p.error("--retention goes without --mamba-retention (the same setting)")
    if args.retention is not None and not (args.sliding_window or args.hybrid or args.mamba_prefix_caching):
        p.error("--retention goes with --sliding-window, --hybrid or --mamba-prefix-caching")
    if args.mamba and (args.sliding_window or args.hybrid or args.mm):
        p.error("--mamba goes without --sliding-window, --hybrid and --mm")
    if args.chunked_local and not args.hybrid:
        p.error("--chunked-local goes with --hybrid")
    if args.lazy_offload and not args.cpu_offload:
        p.error("--lazy-offload goes with --cpu-offload")
    if args.cpu_offload and (args.connector or args.sliding_window or args.chunked_local or args.enc_dec):
        # (One sliding-window group: vLLM's connector asserts a full-attention group at construction.)
        p.error("--cpu-offload goes without --connector, --sliding-window, --chunked-local and --enc-dec")
    if args.cpu_offload and args.mamba and not args.mamba_prefix_caching:
        # (The connector needs prefix caching, which makes vLLM's Mamba groups align-mode ones.)
        p.error("--cpu-offload with --mamba goes with --mamba-align --mamba-prefix-caching")
    if (args.mooncake_store or args.umbp_store) and args.mamba and not args.mamba_prefix_caching:
        # (The store connectors check that vLLM's Mamba groups are align-mode ones, which prefix caching makes.)
        p.error("--mooncake-store and --umbp-store with --mamba go with --mamba-align --mamba-prefix-caching")
    if args.mooncake_store and (args.connector or args.cpu_offload or args.chunked_local or args.enc_dec):
        p.error("--mooncake-store goes without --connector, --cpu-offload, --chunked-local and --enc-dec")
    if args.umbp_store and (
        args.connector or args.cpu_offload or args.mooncake_store or args.chunked_local or args.enc_dec or args.pp
    ):
        p.error(
            "--umbp-store goes without --connector, --cpu-offload, --mooncake-store, --chunked-local, --enc-dec "
            "and --pp (UMBP refuses pipeline parallelism)"
        )
    if args.umbp_store and RULES.version == "0.32":
        p.error("--umbp-store: vLLM 0.32 has no UMBPStoreConnector")
    if args.hash_block_size is not None and (
        not (args.hybrid or args.mamba_prefix_caching)
        or args.connector
        or args.kv_events
        or args.eagle
        or args.hash_block_size == 0
    ):
        p.error(
            "--hash-block-size goes with --hybrid or --mamba-prefix-caching, without --connector, --kv-events and "
            "--eagle (refused)"
        )
    if args.sync_invalid and not (args.connector or args.umbp_store):
        p.error("--sync-invalid goes with --connector or --umbp-store")
    if args.multi_connector and not args.connector:
        p.error("--multi-connector goes with --connector")
    if args.divergent_hits and not args.connector:
        p.error("--divergent-hits goes with --connector")
    if args.sliding_window and args.mm:
        p.error("--sliding-window and --mm are separate sweeps (a multimodal model with a window is not driven here)")
    import vllm

    print(
        f"vLLM {vllm.__version__}: its Scheduler/AsyncScheduler against kvsched.vllm.Scheduler "
        f"(PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'random')})",
        flush=True,
    )
    failures = 0
    roles = args.kv_roles.split(",") if args.connector or args.mooncake_store or args.umbp_store else [None]
    for mode in args.modes.split(","):
        sync, runner = mode.split("-")
        for role in roles:
            name = mode if role is None else f"{mode} {role}"
            ok = stopped = 0
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            bar = None
            if sys.stderr.isatty():  # a progress bar on a terminal; logs get the per-mode totals only
                with contextlib.suppress(ImportError):
                    from tqdm import tqdm

                    bar = tqdm(total=len(seeds), desc=name, unit="seed", leave=False)
            for seed in seeds:
                try:
                    run_seed(
                        seed,
                        args.steps,
                        async_scheduling=sync == "async",
                        v2=runner == "v2",
                        connector=role is not None and not (args.mooncake_store or args.umbp_store),
                        kv_role=role or "kv_both",
                        sync_invalid=args.sync_invalid,
                        multi_connector=args.multi_connector,
                        divergent_hits=args.divergent_hits,
                        kv_events=args.kv_events,
                        sliding_window=args.sliding_window,
                        hybrid=args.hybrid,
                        mamba=args.mamba,
                        mamba_align=args.mamba_align,
                        mamba_prefix_caching=args.mamba_prefix_caching,
                        mamba_retention=args.mamba_retention,
                        mamba_checkpoints=args.mamba_checkpoints,
                        retention=args.retention,
                        chunked_local=args.chunked_local,
                        multimodal=args.mm,
                        ec_connector=args.ec,
                        defer_async_loads=args.defer_async_loads,
                        budgets=args.budgets,
                        streaming=args.streaming,
                        pp=args.pp,
                        eagle=args.eagle,
                        dflash=args.dflash,
                        eagle_drop=args.eagle_drop,
                        eagle_lookahead=args.eagle_lookahead,
                        eagle_groups=args.eagle_groups,
                        mtp=args.mtp,
                        dcp=args.dcp,
                        pcp=args.pcp,
                        mla=args.mla,
                        ring=args.ring,
                        replay=args.replay,
                        replay_first=args.replay_first,
                        encoder_decoder=args.enc_dec,
                        cpu_offload=args.cpu_offload,
                        lazy_offload=args.lazy_offload,
                        mooncake_store=args.mooncake_store,
                        umbp_store=args.umbp_store,
                        block_sizes=block_sizes,
                        hash_block_size=args.hash_block_size,
                        group_block_factors=group_block_factors,
                        first_group_factor=args.first_group_factor,
                    )
                    ok += 1
                except Divergence as exc:
                    failures += 1
                    print(f"[{name}] seed {seed}: {str(exc)[:2000]}", file=sys.stderr, flush=True)
                except VllmStopped as exc:
                    stopped += 1
                    print(f"[{name}] seed {seed}: stopped by vLLM itself at {exc}", flush=True)
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            note = f"; {stopped} stopped early by vLLM's own scheduler, identical until then" if stopped else ""
            global PREFIX_HITS
            if (
                args.mamba_prefix_caching
                or args.retention is not None
                or args.hash_block_size is not None
                or group_block_factors
                or args.ring
                or args.replay
            ):
                note += f"; {PREFIX_HITS} admissions with a prefix hit"
            PREFIX_HITS = 0
            global FINER_HASH_SEEDS, PARTIAL_BLOCK_HITS, BLOCK_COPIES
            if args.hash_block_size is not None:
                note += f"; {FINER_HASH_SEEDS} runs with a hash block smaller than the block"
            if args.mamba_prefix_caching or args.hash_block_size is not None:
                note += (
                    f"; {PARTIAL_BLOCK_HITS} admissions resuming inside a block (prefix hits or loaded tokens); "
                    f"{BLOCK_COPIES} block copies"
                )
            FINER_HASH_SEEDS = PARTIAL_BLOCK_HITS = BLOCK_COPIES = 0
            if args.ring:
                note += "; compressor rings: " + ", ".join(f"{k} {n}" for k, n in RING_COUNTS.items())
                RING_COUNTS.clear()
            if args.replay:
                note += "; bounded replay: " + ", ".join(f"{k} {n}" for k, n in REPLAY_COUNTS.items())
                REPLAY_COUNTS.clear()
            global MIXED_BLOCK_SEEDS, MIXED_LARGER_FIRST
            if group_block_factors:
                note += f"; {MIXED_BLOCK_SEEDS} runs with KV cache groups of different block sizes"
                if args.first_group_factor:
                    note += f" ({MIXED_LARGER_FIRST} with the larger blocks first)"
                if MIXED_BLOCK_CONNECTOR:
                    note += (
                        " (connector allocation calls there: "
                        + ", ".join(f"{n} {k}" for k, n in sorted(MIXED_BLOCK_CONNECTOR.items()))
                        + ")"
                    )
            MIXED_BLOCK_SEEDS = MIXED_LARGER_FIRST = 0
            MIXED_BLOCK_CONNECTOR.clear()
            if args.divergent_hits:
                note += (
                    f"; {DIVERGED_HITS['diverged']} lookups with a diverged local hit (a request skipped or not "
                    f"fitting is looked up again), {DIVERGED_HITS['replaced']} of them replaced by the usual hit"
                )
                DIVERGED_HITS.clear()
            if args.cpu_offload:
                note += "; offload: " + ", ".join(f"{n} {k}" for k, n in sorted(OFFLOAD_COUNTS.items()))
                OFFLOAD_COUNTS.clear()
            if args.mooncake_store:
                note += "; store stand-in: " + ", ".join(f"{n} {k}" for k, n in sorted(MOONCAKE_COUNTS.items()))
                MOONCAKE_COUNTS.clear()
            if MAMBA_EVENT_COUNTS:
                note += "; KV events: " + ", ".join(f"{n} {k}" for k, n in sorted(MAMBA_EVENT_COUNTS.items()))
                MAMBA_EVENT_COUNTS.clear()
            if args.umbp_store:
                note += "; UMBP stand-in: " + ", ".join(f"{n} {k}" for k, n in sorted(UMBP_COUNTS.items()))
                UMBP_COUNTS.clear()
            print(f"{name}: {ok}/{args.seeds} seeds x {args.steps} steps without a difference{note}", flush=True)
    return 1 if failures else 0


_: Callable[..., Any] = main

if __name__ == "__main__":
    raise SystemExit(main())
