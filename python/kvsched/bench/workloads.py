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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvsched.config import SchedulerConfig

__all__ = [
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


@dataclass(frozen=True)
class Scenario:
    """The recipe of a workload: request stream plus scheduler settings. Sizes are before scaling."""

    name: str
    description: str
    num_requests: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_len: tuple[int, int]  # inclusive range, uniform
    output_len: tuple[int, int]  # inclusive range, uniform
    arrival: Literal["all_at_start", "poisson", "bursty"] = "all_at_start"
    arrival_rate: float = 1.0  # requests per step (poisson; bursty: on average)
    burst_size: int = 1  # bursty: this many requests arrive together, every burst_size / arrival_rate steps
    num_prefix_groups: int = 0
    prefix_len: tuple[int, int] = (0, 0)
    prefix_fraction: float = 0.0  # share of requests that start with one of the group prefixes
    policy: Literal["fcfs", "priority", "fair"] = "fcfs"
    num_priorities: int = 1
    block_size: int = 16
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    seed: int = 0
    scale: float = 1.0
    cache_aware_admission_window: int = 0
    cache_aware_admission_threshold: float = 0.5
    num_tenants: int = 1  # request i belongs to tenant i % num_tenants (named "t<k>")
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    num_cpu_blocks: int = 0  # the CPU swap pool (swap / auto)
    # auto's constants, in units of one token's recompute: an estimate for a 1B-class model on one modern GPU
    # (~5 µs to prefill a token; a 16-token block of a 16-layer, 8-KV-head, head-dim-64 bf16 model is 512 KiB,
    # ~20 µs over PCIe one way), not a measurement.
    recompute_cost_per_token: float = 1.0
    swap_cost_per_block: float = 4.0

    def scaled(self, scale: float) -> Scenario:
        """Request and block counts multiplied by ``scale`` (enough blocks kept for progress)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if scale == 1.0:
            return self
        num_requests = max(1, round(self.num_requests * scale))
        num_blocks = max(self.min_num_blocks(), round(self.num_blocks * scale))
        num_cpu_blocks = max(1, round(self.num_cpu_blocks * scale)) if self.num_cpu_blocks else 0
        return replace(
            self,
            num_requests=num_requests,
            num_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            scale=self.scale * scale,
        )

    def min_num_blocks(self) -> int:
        """Enough blocks for two of the largest possible requests (so the run always makes progress), and for
        one request of ``max_model_len`` tokens (the config requires it)."""
        longest = min(self.prompt_len[1] + self.output_len[1], self.max_model_len)
        return max(2 * math.ceil(longest / self.block_size), math.ceil(self.max_model_len / self.block_size)) + 1

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            policy=self.policy,
            cache_aware_admission_window=self.cache_aware_admission_window,
            cache_aware_admission_threshold=self.cache_aware_admission_threshold,
            # A fixed seed makes prefix hashes, and hence the run, reproducible.
            prefix_hash_seed=0,
            preemption_mode=self.preemption_mode,
            num_cpu_blocks=self.num_cpu_blocks,
            recompute_cost_per_token=self.recompute_cost_per_token,
            swap_cost_per_block=self.swap_cost_per_block,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        fields = dict(data)
        for key in ("prompt_len", "output_len", "prefix_len"):
            if key in fields:
                fields[key] = tuple(fields[key])
        return cls(**fields)


_C = Scenario(
    name="c",
    description="mixed prefill + decode, chunked prefill, Poisson arrivals, shared prefixes",
    num_requests=2000,
    num_blocks=80000,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    prompt_len=(200, 4000),
    output_len=(32, 512),
    arrival="poisson",
    arrival_rate=1.0,
    num_prefix_groups=8,
    prefix_len=(256, 2048),
    prefix_fraction=0.5,
    seed=3,
)

SCENARIOS: dict[str, Scenario] = {
    "a": Scenario(
        name="a",
        description="steady decode",
        num_requests=256,
        num_blocks=32768,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        prompt_len=(512, 512),
        output_len=(256, 256),
        seed=1,
    ),
    "b": Scenario(
        name="b",
        description="large batch",
        num_requests=1024,
        num_blocks=65536,
        max_num_seqs=1024,
        max_num_batched_tokens=16384,
        prompt_len=(512, 512),
        output_len=(256, 256),
        seed=2,
    ),
    "c": _C,
    # d and e replay c's request stream (same seed), so the effect of memory pressure / priority is isolated.
    "d": replace(_C, name="d", description="c under memory pressure (frequent preemption)", num_blocks=6000),
    "e": replace(
        _C,
        name="e",
        description="d with priority scheduling, 4 levels",
        num_blocks=6000,
        policy="priority",
        num_priorities=4,
    ),
    # Many requests share a few long prefixes, arrive in bursts, and the pool holds only some of the prefixes
    # next to the running requests: the case cache-aware admission is for (compare --admission-window 0).
    "f": Scenario(
        name="f",
        description="shared prefixes, tight pool, bursty arrivals; cache-aware admission window 16",
        num_requests=2000,
        num_blocks=1500,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        prompt_len=(600, 1600),
        output_len=(16, 128),
        arrival="bursty",
        arrival_rate=1.0,
        burst_size=32,
        num_prefix_groups=24,
        prefix_len=(512, 1024),
        prefix_fraction=0.9,
        max_model_len=4096,
        cache_aware_admission_window=16,
        seed=6,
    ),
    # Long contexts under memory pressure: each victim holds thousands of tokens of KV, the case for keeping
    # it (compare --preemption-mode recompute,swap,auto). A third of the prompts share one of 4 long prefixes,
    # which stay resident while their group runs (auto recomputes victims whose context is mostly shared).
    # The CPU pool holds half of the GPU pool.
    "g": Scenario(
        name="g",
        description="long contexts (2-8k-token prompts) in a tight pool: preemption by recompute vs swap",
        num_requests=240,
        num_blocks=3000,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        prompt_len=(2000, 8000),
        output_len=(256, 1024),
        arrival="poisson",
        arrival_rate=0.5,
        num_prefix_groups=4,
        prefix_len=(1024, 2048),
        prefix_fraction=0.33,
        max_model_len=8704,
        num_cpu_blocks=1500,
        seed=7,
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
            bs = self.scenario.block_size
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

    max_prompt = scenario.max_model_len - 1
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
        max_tokens = min(int(output_lens[i]), scenario.max_model_len - len(prompt))
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
