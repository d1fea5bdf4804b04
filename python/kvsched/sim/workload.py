"""Simulated workloads: who sends what, when.

A :class:`WorkloadSpec` is the recipe (arrival process and rate, length distributions, tenants, priority
classes, shared-prefix groups, seed); :func:`generate_workload` turns it into a :class:`Workload`, the concrete
requests as struct-of-arrays. A workload can also come from a JSONL trace (:func:`load_trace`), one request per
line::

    {"arrival_time": 0.12, "prompt_len": 812, "output_len": 143, "tenant": "a", "priority": 0, "prefix_group": -1}

Only ``arrival_time``, ``prompt_len`` and ``output_len`` are required; ``tenant`` defaults to ``"default"``,
``priority`` to 0, ``prefix_group`` to -1 (none), ``prefix_len`` (tokens shared by the group) to 0. A first line
``{"tenants": {"a": 1.0, ...}}`` may give tenant weights. :func:`dump_trace` writes this format.

Arrivals are one renewal process at the total rate (Poisson: exponential gaps; gamma: gaps with the given
coefficient of variation), and each arrival is assigned a tenant with probability proportional to the tenant's
share. For Poisson arrivals this is exactly independent Poisson streams per tenant. The gaps are drawn for rate 1
and divided by the rate, so one seed gives the same requests at every rate, only closer together.

Lengths and ``max_model_len``: ``generate_workload(spec, max_model_len=M)`` clips every drawn prompt length to
``M - 1`` (so that a request has room for at least one output token) and counts the clipped ones
(:attr:`Workload.num_clipped_prompts`). Clipping changes no other draw: a workload whose prompts all fit is the
same, request for request, with or without ``max_model_len``. :func:`check_prompt_lengths` refuses a length
distribution whose mean does not fit at all. ``kvsched simulate`` passes the smallest ``max_model_len`` of the
sweep; the simulator caps each output length at ``max_model_len - prompt_len``.

Prompt token ids are made when a request is added (see :func:`prompt_tokens`): the group prefix (if any), then
two tokens that encode the request's index, then filler. Prefix-cache hashes chain from the first block, so no
two requests share a block unless they share a group prefix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._jsonl import TraceFormatError, iter_json_objects

__all__ = [
    "LengthDist",
    "TenantSpec",
    "TraceFormatError",
    "Workload",
    "WorkloadSpec",
    "WorkloadStream",
    "check_prompt_lengths",
    "dump_trace",
    "generate_workload",
    "load_trace",
    "parse_length",
    "parse_priorities",
    "parse_tenants",
    "prompt_tokens",
]

VOCAB_SIZE = 32000
_FIRST_TOKEN = 3  # ids 0..2 are left out (pad/bos/eos in many vocabularies)
_RANGE = VOCAB_SIZE - _FIRST_TOKEN
_POOL_SIZE = 1 << 16
# Requests drawn per chunk by WorkloadStream (and sliced per chunk from a Workload): about 0.5 MB of arrays.
CHUNK_REQUESTS = 1 << 13

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed`` (``a``), ``uniform`` (integers in ``[a, b]``) or ``lognormal``
    (mean ``a``, coefficient of variation ``b``), always clipped to ``[1, max_len]``."""

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    a: float = 256
    b: float = 0.0
    max_len: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise TraceFormatError(f"length distribution must be fixed, uniform or lognormal, got {self.kind!r}")
        if not (self.a >= 1 and math.isfinite(self.a)):
            raise TraceFormatError(f"length {self.kind}: first parameter must be >= 1, got {self.a}")
        if self.kind == "uniform" and not self.b >= self.a:
            raise TraceFormatError(f"length uniform: need a <= b, got {self.a}, {self.b}")
        if self.kind == "lognormal" and not (self.b >= 0 and math.isfinite(self.b)):
            raise TraceFormatError(f"length lognormal: cv must be >= 0, got {self.b}")
        if self.max_len < 1:
            raise TraceFormatError(f"max_len must be >= 1, got {self.max_len}")

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        if self.kind == "fixed":
            out = np.full(n, round(self.a), dtype=np.int64)
        elif self.kind == "uniform":
            out = rng.integers(round(self.a), round(self.b), size=n, endpoint=True, dtype=np.int64)
        else:
            # Mean a and CV b: sigma^2 = ln(1 + b^2), mu = ln(a) - sigma^2 / 2.
            s2 = math.log1p(self.b * self.b)
            mu = math.log(self.a) - s2 / 2
            out = np.rint(rng.lognormal(mu, math.sqrt(s2), size=n)).astype(np.int64)
        return np.clip(out, 1, self.max_len)

    def mean(self) -> float:
        """The mean of the distribution (before clipping)."""
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return float(self.a)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_length(text: str, max_len: int = 1 << 20) -> LengthDist:
    """``"512"`` or ``"fixed:512"``, ``"uniform:256:1024"``, ``"lognormal:1000:0.5"`` (mean, cv)."""
    parts = [p.strip() for p in text.split(":")]
    try:
        if len(parts) == 1:
            return LengthDist("fixed", float(parts[0]), max_len=max_len)
        kind = parts[0]
        nums = [float(p) for p in parts[1:]]
    except ValueError:
        raise TraceFormatError(f"bad length distribution {text!r}") from None
    if kind == "fixed" and len(nums) == 1:
        return LengthDist("fixed", nums[0], max_len=max_len)
    if kind in ("uniform", "lognormal") and len(nums) == 2:
        return LengthDist(kind, nums[0], nums[1], max_len=max_len)  # type: ignore[arg-type]
    raise TraceFormatError(f"bad length distribution {text!r}: use N, fixed:N, uniform:LO:HI or lognormal:MEAN:CV")


@dataclass(frozen=True)
class TenantSpec:
    """A tenant: its share of the request rate, its fair-share weight, and optionally a fixed priority."""

    name: str
    share: float = 1.0
    weight: float = 1.0
    priority: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise TraceFormatError("a tenant needs a name")
        if not (self.share > 0 and math.isfinite(self.share)):
            raise TraceFormatError(f"tenant {self.name}: share must be > 0, got {self.share}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise TraceFormatError(f"tenant {self.name}: weight must be > 0, got {self.weight}")


def parse_tenants(text: str) -> tuple[TenantSpec, ...]:
    """``"a:0.7,b:0.2:1:0,c:0.1:2"``: ``name:share[:weight[:priority]]`` per tenant."""
    tenants = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) > 4:
            raise TraceFormatError(f"bad tenant {item!r}: use name:share[:weight[:priority]]")
        try:
            share = float(parts[1]) if len(parts) > 1 else 1.0
            weight = float(parts[2]) if len(parts) > 2 else 1.0
            prio = int(parts[3]) if len(parts) > 3 and parts[3] != "" else None
        except ValueError:
            raise TraceFormatError(f"bad tenant {item!r}: use name:share[:weight[:priority]]") from None
        tenants.append(TenantSpec(parts[0], share, weight, prio))
    if not tenants:
        raise TraceFormatError(f"no tenant in {text!r}")
    if len({t.name for t in tenants}) != len(tenants):
        raise TraceFormatError(f"duplicate tenant name in {text!r}")
    return tuple(tenants)


def parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """``"0:0.2,1:0.8"``: priority value (lower is served first) and its fraction of requests."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            value, frac = item.split(":")
            out.append((int(value), float(frac)))
        except ValueError:
            raise TraceFormatError(f"bad priority class {item!r}: use value:fraction") from None
    if not out or any(not (f > 0 and math.isfinite(f)) for _, f in out):
        raise TraceFormatError(f"priority classes need positive fractions, got {text!r}")
    return tuple(out)


@dataclass(frozen=True)
class WorkloadSpec:
    """The recipe of a synthetic workload. ``rate`` is requests per second over all tenants; the workload
    spans ``duration`` seconds of arrivals, or ``num_requests`` requests if given."""

    rate: float = 4.0
    duration: float = 60.0
    num_requests: int | None = None
    arrival: Literal["poisson", "gamma"] = "poisson"
    cv: float = 1.0  # gamma arrivals: coefficient of variation of the gaps (1 = Poisson, > 1 = bursty)
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 1024))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 200))
    tenants: tuple[TenantSpec, ...] = (TenantSpec("default"),)
    priorities: tuple[tuple[int, float], ...] = ((0, 1.0),)
    num_prefix_groups: int = 0
    prefix_len: int = 0
    prefix_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise TraceFormatError(f"rate must be > 0, got {self.rate}")
        if self.num_requests is None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise TraceFormatError(f"duration must be > 0, got {self.duration}")
        if self.num_requests is not None and self.num_requests < 1:
            raise TraceFormatError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.arrival not in ("poisson", "gamma"):
            raise TraceFormatError(f"arrival must be poisson or gamma, got {self.arrival!r}")
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise TraceFormatError(f"cv must be > 0, got {self.cv}")
        if self.num_prefix_groups < 0 or self.prefix_len < 0 or not 0 <= self.prefix_fraction <= 1:
            raise TraceFormatError("prefix groups: need num_prefix_groups >= 0, prefix_len >= 0, fraction in [0, 1]")
        if not self.tenants:
            raise TraceFormatError("a workload needs at least one tenant")
        if not self.priorities or any(not (f >= 0 and math.isfinite(f)) for _, f in self.priorities):
            raise TraceFormatError(
                f"priorities: need at least one (priority, fraction) pair with fractions >= 0, got {self.priorities!r}"
            )
        if sum(f for _, f in self.priorities) <= 0:
            raise TraceFormatError(f"priorities: the fractions must not all be 0, got {self.priorities!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_len"] = str(self.prompt_len)
        d["output_len"] = str(self.output_len)
        return d


@dataclass
class Workload:
    """Concrete requests, struct-of-arrays, sorted by arrival time. ``tenant`` indexes ``tenant_names``."""

    arrival_time: FloatArray
    prompt_len: IntArray
    output_len: IntArray
    tenant: IntArray
    priority: IntArray
    prefix_group: IntArray  # -1: none
    prefix_len: IntArray  # tokens shared with the other requests of its group (0 if none)
    tenant_names: tuple[str, ...] = ("default",)
    tenant_weights: tuple[float, ...] = (1.0,)
    seed: int = 0
    source: str = "generated"
    # Prompts drawn longer than max_model_len - 1 and clipped to it (generate_workload(..., max_model_len=)).
    num_clipped_prompts: int = 0

    def __post_init__(self) -> None:
        n = len(self.arrival_time)
        for name in ("prompt_len", "output_len", "tenant", "priority", "prefix_group", "prefix_len"):
            if len(getattr(self, name)) != n:
                raise TraceFormatError(f"workload field {name} has {len(getattr(self, name))} entries, not {n}")
        if n and np.any(np.diff(self.arrival_time) < 0):
            raise TraceFormatError("workload arrival times must be sorted")
        if n and (not np.all(np.isfinite(self.arrival_time)) or self.arrival_time[0] < 0):
            raise TraceFormatError("workload arrival times must be finite and >= 0")
        if n and (self.prompt_len.min() < 1 or self.output_len.min() < 1):
            raise TraceFormatError("prompt_len and output_len must be >= 1")
        if n and (self.tenant.min() < 0 or self.tenant.max() >= len(self.tenant_names)):
            raise TraceFormatError("tenant index out of range")
        if len(self.tenant_weights) != len(self.tenant_names):
            raise TraceFormatError("one weight per tenant")

    def __len__(self) -> int:
        return len(self.arrival_time)

    @property
    def num_tenants(self) -> int:
        return len(self.tenant_names)

    @property
    def first_arrival(self) -> float:
        return float(self.arrival_time[0]) if len(self) else 0.0

    @property
    def last_arrival(self) -> float:
        return float(self.arrival_time[-1]) if len(self) else 0.0

    @property
    def max_prompt_len(self) -> int:
        return int(self.prompt_len.max()) if len(self) else 0

    def priority_values(self) -> tuple[int, ...]:
        """The priority values of its requests."""
        return tuple(int(p) for p in np.unique(self.priority))

    def chunks(self, size: int = CHUNK_REQUESTS) -> Iterator[tuple[int, Workload]]:
        """``(index of the chunk's first request, the chunk)`` for consecutive slices of ``size`` requests."""
        names = ("arrival_time", "prompt_len", "output_len", "tenant", "priority", "prefix_group", "prefix_len")
        for start in range(0, len(self), size):
            cols = {k: getattr(self, k)[start : start + size] for k in names}
            yield start, Workload(**cols, tenant_names=self.tenant_names, tenant_weights=self.tenant_weights,
                                  seed=self.seed, source=self.source)  # fmt: skip


def _gaps(rng: np.random.Generator, n: int, arrival: str, cv: float) -> FloatArray:
    """n inter-arrival gaps of mean 1."""
    if arrival == "poisson" or cv == 1.0:
        return rng.exponential(1.0, size=n)
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / shape, size=n)


def check_prompt_lengths(spec: WorkloadSpec, max_model_len: int) -> None:
    """Raise :class:`TraceFormatError` when ``spec``'s prompt lengths cannot sensibly be clipped to fit
    ``max_model_len``: their mean is not below it (so a large share of the prompts, all of them for a fixed
    length, would be cut to ``max_model_len - 1``). The message names both ways out."""
    dist = spec.prompt_len
    mean = min(dist.mean(), dist.max_len)
    if mean >= max_model_len:
        raise TraceFormatError(
            f"prompt lengths {dist} do not fit max_model_len {max_model_len}: their mean ({mean:g} tokens) is not "
            f"below it, so a large share of them would be clipped; raise max_model_len (--set max_model_len=N) "
            f"above the prompts or draw shorter ones"
        )


def generate_workload(spec: WorkloadSpec, *, max_model_len: int | None = None) -> Workload:
    """The requests of ``spec`` (deterministic for a given spec, including its seed).

    With ``max_model_len``, prompt lengths drawn longer than ``max_model_len - 1`` are clipped to it, and
    :attr:`Workload.num_clipped_prompts` says how many were (see the module docstring). The same requests, a
    chunk at a time: :class:`WorkloadStream`."""
    return WorkloadStream(spec, max_model_len=max_model_len).materialize()


class WorkloadStream:
    """The workload of ``spec`` drawn a chunk at a time, in O(chunk) memory: request for request the same as
    :func:`generate_workload` (which concatenates these chunks).

    The seeded random stream is consumed in segments, each for all requests: the arrival gaps, then the tenants,
    the priority classes, the prompt lengths, the output lengths, and the shared-prefix draws. Construction walks
    the stream once, drawing and discarding, to find where each segment starts (and the number of requests, how
    many prompts are clipped, the longest prompt); :meth:`chunks` then draws every segment from its own copy of
    the generator, a chunk at a time. numpy's generators give the same values for one call of size ``a + b`` as
    for calls of sizes ``a`` then ``b`` (``tests/test_sim_scale.py`` checks the result against one draw per
    segment), and a cumulative sum carried across chunks adds in the same order as one over the whole array."""

    def __init__(self, spec: WorkloadSpec, *, max_model_len: int | None = None) -> None:
        if max_model_len is not None and max_model_len < 2:
            raise TraceFormatError(f"max_model_len must be >= 2, got {max_model_len}")
        self.spec = spec
        self.max_model_len = max_model_len
        self.tenant_names = tuple(t.name for t in spec.tenants)
        self.tenant_weights = tuple(t.weight for t in spec.tenants)
        self.seed = spec.seed
        self.source = "generated"
        rng = np.random.default_rng(spec.seed)
        self._gap_state = _state(rng)
        # The gaps: one draw of n (num_requests), or draws of ``block`` until their sum covers the duration.
        self._gap_blocks: list[int] = []
        first, last, carry, n = math.nan, math.nan, 0.0, 0
        if spec.num_requests is not None:
            n = spec.num_requests
            self._gap_blocks = [n]
            for size in _pieces(n):
                sums = _cumsum_from(carry, _gaps(rng, size, spec.arrival, spec.cv))
                carry = float(sums[-1])
                first = float(sums[0] / spec.rate) if math.isnan(first) else first
                last = float(sums[-1] / spec.rate)
        else:
            expected = spec.duration * spec.rate
            block = int(expected + 6 * math.sqrt(expected) * max(1.0, spec.cv) + 16)
            total = 0.0
            while total < spec.duration * spec.rate:
                # A block of gaps, drawn in pieces; whether it covers the duration is decided by numpy's sum of the
                # whole block (pairwise, as one draw of the block would add it), which the pieces' sums match
                # except in the last bits: only when they land that close to the target is the block drawn whole.
                block_state = _state(rng)
                self._gap_blocks.append(block)
                pieces_sum = 0.0
                for size in _pieces(block):
                    sums = _cumsum_from(carry, _gaps(rng, size, spec.arrival, spec.cv))
                    pieces_sum += float(sums[-1] - carry)
                    carry = float(sums[-1])
                    times = sums / spec.rate
                    k = int(np.searchsorted(times, spec.duration, side="left"))  # times < duration
                    if k:
                        first = float(times[0]) if math.isnan(first) else first
                        last = float(times[k - 1])
                    n += k
                    del sums, times
                target = spec.duration * spec.rate
                if abs(total + pieces_sum - target) > 1e-9 * target:
                    total += pieces_sum
                else:
                    total += float(_gaps(_generator(block_state), block, spec.arrival, spec.cv).sum())
        self._n = n
        self._t0 = first if n else 0.0
        self.first_arrival = 0.0
        self.last_arrival = (last - self._t0) if n else 0.0
        # The other segments, each over all n requests.
        self._tenant_state = _state(rng)
        self._tenant_p = _probabilities([t.share for t in spec.tenants])
        for size in _pieces(n):
            rng.choice(len(spec.tenants), size=size, p=self._tenant_p)
        self._prio_state = _state(rng)
        self._prio_values = np.array([v for v, _ in spec.priorities], dtype=np.int64)
        self._prio_p = _probabilities([f for _, f in spec.priorities])
        for size in _pieces(n):
            rng.choice(len(self._prio_values), size=size, p=self._prio_p)
        self._prompt_state = _state(rng)
        clipped, longest = 0, 0
        for size in _pieces(n):
            p = spec.prompt_len.sample(rng, size)
            if max_model_len is not None:
                clipped += int(np.count_nonzero(p > max_model_len - 1))
                p = np.minimum(p, max_model_len - 1)
            longest = max(longest, int(p.max()))
        self.num_clipped_prompts = clipped
        self.max_prompt_len = longest
        self._output_state = _state(rng)
        for size in _pieces(n):
            spec.output_len.sample(rng, size)
        self._shared = spec.num_prefix_groups > 0 and spec.prefix_len > 0 and spec.prefix_fraction > 0
        self._shared_state = _state(rng)
        num_shared = 0
        if self._shared:
            for size in _pieces(n):
                num_shared += int(np.count_nonzero(rng.random(size) < spec.prefix_fraction))
        self._group_state = _state(rng)

    def __len__(self) -> int:
        return self._n

    @property
    def num_tenants(self) -> int:
        return len(self.tenant_names)

    def priority_values(self) -> tuple[int, ...]:
        """The priority values its requests can have."""
        values = {v for v, f in self.spec.priorities if f > 0} | {
            t.priority for t in self.spec.tenants if t.priority is not None
        }
        return tuple(sorted(values))

    def chunks(self, size: int = CHUNK_REQUESTS) -> Iterator[tuple[int, Workload]]:
        """``(index of the chunk's first request, the chunk)`` for consecutive chunks of ``size`` requests."""
        spec, n = self.spec, self._n
        gap_rng, ten_rng, prio_rng, prompt_rng, out_rng, shared_rng, group_rng = (
            _generator(s)
            for s in (
                self._gap_state,
                self._tenant_state,
                self._prio_state,
                self._prompt_state,
                self._output_state,
                self._shared_state,
                self._group_state,
            )
        )
        fixed = [(i, t.priority) for i, t in enumerate(spec.tenants) if t.priority is not None]
        carry = 0.0
        for start in range(0, n, size):
            m = min(size, n - start)
            # Gaps are drawn in the same stream order as the blocks of construction; only the first n are used.
            times = _cumsum_from(carry, _gaps(gap_rng, m, spec.arrival, spec.cv))
            carry = float(times[-1])
            times = times / spec.rate - self._t0
            tenant = ten_rng.choice(len(spec.tenants), size=m, p=self._tenant_p).astype(np.int64)
            priority = self._prio_values[prio_rng.choice(len(self._prio_values), size=m, p=self._prio_p)]
            for i, prio in fixed:
                priority[tenant == i] = prio
            prompt_len = spec.prompt_len.sample(prompt_rng, m)
            if self.max_model_len is not None:
                np.minimum(prompt_len, self.max_model_len - 1, out=prompt_len)
            output_len = spec.output_len.sample(out_rng, m)
            prefix_group = np.full(m, -1, dtype=np.int64)
            prefix_len = np.zeros(m, dtype=np.int64)
            if self._shared:
                shared = shared_rng.random(m) < spec.prefix_fraction
                prefix_group[shared] = group_rng.integers(0, spec.num_prefix_groups, size=int(shared.sum()))
                # The prompt keeps its drawn length; the shared prefix is at most all but one of its tokens.
                prefix_len[shared] = np.minimum(spec.prefix_len, prompt_len[shared] - 1)
            yield (
                start,
                Workload(
                    arrival_time=times.astype(np.float64),
                    prompt_len=prompt_len,
                    output_len=output_len,
                    tenant=tenant,
                    priority=priority,
                    prefix_group=prefix_group,
                    prefix_len=prefix_len,
                    tenant_names=self.tenant_names,
                    tenant_weights=self.tenant_weights,
                    seed=self.seed,
                    source=self.source,
                ),
            )

    def materialize(self) -> Workload:
        """All the requests as one :class:`Workload`."""
        parts = [w for _, w in self.chunks()]
        names = ("arrival_time", "prompt_len", "output_len", "tenant", "priority", "prefix_group", "prefix_len")
        cols: dict[str, Any] = {}
        for name in names:
            dtype = np.float64 if name == "arrival_time" else np.int64
            cols[name] = np.concatenate([getattr(w, name) for w in parts]) if parts else np.zeros(0, dtype=dtype)
        return Workload(
            **cols,
            tenant_names=self.tenant_names,
            tenant_weights=self.tenant_weights,
            seed=self.seed,
            source=self.source,
            num_clipped_prompts=self.num_clipped_prompts,
        )


def _state(rng: np.random.Generator) -> dict[str, Any]:
    return dict(rng.bit_generator.state)


def _generator(state: dict[str, Any]) -> np.random.Generator:
    rng = np.random.default_rng(0)
    rng.bit_generator.state = state
    return rng


def _probabilities(weights: Sequence[float]) -> FloatArray:
    w = np.array(weights, dtype=np.float64)
    out: FloatArray = w / w.sum()
    return out


def _pieces(n: int, size: int = CHUNK_REQUESTS) -> Iterator[int]:
    for start in range(0, n, size):
        yield min(size, n - start)


def _cumsum_from(carry: float, values: FloatArray) -> FloatArray:
    """``carry + values[0], carry + values[0] + values[1], ...``, added in the same order as one cumulative sum
    over the values before ``values`` would add them."""
    out: FloatArray = np.cumsum(np.concatenate(([carry], values)))[1:]
    return out


class PromptFactory:
    """Builds prompt token ids on demand (see the module docstring); deterministic for a seed."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng([seed, 7])
        self._pool = rng.integers(_FIRST_TOKEN, VOCAB_SIZE, size=_POOL_SIZE, dtype=np.int32)
        self._prefixes: dict[int, npt.NDArray[np.int32]] = {}
        self._seed = seed

    def _prefix(self, group: int, length: int) -> npt.NDArray[np.int32]:
        """Token j of group g's prefix is a pure function of (seed, g, j), so every length agrees."""
        p = self._prefixes.get(group)
        if p is None or len(p) < length:
            j = np.arange(max(length, 256), dtype=np.int64)
            base = (self._seed * 104729 + (group + 1) * 1000003) % _RANGE
            p = (_FIRST_TOKEN + (base + j * 7919 + (j * j) % 65521) % _RANGE).astype(np.int32)
            self._prefixes[group] = p
        return p

    def tokens(self, idx: int, prompt_len: int, group: int, prefix_len: int) -> npt.NDArray[np.int32]:
        out = np.empty(prompt_len, dtype=np.int32)
        k = 0
        if group >= 0 and prefix_len > 0:
            k = min(prefix_len, prompt_len)
            out[:k] = self._prefix(group, k)[:k]
        tag = (_FIRST_TOKEN + (idx // _RANGE) % _RANGE, _FIRST_TOKEN + idx % _RANGE)
        for t in tag:
            if k < prompt_len:
                out[k] = t
                k += 1
        rest = prompt_len - k
        if rest > 0:
            off = (idx * 7919) % (_POOL_SIZE - 1)
            while rest > 0:
                take = min(rest, _POOL_SIZE - off)
                out[k : k + take] = self._pool[off : off + take]
                k += take
                rest -= take
                off = 0
        return out


def prompt_tokens(workload: Workload, idx: int, factory: PromptFactory | None = None) -> npt.NDArray[np.int32]:
    """The prompt token ids of request ``idx`` of ``workload`` (as the simulator adds them)."""
    factory = factory or PromptFactory(workload.seed)
    return factory.tokens(
        idx, int(workload.prompt_len[idx]), int(workload.prefix_group[idx]), int(workload.prefix_len[idx])
    )


# ---------------------------------------------------------------------------------------------------------
# Traces


def dump_trace(workload: Workload, path: str | Path) -> Path:
    """Write ``workload`` as a JSONL trace (a header line with tenant weights, then one line per request)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = workload.tenant_names
    with path.open("w", encoding="utf-8") as f:
        header = {"tenants": dict(zip(names, workload.tenant_weights, strict=True)), "seed": workload.seed}
        f.write(json.dumps(header) + "\n")
        cols = zip(
            workload.arrival_time.tolist(),
            workload.prompt_len.tolist(),
            workload.output_len.tolist(),
            workload.tenant.tolist(),
            workload.priority.tolist(),
            workload.prefix_group.tolist(),
            workload.prefix_len.tolist(),
            strict=True,
        )
        for t, p, o, ten, prio, g, pl in cols:
            line: dict[str, Any] = {
                "arrival_time": round(t, 6),
                "prompt_len": p,
                "output_len": o,
                "tenant": names[ten],
                "priority": prio,
                "prefix_group": g,
            }
            if g >= 0:
                line["prefix_len"] = pl
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return path


def _int_field(obj: dict[str, Any], key: str, default: int | None, where: str) -> int:
    value = obj.get(key, default)
    if value is None:
        raise TraceFormatError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise TraceFormatError(f"{where}: {key} must be an integer, got {value!r}")
    return int(value)


def load_trace(path: str | Path, *, seed: int = 0) -> Workload:
    """Read a JSONL trace (see the module docstring). Requests are sorted by arrival time (stable)."""
    path = Path(path)
    weights: dict[str, float] = {}
    cols: dict[str, list[Any]] = {k: [] for k in ("t", "p", "o", "ten", "prio", "g", "pl")}
    tenant_idx: dict[str, int] = {}
    for where, obj in iter_json_objects(path):
        if "arrival_time" not in obj and "tenants" in obj:
            tw = obj["tenants"]
            if not isinstance(tw, dict):
                raise TraceFormatError(f"{where}: 'tenants' must map names to weights")
            for name, w in tw.items():
                weights[str(name)] = float(w)
                tenant_idx.setdefault(str(name), len(tenant_idx))
            seed = int(obj.get("seed", seed))
            continue
        t = obj.get("arrival_time")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise TraceFormatError(f"{where}: arrival_time must be a finite number >= 0, got {t!r}")
        p = _int_field(obj, "prompt_len", None, where)
        o = _int_field(obj, "output_len", None, where)
        if p < 1 or o < 1:
            raise TraceFormatError(f"{where}: prompt_len and output_len must be >= 1")
        tenant = str(obj.get("tenant", "default"))
        g = _int_field(obj, "prefix_group", -1, where)
        pl = _int_field(obj, "prefix_len", 0, where) if g >= 0 else 0
        if pl < 0:
            raise TraceFormatError(f"{where}: prefix_len must be >= 0")
        cols["t"].append(float(t))
        cols["p"].append(p)
        cols["o"].append(o)
        cols["ten"].append(tenant_idx.setdefault(tenant, len(tenant_idx)))
        cols["prio"].append(_int_field(obj, "priority", 0, where))
        cols["g"].append(g)
        cols["pl"].append(min(pl, p - 1))
    if not cols["t"]:
        raise TraceFormatError(f"{path}: no request in the trace")
    times = np.asarray(cols["t"], dtype=np.float64)
    order = np.argsort(times, kind="stable")

    def arr(key: str) -> IntArray:
        return np.asarray(cols[key], dtype=np.int64)[order]

    names = tuple(tenant_idx)
    return Workload(
        arrival_time=times[order],
        prompt_len=arr("p"),
        output_len=arr("o"),
        tenant=arr("ten"),
        priority=arr("prio"),
        prefix_group=arr("g"),
        prefix_len=arr("pl"),
        tenant_names=names,
        tenant_weights=tuple(weights.get(n, 1.0) for n in names),
        seed=seed,
        source=str(path),
    )


def tenant_index(names: Sequence[str], name: str) -> int:
    try:
        return list(names).index(name)
    except ValueError:
        raise TraceFormatError(f"unknown tenant {name!r}; the workload has {', '.join(names)}") from None
