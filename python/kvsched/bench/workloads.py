"""Benchmark workloads: seeded, deterministic request streams that every implementation replays identically.

A :class:`Scenario` is the recipe (sizes, distributions, scheduler settings, seed); :func:`generate` turns it
into a :class:`Workload`, the concrete list of requests. The same scenario and scale always give the same
requests, byte for byte, on every machine: all randomness comes from a seeded ``numpy.random.PCG64``.

The fake model is here too (:func:`sampled_token`): the token sampled for a request at an output position is a
pure function of the request's index and that position, so every implementation sees the same token stream.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from kvsched.config import SchedulerConfig

__all__ = [
    "BENCH_CONFIG",
    "SCENARIOS",
    "VOCAB_SIZE",
    "Scenario",
    "TraceRequest",
    "Workload",
    "generate",
    "get_scenario",
    "req_id",
    "sampled_token",
    "sampled_tokens",
]

VOCAB_SIZE = 32000
# Token ids 0..2 are left out of prompts and samples (often pad/bos/eos); nothing stops on them anyway.
_FIRST_TOKEN = 3

IntArray = npt.NDArray[np.int64]


def sampled_token(idx: int, pos: int, vocab: int = VOCAB_SIZE) -> int:
    """The token the fake model samples for request ``idx`` at output position ``pos`` (0-based)."""
    return _FIRST_TOKEN + (idx * 1000003 + pos * 7919 + 12345) % (vocab - _FIRST_TOKEN)


def sampled_tokens(idx: IntArray, pos: IntArray, vocab: int = VOCAB_SIZE) -> IntArray:
    """Vectorised :func:`sampled_token`, as int64: the dtype ``update_from_output`` reads without a copy."""
    return _FIRST_TOKEN + (idx * 1000003 + pos * 7919 + 12345) % (vocab - _FIRST_TOKEN)


def req_id(idx: int) -> str:
    """The request id used for request ``idx``: zero-padded: string order = index order."""
    return f"r{idx:06d}"


# What every scenario's scheduler starts from: a fixed hash seed makes prefix hashes, and hence the run,
# reproducible; auto's constants are in units of one token's recompute: an estimate for a 1B-class model on one
# modern GPU (~5 µs to prefill a token; a 16-token block of a 16-layer, 8-KV-head, head-dim-64 bf16 model is
# 512 KiB, ~20 µs over PCIe one way), not a measurement.
BENCH_CONFIG = SchedulerConfig(prefix_hash_seed=0, swap_cost_per_block=4.0)
_CONFIG_FIELDS = frozenset(f.name for f in fields(SchedulerConfig))


@dataclass(frozen=True, init=False)
class Scenario:
    """The recipe of a workload: request stream plus scheduler config. Sizes are before scaling.

    Keywords named after :class:`SchedulerConfig` fields override those of ``config`` (which defaults to
    :data:`BENCH_CONFIG`), so ``dataclasses.replace(scenario, policy="priority")`` works, and so does a flat
    dict of both (:meth:`from_dict`, trace headers). The config's fields read through the scenario too
    (``scenario.num_blocks``); typed code reads ``scenario.config``.
    """

    name: str
    description: str
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range, uniform
    output_len: tuple[int, int]  # inclusive range, uniform
    arrival: Literal["all_at_start", "poisson", "bursty"]
    arrival_rate: float  # requests per step (poisson; bursty: on average)
    burst_size: int  # bursty: this many requests arrive together, every burst_size / arrival_rate steps
    num_prefix_groups: int
    prefix_len: tuple[int, int]
    prefix_fraction: float  # share of requests that start with one of the group prefixes
    num_priorities: int
    seed: int
    scale: float
    num_tenants: int  # request i belongs to tenant i % num_tenants (named "t<k>")
    config: SchedulerConfig

    def __init__(
        self,
        name: str,
        description: str,
        num_requests: int,
        prompt_len: tuple[int, int],
        output_len: tuple[int, int],
        arrival: Literal["all_at_start", "poisson", "bursty"] = "all_at_start",
        arrival_rate: float = 1.0,
        burst_size: int = 1,
        num_prefix_groups: int = 0,
        prefix_len: tuple[int, int] = (0, 0),
        prefix_fraction: float = 0.0,
        num_priorities: int = 1,
        seed: int = 0,
        scale: float = 1.0,
        num_tenants: int = 1,
        config: SchedulerConfig = BENCH_CONFIG,
        **config_fields: Any,
    ) -> None:
        unknown = sorted(set(config_fields) - _CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"Scenario got unexpected keyword arguments: {', '.join(unknown)}")
        values = dict(locals())
        for f in fields(self):
            object.__setattr__(self, f.name, values[f.name])
        if config_fields:
            object.__setattr__(self, "config", replace(config, **config_fields))

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            # Only reached for names that are not attributes: a config field reads through to the config.
            if name in _CONFIG_FIELDS:
                return getattr(self.config, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def with_config(self, **changes: Any) -> Scenario:
        """This scenario with ``changes`` applied to its config."""
        return replace(self, config=replace(self.config, **changes))

    def scaled(self, scale: float) -> Scenario:
        """Request and block counts multiplied by ``scale`` (enough blocks kept for progress)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if scale == 1.0:
            return self
        num_requests = max(1, round(self.num_requests * scale))
        num_blocks = max(self.min_num_blocks(), round(self.config.num_blocks * scale))
        num_cpu_blocks = self.config.num_cpu_blocks
        num_cpu_blocks = max(1, round(num_cpu_blocks * scale)) if num_cpu_blocks else 0
        return replace(
            self,
            num_requests=num_requests,
            scale=self.scale * scale,
            config=replace(self.config, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks),
        )

    def min_num_blocks(self) -> int:
        """Enough blocks for two of the largest possible requests (so the run always makes progress), and for
        one request of ``max_model_len`` tokens (the config requires it)."""
        block_size, max_model_len = self.config.block_size, self.config.max_model_len
        longest = min(self.prompt_len[1] + self.output_len[1], max_model_len)
        return max(2 * math.ceil(longest / block_size), math.ceil(max_model_len / block_size)) + 1

    def scheduler_config(self) -> SchedulerConfig:
        return self.config

    def to_dict(self) -> dict[str, Any]:
        """The scenario's fields and its config's, in one flat dict (what :meth:`from_dict` reads)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}
        return {**own, **self.config.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        values = dict(data)
        for key in ("prompt_len", "output_len", "prefix_len"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)


_C = Scenario(
    name="c",
    description="mixed prefill + decode, chunked prefill, Poisson arrivals, shared prefixes",
    num_requests=2000,
    prompt_len=(200, 4000),
    output_len=(32, 512),
    arrival="poisson",
    arrival_rate=1.0,
    num_prefix_groups=8,
    prefix_len=(256, 2048),
    prefix_fraction=0.5,
    seed=3,
    config=replace(BENCH_CONFIG, num_blocks=80000, max_num_seqs=256, max_num_batched_tokens=8192),
)

SCENARIOS: dict[str, Scenario] = {
    "a": Scenario(
        name="a",
        description="steady decode",
        num_requests=256,
        prompt_len=(512, 512),
        output_len=(256, 256),
        seed=1,
        config=replace(BENCH_CONFIG, num_blocks=32768, max_num_seqs=256, max_num_batched_tokens=8192),
    ),
    "b": Scenario(
        name="b",
        description="large batch",
        num_requests=1024,
        prompt_len=(512, 512),
        output_len=(256, 256),
        seed=2,
        config=replace(BENCH_CONFIG, num_blocks=65536, max_num_seqs=1024, max_num_batched_tokens=16384),
    ),
    "c": _C,
    # d and e replay c's request stream (same seed), so the effect of memory pressure / priority is isolated.
    "d": replace(_C, name="d", description="c under memory pressure (frequent preemption)").with_config(
        num_blocks=6000
    ),
    "e": replace(_C, name="e", description="d with priority scheduling, 4 levels", num_priorities=4).with_config(
        num_blocks=6000, policy="priority"
    ),
    # Many requests share a few long prefixes, arrive in bursts, and the pool holds only some of the prefixes
    # next to the running requests: the case cache-aware admission is for (compare --admission-window 0).
    "f": Scenario(
        name="f",
        description="shared prefixes, tight pool, bursty arrivals; cache-aware admission window 16",
        num_requests=2000,
        prompt_len=(600, 1600),
        output_len=(16, 128),
        arrival="bursty",
        arrival_rate=1.0,
        burst_size=32,
        num_prefix_groups=24,
        prefix_len=(512, 1024),
        prefix_fraction=0.9,
        seed=6,
        config=replace(
            BENCH_CONFIG,
            num_blocks=1500,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            cache_aware_admission_window=16,
        ),
    ),
    # Long contexts under memory pressure: each victim holds thousands of tokens of KV, the case for keeping
    # it (compare --preemption-mode recompute,swap,auto). A third of the prompts share one of 4 long prefixes,
    # which stay resident while their group runs (auto recomputes victims whose context is mostly shared).
    # The CPU pool holds half of the GPU pool.
    "g": Scenario(
        name="g",
        description="long contexts (2-8k-token prompts) in a tight pool: preemption by recompute vs swap",
        num_requests=240,
        prompt_len=(2000, 8000),
        output_len=(256, 1024),
        arrival="poisson",
        arrival_rate=0.5,
        num_prefix_groups=4,
        prefix_len=(1024, 2048),
        prefix_fraction=0.33,
        seed=7,
        config=replace(
            BENCH_CONFIG,
            num_blocks=3000,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            max_model_len=8704,
            num_cpu_blocks=1500,
        ),
    ),
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(SCENARIOS)}") from None


@dataclass(frozen=True)
class TraceRequest:
    idx: int
    arrival_step: int
    priority: int
    max_tokens: int
    prompt_token_ids: npt.NDArray[np.int32]
    tenant: int = 0

    @property
    def req_id(self) -> str:
        return req_id(self.idx)


@dataclass
class Workload:
    """A concrete request stream (sorted by arrival step, then index) and the scenario it came from."""

    scenario: Scenario
    requests: list[TraceRequest]
    vocab: int = VOCAB_SIZE
    source: str = field(default="generated")
    _min_prompt: int | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.scenario.name

    def prompt_lens(self) -> IntArray:
        """Prompt length by request index."""
        lens = np.zeros(self.max_idx() + 1, dtype=np.int64)
        for r in self.requests:
            lens[r.idx] = len(r.prompt_token_ids)
        return lens

    def max_idx(self) -> int:
        return max((r.idx for r in self.requests), default=-1)

    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def min_prompt_tokens_computed(self) -> int:
        """Prompt tokens an infinite prefix cache would compute: requests in arrival order, each hitting the
        longest run of full blocks (capped so its last token is computed) seen in any earlier prompt. What a
        run computes beyond this is recomputation (evicted prefixes, preemptions)."""
        if self._min_prompt is None:
            bs = self.scenario.config.block_size
            seen: set[bytes] = set()
            total = 0
            for r in self.requests:
                tokens = r.prompt_token_ids.astype(np.int32).tobytes()
                n = len(r.prompt_token_ids)
                h = hashlib.blake2b(digest_size=16)
                hits, hitting = 0, True
                for i in range(n // bs):
                    h.update(tokens[4 * i * bs : 4 * (i + 1) * bs])
                    key = h.digest()
                    if hitting and i < (n - 1) // bs and key in seen:
                        hits += 1
                    else:
                        hitting = False
                    seen.add(key)
                total += n - hits * bs
            self._min_prompt = total
        return self._min_prompt


def _uniform(rng: np.random.Generator, lo_hi: tuple[int, int], n: int) -> IntArray:
    lo, hi = lo_hi
    return rng.integers(lo, hi + 1, size=n, dtype=np.int64)


def generate(scenario: Scenario) -> Workload:
    """Build the workload of ``scenario`` (already scaled, if wanted). Deterministic in the scenario."""
    n = scenario.num_requests
    rng = np.random.Generator(np.random.PCG64(scenario.seed))
    vocab_lo, vocab_hi = _FIRST_TOKEN, VOCAB_SIZE

    prompt_lens = _uniform(rng, scenario.prompt_len, n)
    output_lens = _uniform(rng, scenario.output_len, n)
    if scenario.arrival == "poisson":
        gaps = rng.exponential(1.0 / scenario.arrival_rate, size=n)
        arrival_steps = np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)
    elif scenario.arrival == "bursty":
        period = scenario.burst_size / scenario.arrival_rate
        arrival_steps = np.floor(np.arange(n) // scenario.burst_size * period).astype(np.int64)
    else:
        arrival_steps = np.zeros(n, dtype=np.int64)

    prefixes: list[npt.NDArray[np.int32]] = []
    group = np.full(n, -1, dtype=np.int64)
    if scenario.num_prefix_groups > 0 and scenario.prefix_fraction > 0:
        for plen in _uniform(rng, scenario.prefix_len, scenario.num_prefix_groups):
            prefixes.append(rng.integers(vocab_lo, vocab_hi, size=int(plen), dtype=np.int32))
        grouped = rng.random(n) < scenario.prefix_fraction
        group = np.where(grouped, rng.integers(0, scenario.num_prefix_groups, size=n), -1)

    # Priorities come from their own stream, so scenarios that differ only in priority share every prompt.
    prio_rng = np.random.Generator(np.random.PCG64(scenario.seed + 1_000_003))
    priorities = (
        prio_rng.integers(0, scenario.num_priorities, size=n)
        if scenario.num_priorities > 1
        else np.zeros(n, dtype=np.int64)
    )

    max_prompt = scenario.config.max_model_len - 1
    requests: list[TraceRequest] = []
    for i in range(n):
        g = int(group[i])
        if g >= 0:
            prefix = prefixes[g]
            suffix_len = max(int(prompt_lens[i]) - len(prefix), 1)
            suffix = rng.integers(vocab_lo, vocab_hi, size=suffix_len, dtype=np.int32)
            prompt = np.concatenate([prefix, suffix])[:max_prompt]
        else:
            prompt = rng.integers(vocab_lo, vocab_hi, size=int(prompt_lens[i]), dtype=np.int32)[:max_prompt]
        max_tokens = min(int(output_lens[i]), scenario.config.max_model_len - len(prompt))
        requests.append(
            TraceRequest(
                idx=i,
                arrival_step=int(arrival_steps[i]),
                priority=int(priorities[i]),
                max_tokens=max_tokens,
                prompt_token_ids=np.ascontiguousarray(prompt, dtype=np.int32),
                tenant=i % max(scenario.num_tenants, 1),
            )
        )
    requests.sort(key=lambda r: (r.arrival_step, r.idx))
    return Workload(scenario=scenario, requests=requests)
