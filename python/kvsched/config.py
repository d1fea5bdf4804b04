"""Scheduler configuration, validated on construction.

The same :class:`SchedulerConfig` drives the Rust scheduler and the pure-Python reference; the Rust core checks
the values again on its side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ._errors import InvalidConfigError, SchedulerTypeError

__all__ = ["POLICIES", "PREEMPTION_MODES", "PREFIX_HASH_ALGOS", "SchedulerConfig", "check_preemption_costs"]

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
POLICIES = ("fcfs", "priority", "fair")
PREEMPTION_MODES = ("recompute", "swap", "auto")
PREFIX_HASH_ALGOS = ("xxh3_128", "sha256")
_I32_MAX = 2**31 - 1
# The pool keeps ~50 bytes of bookkeeping per block; 2**24 blocks (~800 MB) is far above any real GPU's pool.
MAX_NUM_BLOCKS = 2**24


def _check_int(name: str, value: Any, minimum: int, maximum: int = _I32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= maximum:
        raise InvalidConfigError(f"{name} must be in [{minimum}, {maximum}], got {value}")


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_tenant_weight(
    tenant: Any, weight: Any, error: type[Exception], type_error: type[Exception] = SchedulerTypeError
) -> None:
    """A tenant is a non-empty str, its weight a finite real > 0; else ``error`` (``type_error`` for types)."""
    if not isinstance(tenant, str):
        raise type_error(f"a tenant name must be a str, got {type(tenant).__name__}")
    if not tenant:
        raise error("a tenant name must be a non-empty string")
    try:
        tenant.encode()
    except UnicodeEncodeError:
        raise error("a tenant name must be valid unicode (a lone surrogate)") from None
    if not _is_real(weight):
        raise type_error(f"the weight of tenant {tenant!r} must be a float, got {type(weight).__name__}")
    try:
        value = float(weight)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise error(f"the weight of tenant {tenant!r} must be finite and > 0, got {weight!r}")


def check_preemption_costs(
    recompute_cost_per_token: Any, swap_cost_per_block: Any, error: type[Exception], type_error: type[Exception]
) -> tuple[float, float]:
    """The auto mode's cost constants: finite reals >= 0 (else ``error``; ``type_error`` for types)."""
    values = []
    named = (("recompute_cost_per_token", recompute_cost_per_token), ("swap_cost_per_block", swap_cost_per_block))
    for name, v in named:
        if not _is_real(v):
            raise type_error(f"{name} must be a float, got {type(v).__name__}")
        try:
            f = float(v)
        except OverflowError:  # an int beyond the float range
            f = math.inf
        if not (math.isfinite(f) and f >= 0):
            raise error(f"{name} must be finite and >= 0, got {v!r}")
        values.append(f)
    return values[0], values[1]


@dataclass(frozen=True)
class SchedulerConfig:
    """Configuration of a :class:`~kvsched.Scheduler` (field names follow vLLM).

    See ``docs/semantics.md`` for what each field does.
    """

    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority", "fair"] = "fcfs"
    num_lookahead_tokens: int = 0
    num_speculative_tokens: int | None = None
    prefix_hash_algo: Literal["xxh3_128", "sha256"] = "xxh3_128"
    prefix_hash_seed: int | str | bytes | None = None
    scheduler_reserve_full_isl: bool = True
    cache_aware_admission_window: int = 0
    cache_aware_admission_threshold: float = 0.5
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    fair_prefill_weight: float = 1.0
    fair_decode_weight: float = 2.0
    priority_aging_steps: int = 0
    async_scheduling: bool = False
    max_loras: int = 0
    watermark: float = 0.0
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    num_cpu_blocks: int = 0
    recompute_cost_per_token: float = 1.0
    swap_cost_per_block: float = 1.0
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    # True: a request waiting for its grammar is parked out of `waiting` and queued at its front, in the order
    # added, once ready (newer vLLM). False: it keeps its place in `waiting` and is skipped by each admission
    # pass that reaches it (vLLM 0.33, used by kvsched.vllm).
    park_grammar_waits: bool = True
    # Context parallelism (vLLM's ParallelConfig): DCP shards the KV cache, so a block id covers
    # block_size * dcp_world_size tokens (kv_block_size); PCP does not change the block unit (vLLM 0.33).
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    # Encoder inputs (multimodal): the encoder tokens a step may compute and the encoder cache's capacity in
    # encoder tokens (vLLM's encoder compute budget and encoder_cache_size); 0 accepts no encoder inputs.
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # vLLM's disable_chunked_mm_input: a prefill chunk stops before an encoder input it cannot cover whole.
    disable_chunked_mm_input: bool = False
    # True: a request whose asynchronous KV load is in progress is parked out of every queue and joins the back of
    # the loaded requests once its load is over. False: it keeps its place among the requests holding KV blocks
    # and is skipped by each admission pass that reaches it while loading (vLLM 0.33, used by kvsched.vllm).
    park_kv_loads: bool = True
    # vLLM 0.33's reservation for asynchronous KV loads: one is admitted only if it fits beside what the in-flight
    # prefills (earlier async loads, admitted requests with prompt left) still need for their whole sequence.
    reserve_inflight_prefills: bool = False
    # Rules where vLLM releases differ (docs/semantics.md; True is vLLM 0.33, False vLLM 0.32). Which LoRA
    # adapters count against max_loras at admission: every running request's (True) or only those of the running
    # requests scheduled in this step (False).
    max_loras_counts_unscheduled: bool = True
    # Under policy "priority", a running request that preempts itself for lack of blocks: the pass over the
    # running requests goes on with the next one (True) or ends there, as under "fcfs" (False).
    continue_after_self_preemption: bool = True
    # With speculative decoding, the blocks a step's accepted tokens complete are cached when its output is
    # applied (True) or at the request's next allocation (False; with output placeholders they always are).
    cache_drafts_at_update: bool = True
    # A stop inside a step's tokens cuts the request's computed count back to the tokens kept (True) or leaves it
    # (False: the blocks a KV connector gets at the finish also cover the cut tokens).
    trim_computed_on_stop: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise InvalidConfigError(f"block_size must be a power of two, got {self.block_size}")
        _check_int("num_blocks", self.num_blocks, 2, MAX_NUM_BLOCKS)
        if self.num_blocks * self.block_size > _I32_MAX:
            raise InvalidConfigError(
                f"num_blocks * block_size must fit in int32 slot ids, got {self.num_blocks} * {self.block_size}"
            )
        self._check_context_parallel()
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("prefill_schedule_interval", self.prefill_schedule_interval, 1)
        if self.max_num_active_seqs is not None:
            _check_int("max_num_active_seqs", self.max_num_active_seqs, 1, self.max_num_seqs)
        for name in (
            "enable_prefix_caching",
            "long_prefill_token_threshold_adaptive",
            "enable_chunked_prefill",
            "scheduler_reserve_full_isl",
            "async_scheduling",
            "park_grammar_waits",
            "disable_chunked_mm_input",
            "park_kv_loads",
            "reserve_inflight_prefills",
            "max_loras_counts_unscheduled",
            "continue_after_self_preemption",
            "cache_drafts_at_update",
            "trim_computed_on_stop",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("num_lookahead_tokens", self.num_lookahead_tokens, 0, 1024)
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 0, 1024)
        _check_int("max_loras", self.max_loras, 0)
        _check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 0)
        _check_int("encoder_cache_size", self.encoder_cache_size, 0)
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise InvalidConfigError(f"watermark must be a float, got {self.watermark!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise InvalidConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise InvalidConfigError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}"
            )
        if self.policy not in POLICIES:
            raise InvalidConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.prefix_hash_algo not in PREFIX_HASH_ALGOS:
            raise InvalidConfigError(
                f"prefix_hash_algo must be one of {PREFIX_HASH_ALGOS}, got {self.prefix_hash_algo!r}"
            )
        seed = self.prefix_hash_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, str, bytes))):
            raise InvalidConfigError(f"prefix_hash_seed must be None, an int, a str or bytes, got {seed!r}")
        self._check_policy_fields()

    def _check_context_parallel(self) -> None:
        """dcp/pcp world sizes and the interleave size (docs/semantics.md, "Context parallelism")."""
        _check_int("dcp_world_size", self.dcp_world_size, 1, 1024)
        _check_int("pcp_world_size", self.pcp_world_size, 1, 1024)
        dcp, pcp = self.dcp_world_size, self.pcp_world_size
        if dcp & (dcp - 1):
            raise InvalidConfigError(f"dcp_world_size must be a power of two, got {dcp}")
        if pcp > 1 and dcp > 1 and dcp % pcp:
            raise InvalidConfigError(
                "with pcp_world_size > 1, dcp_world_size must be 1 or a multiple of pcp_world_size (DCP spans the "
                f"PCP axis), got dcp_world_size={dcp} and pcp_world_size={pcp}"
            )
        if self.num_blocks * self.kv_block_size > _I32_MAX:
            raise InvalidConfigError(
                "num_blocks * block_size * dcp_world_size must fit in int32 positions, got "
                f"{self.num_blocks} * {self.block_size} * {dcp}"
            )
        _check_int("cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size, 1, self.block_size)
        if self.block_size % self.cp_kv_cache_interleave_size:
            raise InvalidConfigError(
                f"cp_kv_cache_interleave_size must divide block_size ({self.block_size}), "
                f"got {self.cp_kv_cache_interleave_size}"
            )

    @property
    def kv_block_size(self) -> int:
        """Tokens one block id covers: ``block_size`` slots on each of the ``dcp_world_size`` ranks (vLLM's
        scheduler block size). Allocation, hashing and prefix hits count in these units."""
        return self.block_size * self.dcp_world_size

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens per request per step: ``num_speculative_tokens``, else ``num_lookahead_tokens``."""
        return self.num_lookahead_tokens if self.num_speculative_tokens is None else self.num_speculative_tokens

    def _check_policy_fields(self) -> None:
        """The admission window, fair-share and aging fields (docs/semantics.md, "Admission policies")."""
        _check_int("cache_aware_admission_window", self.cache_aware_admission_window, 0)
        t = self.cache_aware_admission_threshold
        if not _is_real(t) or not 0.0 <= float(t) <= 1.0:
            raise InvalidConfigError(f"cache_aware_admission_threshold must be a float in [0, 1], got {t!r}")
        if self.cache_aware_admission_window > 0 and self.policy != "fcfs":
            raise InvalidConfigError(
                "cache_aware_admission_window > 0 needs policy 'fcfs' (the window reorders the FCFS queue; "
                f"policy {self.policy!r} has its own order), got window {self.cache_aware_admission_window}"
            )
        object.__setattr__(self, "cache_aware_admission_threshold", float(t))
        for name in ("fair_prefill_weight", "fair_decode_weight"):
            w = getattr(self, name)
            if not _is_real(w) or not (math.isfinite(w) and w >= 0):
                raise InvalidConfigError(f"{name} must be a finite float >= 0, got {w!r}")
            object.__setattr__(self, name, float(w))
        weights = self.tenant_weights
        if not isinstance(weights, Mapping):
            raise InvalidConfigError(f"tenant_weights must be a mapping of str to float, got {weights!r}")
        for tenant, w in weights.items():
            check_tenant_weight(tenant, w, InvalidConfigError, InvalidConfigError)
        # Frozen, yet the caller's mapping must not change it afterwards: keep a private copy.
        object.__setattr__(self, "tenant_weights", {str(k): float(v) for k, v in weights.items()})
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _check_int("num_cpu_blocks", self.num_cpu_blocks, 0, MAX_NUM_BLOCKS)
        if self.preemption_mode != "recompute" and self.num_cpu_blocks == 0:
            raise InvalidConfigError(
                f"preemption_mode {self.preemption_mode!r} needs a CPU pool: num_cpu_blocks must be > 0, got 0"
            )
        costs = check_preemption_costs(
            self.recompute_cost_per_token, self.swap_cost_per_block, InvalidConfigError, InvalidConfigError
        )
        object.__setattr__(self, "recompute_cost_per_token", costs[0])
        object.__setattr__(self, "swap_cost_per_block", costs[1])
        _check_int("priority_aging_steps", self.priority_aging_steps, 0)
        if self.priority_aging_steps > 0 and self.policy != "priority":
            raise InvalidConfigError(f"priority_aging_steps > 0 needs policy 'priority', got {self.policy!r}")

    def __hash__(self) -> int:
        # Frozen, so hashable as before tenant_weights (a dict) was added: hash its items instead.
        fields = [getattr(self, f) for f in self.__dataclass_fields__]
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in fields))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can hold (block 0 is the reserved null block)."""
        return self.num_blocks - 1

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds. It may be below ``max_model_len`` (vLLM's scheduler allows it):
        ``add_request`` then refuses each request that could never fit (docs/semantics.md)."""
        return self.num_usable_blocks * self.kv_block_size

    @property
    def max_slots_per_request(self) -> int:
        """The most KV slots one request may hold: ``min(max_model_len, kv_capacity_tokens)``."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    def max_blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.kv_block_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
