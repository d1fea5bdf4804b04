"""Metrics of a simulated run: streamed while it runs (:class:`RunMetrics`), or derived from its raw record.

Per request: arrival, first scheduled, first token and finish times; TTFT (first token - arrival), TPOT ((finish - first
token) / (outputs - 1)), end-to-end latency (finish - arrival), queueing delay (start of the first step that schedules
it - arrival), preemptions, recomputed tokens (tokens computed again after a preemption), cached tokens (prompt tokens
skipped thanks to prefix-cache hits).

Per run (:func:`~kvsched.sim.summary.summarize`): mean/p50/p90/p99 of each, request and token throughput, goodput under
SLOs, preemptions, recomputed tokens, prefix-cache hit rate, KV usage, how many prompt lengths were clipped and output
lengths capped to fit ``max_model_len``; the same per tenant and per priority class; per-tenant service (tokens computed
for the tenant's requests) over time windows, its share, and Jain's fairness index of weighted service per window over
the tenants that were backlogged (on average at least one request waiting for admission during the window).

The simulator streams every figure into a :class:`RunMetrics` as the run goes, in memory that does not grow with its
length: a request's figures are folded in when it finishes (or when the run ends), counts and sums are exact,
percentiles are exact up to :data:`~kvsched.sim.sketch.EXACT_LIMIT` values per figure and from a DDSketch (0.5% relative
error) past that (:class:`~kvsched.sim.sketch.Quantiles`), and per-tenant service and queue lengths are summed per
window of a width fixed before the run. Goodput is counted for the SLOs given to the run; up to the exact limit the
(TTFT, TPOT) pairs of the finished requests are kept too, so :func:`~kvsched.sim.summary.summarize` can count it for
other SLOs. With ``keep_records=True`` the simulator also keeps the raw record of every step, from which
:func:`~kvsched.sim.summary.request_records` rebuilds every per-request and per-token figure (O(tokens) memory;
validation and tests use it to check the streamed figures).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .sketch import EXACT_LIMIT, Quantiles

__all__ = [
    "PERCENTILES",
    "REQUEST_COLUMNS",
    "RequestRecords",
    "RunMetrics",
    "jain_index",
    "percentiles",
]

PERCENTILES = (50, 90, 99)
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass
class RequestRecords:
    """One entry per workload request (struct of arrays). Times are NaN where they did not happen."""

    arrival_time: FloatArray
    prompt_len: IntArray
    output_len: IntArray  # the length it runs to
    tenant: IntArray
    priority: IntArray
    prefix_group: IntArray
    added: npt.NDArray[np.bool_]
    finished: npt.NDArray[np.bool_]
    num_output_tokens: IntArray  # tokens generated (== output_len when finished)
    first_scheduled_time: FloatArray
    first_token_time: FloatArray
    finish_time: FloatArray
    ttft: FloatArray
    tpot: FloatArray
    e2e: FloatArray
    queue_delay: FloatArray
    num_preemptions: IntArray
    num_scheduled_tokens: IntArray  # every token computed for it, recomputation included
    num_recomputed_tokens: IntArray
    num_cached_tokens: IntArray
    itl: FloatArray  # every inter-token latency of every request, flattened
    itl_indptr: IntArray  # CSR offsets of each request's ITLs into ``itl``

    def __len__(self) -> int:
        return len(self.arrival_time)

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """The per-request columns (everything but the flattened ITLs)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("itl", "itl_indptr")}


def _segment_starts(counts: IntArray) -> IntArray:
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def percentiles(values: FloatArray) -> dict[str, float]:
    """mean, p50, p90, p99 and max of the finite values (NaN when there are none)."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}, "max": math.nan}
    qs = np.percentile(v, PERCENTILES)
    return {
        "mean": float(v.mean()),
        **{f"p{p}": float(q) for p, q in zip(PERCENTILES, qs, strict=True)},
        "max": float(v.max()),
    }


def jain_index(x: FloatArray) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: 1 = equal, 1/n = one gets everything."""
    x = np.asarray(x, dtype=np.float64)
    sq = float((x * x).sum())
    if x.size == 0 or sq == 0.0:
        return math.nan
    return float(x.sum() ** 2 / (x.size * sq))


REQUEST_COLUMNS = (
    "arrival_time",
    "prompt_len",
    "output_len",
    "tenant",
    "priority",
    "prefix_group",
    "added",
    "finished",
    "num_output_tokens",
    "first_scheduled_time",
    "first_token_time",
    "finish_time",
    "ttft",
    "tpot",
    "e2e",
    "queue_delay",
    "num_preemptions",
    "num_scheduled_tokens",
    "num_recomputed_tokens",
    "num_cached_tokens",
)
_LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue_delay")
# ITL values buffered before they are split by group and added (at most this many values, or 1024 batches of
# them: bounded memory, few numpy calls per step).
_ITL_FLUSH = 1 << 16
# At most this many fairness windows: past it, pairs of windows merge (the window doubles).
MAX_WINDOWS = 4096


class _Group:
    """The streamed figures of one group of requests (all, a tenant's, a priority class's)."""

    def __init__(self, exact_limit: int) -> None:
        self.num_requests = 0
        self.num_finished = 0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_good = 0  # finished within the run's SLOs
        self.finished_tokens = 0  # prompt + output tokens of the finished requests
        self.lat = {k: Quantiles(exact_limit) for k in _LATENCIES}

    def add(self, c: dict[str, npt.NDArray[Any]], mask: npt.NDArray[np.bool_], good: npt.NDArray[np.bool_]) -> None:
        fin = c["finished"][mask]
        self.num_requests += int(mask.sum())
        self.num_finished += int(fin.sum())
        self.num_output_tokens += int(c["num_output_tokens"][mask].sum())
        self.num_preemptions += int(c["num_preemptions"][mask].sum())
        self.num_recomputed_tokens += int(c["num_recomputed_tokens"][mask].sum())
        self.num_cached_tokens += int(c["num_cached_tokens"][mask].sum())
        self.num_scheduled_tokens += int(c["num_scheduled_tokens"][mask].sum())
        self.num_good += int(good[mask].sum())
        self.finished_tokens += int((c["prompt_len"][mask][fin] + c["output_len"][mask][fin]).sum())
        for key in ("ttft", "tpot", "e2e", "queue_delay"):
            v = c[key][mask]
            self.lat[key].add(v[np.isfinite(v)])


class _Windows:
    """Per window of simulated time and tenant: tokens computed (service) and request-seconds of waiting for
    admission. Window ``k`` is ``[k * width, (k + 1) * width)``; a step's tokens count in the window of the step's
    end, a wait in every window it overlaps (by the overlap)."""

    def __init__(self, width: float, num_tenants: int) -> None:
        self.width = width
        self.num_tenants = num_tenants
        self.service = np.zeros((64, num_tenants))
        self.waits = np.zeros((64, num_tenants))  # overlaps of waits with windows they cover only in part
        self.full = np.zeros((65, num_tenants))  # waits covering whole windows: +width from ka+1, -width from kb
        # Steps and waits not summed yet (summed a batch at a time: a few numpy calls per thousand steps).
        self._step_ends: list[float] = []
        self._step_tokens: list[Any] = []
        self._waits: list[tuple[FloatArray, FloatArray, IntArray]] = []
        self._num_waits = 0

    def step(self, t_end: float, tokens: npt.NDArray[Any] | float) -> None:
        """A step ending at ``t_end`` computed ``tokens`` tokens (per tenant: an array, or a float for one)."""
        self._step_ends.append(t_end)
        self._step_tokens.append(tokens)
        if len(self._step_ends) >= 4096:
            self.flush()

    def wait(self, start: FloatArray, stop: FloatArray, tenant: IntArray) -> None:
        """Requests waited for admission from ``start`` to ``stop``."""
        self._waits.append((start, stop, tenant))
        self._num_waits += len(start)
        if self._num_waits >= 4096:
            self.flush()

    def flush(self) -> None:
        if self._step_ends:
            ends = np.array(self._step_ends)
            tokens = np.array(self._step_tokens, dtype=np.float64).reshape(len(ends), -1)
            self._step_ends, self._step_tokens = [], []
            self._fit(float(ends.max()))
            k = (ends / self.width).astype(np.int64)
            for i in range(self.num_tenants):
                self.service[: int(k.max()) + 1, i] += np.bincount(k, weights=tokens[:, i])
        if self._waits:
            start = np.concatenate([a for a, _, _ in self._waits])
            stop = np.concatenate([b for _, b, _ in self._waits])
            tenant = np.concatenate([c for _, _, c in self._waits])
            self._waits, self._num_waits = [], 0
            self.add_waits(start, stop, tenant)

    def _fit(self, t: float) -> None:
        while int(t / self.width) >= MAX_WINDOWS:
            self._coarsen()
        self._grow(int(t / self.width))

    def _grow(self, k: int) -> None:
        if k >= len(self.service):
            size = max(2 * len(self.service), k + 1)
            for name in ("service", "waits", "full"):
                old = getattr(self, name)
                new = np.zeros((size + (name == "full"), self.num_tenants))
                new[: len(old)] = old
                setattr(self, name, new)

    def _coarsen(self) -> None:
        waits = self.waits + np.cumsum(self.full, axis=0)[: len(self.waits)]
        half = (len(self.service) + 1) // 2

        def pairs(a: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
            out = np.zeros((len(a), self.num_tenants))
            out[:half] = np.add.reduceat(a, np.arange(0, len(a), 2), axis=0)
            return out

        self.service = pairs(self.service)
        self.waits = pairs(waits)
        self.full = np.zeros_like(self.full)
        self.width *= 2

    def add_service_steps(self, t_ends: npt.NDArray[np.float64], tokens: npt.NDArray[Any]) -> None:
        """Steps ending at ``t_ends``, each computing ``tokens`` (per tenant) tokens."""
        self._fit(float(t_ends[-1]))
        k = (t_ends / self.width).astype(np.int64)
        counts = np.bincount(k, minlength=int(k[-1]) + 1).astype(np.float64)
        self.service[: len(counts)] += np.outer(counts, tokens)

    def add_waits(self, start: npt.NDArray[np.float64], stop: npt.NDArray[np.float64], tenant: IntArray) -> None:
        if start.size == 0:
            return
        self._fit(float(stop.max()))
        w = self.width
        ka = (start / w).astype(np.int64)
        kb = (stop / w).astype(np.int64)
        same = ka == kb
        np.add.at(self.waits, (ka[same], tenant[same]), stop[same] - start[same])
        d = ~same
        ka, kb, a, b, ten = ka[d], kb[d], start[d], stop[d], tenant[d]
        np.add.at(self.waits, (ka, ten), (ka + 1) * w - a)
        np.add.at(self.waits, (kb, ten), b - kb * w)
        np.add.at(self.full, (ka + 1, ten), w)
        np.add.at(self.full, (kb, ten), -w)

    def result(self, end_time: float, weights: Sequence[float]) -> dict[str, Any]:
        """The windows up to ``end_time``, as :func:`tenant_service` returns them."""
        self.flush()
        while math.ceil(max(end_time, 1e-12) / self.width) > MAX_WINDOWS:
            self._coarsen()
        w = self.width
        nwin = max(1, math.ceil(max(end_time, 1e-12) / w))
        self._grow(nwin)
        service = self.service[:nwin].copy()
        service[nwin - 1] += self.service[nwin:].sum(axis=0)  # a step ending exactly at the end of the last window
        queue = (self.waits + np.cumsum(self.full, axis=0)[: len(self.waits)])[:nwin] / w
        return _fairness(w, service, queue, np.asarray(weights, dtype=np.float64))


def _fairness(
    window: float, service: npt.NDArray[np.float64], queue: npt.NDArray[np.float64], weights: FloatArray
) -> dict[str, Any]:
    backlogged = queue >= 1.0
    jain = np.array(
        [
            jain_index(service[k, backlogged[k]] / weights[backlogged[k]]) if backlogged[k].sum() >= 2 else math.nan
            for k in range(len(service))
        ]
    )
    return {
        "window": window,
        "time": np.arange(len(service)) * window,
        "service": service,
        "queue": queue,
        "backlogged": backlogged,
        "jain": jain,
    }


class RunMetrics:
    """Every figure of one run, streamed (see the module docstring). The simulator feeds it; :func:`summarize`
    reads it.

    ``priorities``: the priority values the workload can have. ``window``: the width of the fairness windows
    (seconds of simulated time). ``slo_ttft``/``slo_tpot``: the SLOs goodput is counted for. ``request_sink``:
    called with the columns (:data:`REQUEST_COLUMNS` and ``idx``) of each batch of requests folded in, e.g. to
    write them to a file."""

    def __init__(
        self,
        *,
        tenant_names: Sequence[str],
        tenant_weights: Sequence[float],
        priorities: Sequence[int],
        window: float,
        first_arrival: float = 0.0,
        slo_ttft: float | None = None,
        slo_tpot: float | None = None,
        exact_limit: int = EXACT_LIMIT,
        request_sink: Callable[[dict[str, npt.NDArray[Any]]], None] | None = None,
    ) -> None:
        if not (window > 0 and math.isfinite(window)):
            raise ValueError(f"window must be > 0, got {window}")
        self.tenant_names = tuple(tenant_names)
        self.tenant_weights = tuple(tenant_weights)
        self.prio_values = np.array(sorted(set(int(p) for p in priorities)), dtype=np.int64)
        if self.prio_values.size == 0:
            self.prio_values = np.zeros(1, dtype=np.int64)
        self.first_arrival = first_arrival
        self.slo = (slo_ttft, slo_tpot)
        self.exact_limit = exact_limit
        self.request_sink = request_sink
        self.overall = _Group(exact_limit)
        nt, npr = len(self.tenant_names), len(self.prio_values)
        # With one tenant (one class) its group is the overall one: nothing is added twice.
        self.tenants = [self.overall] if nt == 1 else [_Group(exact_limit) for _ in range(nt)]
        self.priorities = [self.overall] if npr == 1 else [_Group(exact_limit) for _ in range(npr)]
        self.windows = _Windows(window, nt)
        # (TTFT, TPOT, tenant, class) of each finished request, while there are at most exact_limit of them.
        self._pairs: list[npt.NDArray[Any]] | None = []
        self._num_pairs = 0
        self._itl: list[tuple[FloatArray, IntArray, IntArray | None]] = []
        self._itl_size = 0
        self.num_steps = 0
        self.num_fast_steps = 0
        self.step_time_sum = 0.0
        self.num_scheduled_entries = 0  # sum over steps of the requests each schedules
        self.num_capped_outputs = 0
        self.end_time = 0.0
        self.service: dict[str, Any] | None = None

    @property
    def num_tenants(self) -> int:
        return len(self.tenant_names)

    def priority_index(self, priority: npt.NDArray[Any]) -> IntArray:
        idx: IntArray = np.searchsorted(self.prio_values, priority).astype(np.int64)
        return idx

    def add_requests(self, c: dict[str, npt.NDArray[Any]]) -> None:
        """Fold in requests that finished or that the run ended with; ``c`` holds :data:`REQUEST_COLUMNS` but the
        four derived latencies (computed here) and ``idx``."""
        if len(c["arrival_time"]) == 0:
            return
        finished = c["finished"]
        counts = c["num_output_tokens"]
        arrival = c["arrival_time"]
        c["ttft"] = c["first_token_time"] - arrival
        c["e2e"] = c["finish_time"] - arrival
        c["queue_delay"] = c["first_scheduled_time"] - arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            c["tpot"] = np.where(
                finished & (counts > 1), (c["finish_time"] - c["first_token_time"]) / (counts - 1), np.nan
            )
        if self.request_sink is not None:
            self.request_sink(c)
        added = c["added"]
        good = _good(finished & added, c["ttft"], c["tpot"], self.slo)
        self.overall.add(c, added, good)
        if len(self.tenants) > 1:
            for i, g in enumerate(self.tenants):
                g.add(c, added & (c["tenant"] == i), good)
        prio = self.priority_index(c["priority"])
        if len(self.priorities) > 1:
            for i, g in enumerate(self.priorities):
                g.add(c, added & (prio == i), good)
        if self._pairs is not None:
            fin = finished & added
            k = int(fin.sum())
            if self._num_pairs + k > self.exact_limit:
                self._pairs = None
            elif k:
                self._pairs.append(np.stack([c["ttft"][fin], c["tpot"][fin], c["tenant"][fin], prio[fin]]))
                self._num_pairs += k

    def add_itl(self, values: FloatArray, codes: IntArray, weights: IntArray | None = None) -> None:
        """Inter-token latencies; ``codes``: tenant * (number of classes) + class index; ``weights``: how many
        tokens each value stands for."""
        if len(values):
            self._itl.append((values, codes, weights))
            self._itl_size += len(values)
            if self._itl_size >= _ITL_FLUSH or len(self._itl) >= 1024:
                self.flush_itl()

    def flush_itl(self) -> None:
        if not self._itl:
            return
        values = np.concatenate([v for v, _, _ in self._itl])
        codes = np.concatenate([c for _, c, _ in self._itl])
        weighted = any(w is not None for _, _, w in self._itl)
        weights = (
            np.concatenate([np.ones(len(v), np.int64) if w is None else w for v, _, w in self._itl])
            if weighted
            else None
        )
        self._itl, self._itl_size = [], 0
        self.overall.lat["itl"].add(values, weights)
        npr = len(self.prio_values)
        for groups, of_code in ((self.tenants, codes // npr), (self.priorities, codes % npr)):
            if len(groups) > 1:
                for i, g in enumerate(groups):
                    m = of_code == i
                    g.lat["itl"].add(values[m], None if weights is None else weights[m])

    def finish(self, end_time: float) -> None:
        """The run ended at ``end_time``: close the windows."""
        self.flush_itl()
        self.end_time = end_time
        self.service = self.windows.result(end_time, self.tenant_weights)

    def num_good(self, slo_ttft: float | None, slo_tpot: float | None) -> tuple[int, list[int], list[int]]:
        """Finished requests within the SLOs: overall, per tenant, per priority class."""
        if (slo_ttft, slo_tpot) == self.slo:
            return (
                self.overall.num_good,
                [g.num_good for g in self.tenants],
                [g.num_good for g in self.priorities],
            )
        if self._pairs is None:
            raise ValueError(
                f"this run counted goodput for slo_ttft={self.slo[0]}, slo_tpot={self.slo[1]}; it finished more "
                f"than {self.exact_limit:,} requests, so other SLOs need them given to simulate() (or run_sweep)"
            )
        pairs = np.concatenate(self._pairs, axis=1) if self._pairs else np.zeros((4, 0))
        good = _good(np.ones(pairs.shape[1], dtype=np.bool_), pairs[0], pairs[1], (slo_ttft, slo_tpot))
        nt, npr = self.num_tenants, len(self.prio_values)
        return (
            int(good.sum()),
            [int((good & (pairs[2] == i)).sum()) for i in range(nt)],
            [int((good & (pairs[3] == i)).sum()) for i in range(npr)],
        )


def _good(
    fin: npt.NDArray[np.bool_], ttft: FloatArray, tpot: FloatArray, slo: tuple[float | None, float | None]
) -> npt.NDArray[np.bool_]:
    good: npt.NDArray[np.bool_] = fin.copy()
    slo_ttft, slo_tpot = slo
    if slo_ttft is not None:
        good &= ttft <= slo_ttft
    if slo_tpot is not None:
        # A one-token output has no TPOT; it meets any TPOT target.
        good &= ~(tpot > slo_tpot)
    return good
