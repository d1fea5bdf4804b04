"""Streaming percentiles: exact up to a number of values, then a DDSketch with a stated relative error.

:class:`Quantiles` takes values in batches (numpy arrays, optionally weighted: one value standing for several
equal ones). Its count, sum, mean and maximum are exact. Its percentiles are exact (``numpy.percentile``'s
linear interpolation over the values) while it has seen at most ``exact_limit`` values; past that it moves them
into a DDSketch (Masson, Rim and Lee, VLDB 2019; the ``ddsketch`` package, Datadog's reference implementation)
and forgets them, so its memory stops growing. The sketch's guarantee: the value it returns for quantile ``q``
is within a relative error ``RELATIVE_ACCURACY`` (0.5%) of the value of rank ``q * (count - 1)`` (the lower of
the two order statistics that ``numpy.percentile`` interpolates between).

The ``ddsketch`` package is imported only when a run passes the exact limit, so small runs need nothing beyond
numpy. Values are put into the sketch a batch at a time: their bucket keys are computed with numpy from the
sketch's own mapping (``LogarithmicMapping.gamma``), equal keys are counted, and each bucket is added once with
its count as the weight (at the bucket's representative value, which the sketch maps back to the same key), so
ingestion costs O(distinct buckets) Python calls per batch rather than one per value. A value on a bucket
boundary may land in the neighbouring bucket through floating-point rounding of the logarithm; its
representative is then still within the relative accuracy of it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["EXACT_LIMIT", "RELATIVE_ACCURACY", "Quantiles", "SketchMissingError"]

# Values a Quantiles keeps exactly (8 bytes each) before it moves to a sketch.
EXACT_LIMIT = 1 << 16
# The sketch's relative accuracy (alpha): a returned percentile is within 0.5% of an order statistic.
RELATIVE_ACCURACY = 0.005

FloatArray = npt.NDArray[np.float64]


class SketchMissingError(ImportError):
    """A run passed the exact limit and the ``ddsketch`` package is not installed."""


def _new_sketch(relative_accuracy: float) -> tuple[Any, Any]:
    try:
        from ddsketch import DDSketch
        from ddsketch.mapping import LogarithmicMapping
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SketchMissingError(
            "this run has more values than the simulator keeps exactly; its percentiles need the 'ddsketch' "
            f"package (a dependency of kvsched: pip install ddsketch): {exc}"
        ) from exc
    return DDSketch(relative_accuracy), LogarithmicMapping(relative_accuracy)


class Quantiles:
    """Count, sum, mean, max (exact) and percentiles (exact up to ``exact_limit`` values, then a DDSketch)."""

    def __init__(self, exact_limit: int = EXACT_LIMIT, relative_accuracy: float = RELATIVE_ACCURACY) -> None:
        if exact_limit < 0:
            raise ValueError(f"exact_limit must be >= 0, got {exact_limit}")
        self.exact_limit = exact_limit
        self.relative_accuracy = relative_accuracy
        self.count = 0
        self.sum = 0.0
        self.max = -math.inf
        self._values: FloatArray = np.empty(0, dtype=np.float64)
        self._size = 0
        self._sketch: Any = None
        self._mapping: Any = None
        self._log_gamma = 0.0

    @property
    def exact(self) -> bool:
        """True while every value is kept (the percentiles are exact)."""
        return self._sketch is None

    def add(self, values: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> None:
        """Add finite ``values`` (a value with weight ``w`` counts as ``w`` equal values; weights are ints > 0)."""
        v = np.asarray(values, dtype=np.float64).ravel()
        if v.size == 0:
            return
        w = None if weights is None else np.asarray(weights, dtype=np.int64).ravel()
        n = int(v.size) if w is None else int(w.sum())
        self.count += n
        self.sum += float(v.sum()) if w is None else float(np.dot(v, w))
        self.max = max(self.max, float(v.max()))
        if self._sketch is None and self._size + n <= self.exact_limit:
            self._keep(v if w is None else np.repeat(v, w))
            return
        if self._sketch is None:
            self._to_sketch()
        self._sketch_add(v, w)

    def _keep(self, v: FloatArray) -> None:
        end = self._size + len(v)
        if end > len(self._values):
            grown = np.empty(min(max(2 * len(self._values), end, 1024), max(self.exact_limit, end)))
            grown[: self._size] = self._values[: self._size]
            self._values = grown
        self._values[self._size : end] = v
        self._size = end

    def _to_sketch(self) -> None:
        self._sketch, self._mapping = _new_sketch(self.relative_accuracy)
        self._log_gamma = math.log(self._mapping.gamma)
        kept = self._values[: self._size]
        self._values = np.empty(0, dtype=np.float64)
        self._size = 0
        self._sketch_add(kept, None)

    def _sketch_add(self, v: FloatArray, w: npt.NDArray[np.int64] | None) -> None:
        if v.size == 0:
            return
        positive = v > self._mapping.min_possible
        zeros = int(np.count_nonzero(~positive)) if w is None else int(w[~positive].sum())
        if zeros:
            self._sketch.add(0.0, float(zeros))
        keys = np.ceil(np.log(v[positive]) / self._log_gamma).astype(np.int64)
        if keys.size == 0:
            return
        # Keys span log(max / min) / log(gamma) buckets (a few thousand for latencies): count them by offset.
        lo = int(keys.min())
        counts = np.bincount(keys - lo, weights=None if w is None else w[positive])
        present = np.flatnonzero(counts)
        value_of = self._mapping.value
        add = self._sketch.add
        for off, c in zip(present.tolist(), counts[present].tolist(), strict=True):
            add(value_of(lo + off), float(c))

    def merge(self, other: Quantiles) -> None:
        """Add everything ``other`` has seen."""
        if other.count == 0:
            return
        if other._sketch is None:
            self.add(other._values[: other._size])
            return
        self.count += other.count
        self.sum += other.sum
        self.max = max(self.max, other.max)
        if self._sketch is None:
            self._to_sketch()
        self._sketch.merge(other._sketch)

    def values(self) -> FloatArray:
        """The values seen (only while exact)."""
        if self._sketch is not None:
            raise ValueError("the values are no longer kept: this Quantiles passed its exact limit")
        out: FloatArray = self._values[: self._size].copy()
        return out

    def quantiles(self, qs: npt.ArrayLike) -> FloatArray:
        """The values at quantiles ``qs`` (fractions in [0, 1]); NaN when empty."""
        q = np.asarray(qs, dtype=np.float64)
        if self.count == 0:
            return np.full(q.shape, math.nan)
        if self._sketch is None:
            out: FloatArray = np.quantile(self._values[: self._size], q)
            return out
        return np.array([float(self._sketch.get_quantile_value(float(x))) for x in q.ravel()]).reshape(q.shape)

    def summary(self, percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
        """mean, the percentiles and max (NaN when empty)."""
        if self.count == 0:
            return {"mean": math.nan, **{f"p{p}": math.nan for p in percentiles}, "max": math.nan}
        if self._sketch is None:
            v = self._values[: self._size]
            qs = np.percentile(v, percentiles)
            mean = float(v.mean())
        else:
            qs = self.quantiles(np.asarray(percentiles, dtype=np.float64) / 100.0)
            mean = self.sum / self.count
        return {"mean": mean, **{f"p{p}": float(x) for p, x in zip(percentiles, qs, strict=True)}, "max": self.max}
