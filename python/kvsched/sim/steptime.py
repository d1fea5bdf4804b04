"""The step-time model: how long one engine step takes, from what the scheduler put in it.

A step's duration is linear in its composition::

    t = step_s
      + prefill_token_s * (tokens of prefill chunks)
      + prefill_req_s   * (requests computing a prefill chunk)
      + decode_req_s    * (decoding requests)
      + kv_token_s      * (KV tokens the decoding requests attend to: the sum of their context lengths)
      + prefill_attn_s  * (query-key pairs of the prefill chunks: sum of n * (computed + (n + 1) / 2))
      + swap_block_s    * (KV blocks swapped in or out)
      + prefill_attn_spill_s * (query-key pairs of each prefill chunk beyond attn_spill_pairs, summed)
      + lone_prefill_token_s * (prefill tokens of a lone prefill step: one scheduled request, a prefill chunk)
      + new_size_step_s * (1 if the step's size was not among the engine's last step_size_cache step sizes)

A request "decodes" in a step when it computes exactly its last known token (``num_computed_tokens ==
prompt + outputs - 1``); every other scheduled token is a prefill token (first prefill, chunks, and the
recomputation of a preempted request). The swap term counts the blocks a step copies to or from the CPU pool
(``SchedulerOutput.swap_out`` and ``swap_in``); it is charged only with ``preemption_mode`` ``"swap"`` or
``"auto"``, and the auto mode's per-victim choice is priced by the same model (``prefill_token_s`` per recomputed
token against ``swap_block_s`` per block).

The last term is a hinge: past a per-request size (``attn_spill_pairs`` query-key pairs), prefill attention
costs more per pair, because its score matrices no longer fit the CPU's (or GPU's) caches. Calibration fits the
threshold (it tries a range of them) with the coefficients; the presets leave it off (0).

The lone-prefill term adds a per-token price to a step that schedules exactly one request and computes a prefill
chunk for it (no decodes): how a request meets the engine at low load, so it decides TTFT there. Such a step
costs more per token than the linear terms fitted across all step kinds say (without the term, validation runs
price such prefill steps low; see ``docs/simulator.md``).
Calibration fits it; the presets leave it 0, and a JSON model without it loads with it 0.

The new-size term prices a step whose size (its total number of scheduled tokens) is not among the last
``step_size_cache`` distinct sizes the engine ran: an engine that sets its kernels up per step size and keeps
the set-ups of recent sizes (vLLM's CPU build makes a oneDNN matmul primitive for each number of tokens and caches
them) pays ``new_size_step_s`` once more on such a step. It is the only term that depends on the steps before:
the simulator keeps the recent sizes in least-recently-used order (:class:`StepSizeCache`), starting empty (a
freshly started engine). ``step_size_cache = 0`` (the default, and the presets') turns the term off. Calibration
against a vLLM engine fits both (:func:`kvsched.sim.calibrate.fit_step_time_model` with ``step_sizes``); a JSON
model without them loads with both 0.

**Step-time noise** (optional, off unless ``noise_sigma > 0``). On a real machine steps of the same composition do
not take the same time, and slow stretches last several steps (other work on the machine, frequency changes,
the allocator). The model above gives the mean; with noise each simulated step's time is multiplied by
``exp(x_k - noise_sigma**2 / 2)``, where ``x`` is a stationary first-order autoregressive process over the
steps with standard deviation ``noise_sigma`` and lag-one correlation ``noise_rho`` (:class:`StepNoise`). The
factor has mean 1, so the expected step time is unchanged, while the tails of per-request figures (TPOT p90/p99)
and the queueing that slow stretches cause are reproduced. Calibration against a vLLM engine fits both from the
log-ratio of measured to predicted step times (:func:`kvsched.sim.calibrate.fit_step_time_model` with
``fit_noise=True``); the simulator draws the factors from a seeded generator (``simulate(noise_seed=...)``).

The presets are estimates (see ``docs/simulator.md`` for their derivation and sources); calibrate on your own
hardware with ``kvsched simulate --calibrate --model DIR`` (:func:`kvsched.sim.calibrate.calibrate`), which
fits these coefficients to timed steps of the real runner and writes a JSON preset.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "FEATURES",
    "PRESETS",
    "StepNoise",
    "StepSizeCache",
    "StepTimeModel",
    "fit_step_noise",
    "load_step_time_model",
    "lone_prefill_tokens",
    "new_size_flags",
    "request_pairs",
    "spill_pairs",
    "step_features",
]

# Names of the model's inputs, in the order of the coefficient vector.
FEATURES = (
    "steps",
    "prefill_tokens",
    "prefill_reqs",
    "decode_reqs",
    "kv_tokens",
    "prefill_attn_pairs",
    "swap_blocks",
    "prefill_attn_spill_pairs",
    "lone_prefill_tokens",
    "new_size_steps",
)
_COEFS = (
    "step_s",
    "prefill_token_s",
    "prefill_req_s",
    "decode_req_s",
    "kv_token_s",
    "prefill_attn_s",
    "swap_block_s",
    "prefill_attn_spill_s",
    "lone_prefill_token_s",
    "new_size_step_s",
)


@dataclass(frozen=True)
class StepTimeModel:
    """Coefficients in seconds per unit (see the module docstring). ``name`` and ``source`` document it."""

    step_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_req_s: float = 0.0
    decode_req_s: float = 0.0
    kv_token_s: float = 0.0
    prefill_attn_s: float = 0.0
    swap_block_s: float = 0.0
    prefill_attn_spill_s: float = 0.0
    lone_prefill_token_s: float = 0.0  # per prefill token of a step whose only scheduled request is a prefill
    new_size_step_s: float = 0.0  # per step whose size is not among the last step_size_cache distinct sizes
    attn_spill_pairs: float = 0.0  # per prefill chunk: the hinge's threshold (pairs past it cost the spill term)
    noise_sigma: float = 0.0  # standard deviation of a step's log time factor (0: no noise)
    noise_rho: float = 0.0  # lag-one correlation of consecutive steps' log time factors, in [0, 1)
    step_size_cache: int = 0  # distinct step sizes the engine keeps set up (0: no new-size term)
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        for c in (*_COEFS, "attn_spill_pairs"):
            v = getattr(self, c)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"step-time model field {c} must be a finite number >= 0, got {v!r}")
        k = self.step_size_cache
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"step-time model field step_size_cache must be an integer >= 0, got {k!r}")
        if self.step_s + self.prefill_token_s + self.decode_req_s <= 0:
            raise ValueError("a step-time model needs step_s, prefill_token_s or decode_req_s > 0")
        for c, hi in (("noise_sigma", 5.0), ("noise_rho", 1.0)):
            v = getattr(self, c)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < hi):
                raise ValueError(f"step-time model field {c} must be a number in [0, {hi:g}), got {v!r}")

    @property
    def coefficients(self) -> npt.NDArray[np.float64]:
        return np.array([getattr(self, c) for c in _COEFS], dtype=np.float64)

    def step_time(
        self,
        prefill_tokens: float = 0.0,
        decode_reqs: float = 0.0,
        kv_tokens: float = 0.0,
        prefill_attn_pairs: float = 0.0,
        swap_blocks: float = 0.0,
        prefill_reqs: float = 0.0,
        prefill_attn_spill_pairs: float = 0.0,
        lone_prefill_tokens: float = 0.0,
        new_size_steps: float = 0.0,
    ) -> float:
        return (
            self.step_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_req_s * prefill_reqs
            + self.decode_req_s * decode_reqs
            + self.kv_token_s * kv_tokens
            + self.prefill_attn_s * prefill_attn_pairs
            + self.swap_block_s * swap_blocks
            + self.prefill_attn_spill_s * prefill_attn_spill_pairs
            + self.lone_prefill_token_s * lone_prefill_tokens
            + self.new_size_step_s * new_size_steps
        )

    @property
    def charges_new_sizes(self) -> bool:
        """Whether the new-size term is on (a cache of recent sizes and a price for a size not in it)."""
        return self.step_size_cache > 0 and self.new_size_step_s > 0

    def predict(self, features: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Step times for rows of features (columns as :data:`FEATURES`)."""
        out: npt.NDArray[np.float64] = np.asarray(features, dtype=np.float64) @ self.coefficients
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTimeModel:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"fit"}
        if unknown:
            raise ValueError(f"unknown step-time model fields: {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = self.to_dict()
        if extra:
            doc["fit"] = extra
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        return path


class StepSizeCache:
    """The last ``capacity`` distinct step sizes an engine ran, least recently used first: :meth:`new` notes a
    step's size and says whether it was not among them (the new-size term of :class:`StepTimeModel`)."""

    __slots__ = ("_recent", "capacity")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"a step-size cache needs a capacity >= 1, got {capacity!r}")
        self.capacity = capacity
        self._recent: dict[int, None] = {}  # insertion order = least recently used first

    @classmethod
    def of(cls, model: StepTimeModel) -> StepSizeCache | None:
        """The cache of ``model``'s new-size term; None when the term is off."""
        return cls(model.step_size_cache) if model.charges_new_sizes else None

    def new(self, size: int) -> bool:
        recent = self._recent
        if size in recent:
            if next(reversed(recent)) != size:
                del recent[size]
                recent[size] = None
            return False
        recent[size] = None
        if len(recent) > self.capacity:
            del recent[next(iter(recent))]
        return True

    def __len__(self) -> int:
        return len(self._recent)


def new_size_flags(sizes: Any, capacity: int) -> npt.NDArray[np.bool_]:
    """For each step of a sequence of step sizes, whether its size was not among the last ``capacity`` distinct
    sizes before it (:class:`StepSizeCache`, starting empty); all False when ``capacity`` is 0."""
    seq = [int(x) for x in np.asarray(sizes).ravel()]
    if capacity <= 0:
        return np.zeros(len(seq), dtype=np.bool_)
    cache = StepSizeCache(capacity)
    new = cache.new
    return np.fromiter((new(x) for x in seq), np.bool_, len(seq))


class StepNoise:
    """The step-time factors of a model with noise (see the module docstring): :meth:`next` returns the next
    step's factor. Deterministic for a given ``seed``; draws normal variates in blocks."""

    _BLOCK = 4096

    def __init__(self, sigma: float, rho: float, seed: int = 0) -> None:
        if not (sigma >= 0 and 0 <= rho < 1):
            raise ValueError(f"noise needs sigma >= 0 and 0 <= rho < 1, got sigma={sigma!r}, rho={rho!r}")
        self.sigma = float(sigma)
        self.rho = float(rho)
        self._rng = np.random.default_rng(seed)
        self._innovation = self.sigma * math.sqrt(1.0 - self.rho * self.rho)
        self._shift = -0.5 * self.sigma * self.sigma
        self._x = float(self._rng.standard_normal()) * self.sigma  # the stationary distribution
        self._z: list[float] = []
        self._k = 0

    @classmethod
    def of(cls, model: StepTimeModel, seed: int) -> StepNoise | None:
        """The noise of ``model`` drawn from ``seed``; None when the model has none (``noise_sigma == 0``)."""
        return cls(model.noise_sigma, model.noise_rho, seed) if model.noise_sigma > 0 else None

    def next(self) -> float:
        if self._k >= len(self._z):
            self._z = self._rng.standard_normal(self._BLOCK).tolist()
            self._k = 0
        z = self._z[self._k]
        self._k += 1
        self._x = self.rho * self._x + self._innovation * z
        return math.exp(self._x + self._shift)


def fit_step_noise(
    log_ratio: npt.NDArray[np.float64], segment: npt.NDArray[np.int64] | None = None
) -> tuple[float, float]:
    """(sigma, rho) of :class:`StepNoise` from steps' log(measured / predicted) time, in step order; ``segment``
    labels runs of consecutive steps (pairs across two runs do not count for the correlation)."""
    x = np.asarray(log_ratio, dtype=np.float64)
    if x.size < 2:
        return 0.0, 0.0
    sigma = float(x.std())
    if sigma <= 0:
        return 0.0, 0.0
    same = np.ones(x.size - 1, dtype=bool) if segment is None else (segment[1:] == segment[:-1])
    if same.sum() < 2:
        return min(sigma, 4.0), 0.0
    d = x - x.mean()
    rho = float((d[:-1][same] * d[1:][same]).mean() / (d * d).mean())
    return min(sigma, 4.0), min(max(rho, 0.0), 0.99)


def step_features(
    num_scheduled: npt.NDArray[Any], num_computed: npt.NDArray[Any], is_decode: npt.NDArray[np.bool_]
) -> tuple[int, int, int, int, float]:
    """(prefill tokens, prefill requests, decode requests, KV tokens of the decodes, prefill query-key pairs)."""
    nst = num_scheduled.astype(np.int64)
    nct = num_computed.astype(np.int64)
    n_dec = int(np.count_nonzero(is_decode))
    total = int(nst.sum())
    kv = int(nct[is_decode].sum()) + n_dec
    pairs = float(request_pairs(nst, nct, is_decode).sum())
    return total - n_dec, len(nst) - n_dec, n_dec, kv, pairs


def request_pairs(
    num_scheduled: npt.NDArray[Any], num_computed: npt.NDArray[Any], is_decode: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    """Query-key pairs of each prefill chunk of a step (the per-request terms of ``prefill_attn_pairs``)."""
    pre = ~is_decode
    nsp = num_scheduled[pre].astype(np.int64)
    out: npt.NDArray[np.float64] = (nsp * (2 * num_computed[pre].astype(np.int64) + nsp + 1)) / 2.0
    return out


def lone_prefill_tokens(prefill_tokens: Any, prefill_reqs: Any, decode_reqs: Any) -> Any:
    """The lone-prefill feature: a step's prefill tokens if it schedules exactly one request and that request
    computes a prefill chunk (no decodes), else 0. Works on scalars and on arrays of steps."""
    return np.where((np.asarray(prefill_reqs) == 1) & (np.asarray(decode_reqs) == 0), prefill_tokens, 0)


def spill_pairs(pairs: npt.NDArray[np.float64], threshold: float) -> float:
    """The hinge feature: pairs of each prefill chunk beyond ``threshold``, summed."""
    return float(np.maximum(pairs - threshold, 0.0).sum())


# -- presets ----------------------------------------------------------------------------------------------
# Roofline estimates, not measurements (derivation in docs/simulator.md):
#   - H100 SXM: 3.35 TB/s HBM3, 989.4 dense BF16 TFLOPS (published spec figures).
#   - Memory-bound terms (weights read once per step, KV read per decode) at 77% of peak bandwidth: the
#     share a published vLLM batch-1 decode of Llama-3.1-8B reached on an A100 (an assumption for H100).
#   - Compute terms (2 * params FLOPs per token, 4 * layers * heads * head_dim FLOPs per query-key pair) at an
#     assumed 50% of peak (no published figure used).
#   - Swap: a 16-token block of KV over the host link, PCIe Gen5 x16 (64 GB/s per direction, spec figure) at an
#     assumed 50% (block-sized copies).
_BW = 3.35e12 * 0.77
_FLOPS = 989.4e12 * 0.5
_HOST_BW = 64e9 * 0.5
_SWAP_BLOCK_TOKENS = 16


def _roofline(name: str, params: float, layers: int, heads: int, kv_heads: int, head_dim: int) -> StepTimeModel:
    weights_bytes = 2 * params
    kv_bytes_per_token = layers * kv_heads * head_dim * 2 * 2
    per_token = 2 * params / _FLOPS
    return StepTimeModel(
        step_s=weights_bytes / _BW,
        prefill_token_s=per_token,
        prefill_req_s=0.0,
        decode_req_s=per_token,
        kv_token_s=kv_bytes_per_token / _BW,
        prefill_attn_s=4 * layers * heads * head_dim / _FLOPS,
        swap_block_s=_SWAP_BLOCK_TOKENS * kv_bytes_per_token / _HOST_BW,
        name=name,
        source=(
            "estimate (roofline): H100 SXM 3.35 TB/s at 77% and 989 BF16 TFLOPS at 50%, PCIe Gen5 x16 at 50% for "
            "swaps of 16-token blocks; "
            f"{params / 1e9:.2f}B params, {layers} layers, {heads}/{kv_heads} heads, head_dim {head_dim}, BF16. "
            "See docs/simulator.md"
        ),
    )


PRESETS: dict[str, StepTimeModel] = {
    "qwen2.5-0.5b-h100": _roofline("qwen2.5-0.5b-h100", 0.494e9, 24, 14, 2, 64),
    "llama-3.2-1b-h100": _roofline("llama-3.2-1b-h100", 1.236e9, 16, 32, 8, 64),
    "llama-3.1-8b-h100": _roofline("llama-3.1-8b-h100", 8.03e9, 32, 32, 8, 128),
}
DEFAULT_PRESET = "llama-3.1-8b-h100"


def load_step_time_model(name_or_path: str | Path) -> StepTimeModel:
    """A preset by name, or a JSON file written by :meth:`StepTimeModel.save` (e.g. by ``--calibrate``)."""
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.exists():
        if path.suffix.lower() == ".json" or "/" in key or os.sep in key:
            raise ValueError(f"step-time model file {key} does not exist")
        raise ValueError(f"unknown step-time preset {key!r}: use one of {', '.join(PRESETS)} or a JSON file")
    if path.is_dir():
        raise ValueError(f"step-time model {key} is a directory, not a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read step-time model {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a step-time model is a JSON object")
    return StepTimeModel.from_dict(data)
