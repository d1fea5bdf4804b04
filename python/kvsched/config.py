"""Scheduler configuration: one table of fields, from which the dataclass, its validation and the docs come.

:class:`SchedulerConfig` is declared once: each field carries its type (the annotation), its default, and in its
metadata a :class:`FieldSpec` with the valid range or choices and a one-line doc. Validation walks that table
(type, fixed range), then applies the rules that tie fields together (explicit code below);
:func:`fields_markdown` renders the same table for ``docs/semantics.md``. The same config drives the Rust
scheduler and the pure-Python reference; the Rust core checks the values again with the same rules and the same
messages (``tests/test_config.py`` holds the two sides together, defaults included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from ._errors import InvalidConfigError, SchedulerTypeError

#: The ``kv_cache_groups`` entry of a cross-attention group (vLLM's ``CrossAttentionSpec``, encoder-decoder models).
CROSS_ATTENTION = "cross"
#: The ``kv_cache_groups`` entry of a Mamba group (vLLM's ``MambaSpec`` with ``mamba_cache_mode`` "none").
MAMBA = "mamba"
#: The ``kv_cache_groups`` entry of a ring-buffer group (vLLM's ``CircularBufferSpec``): one block per request, taken
#: at its first allocation and freed with it, never cached and never part of a prefix-hit lookup.
RING = "ring"
#: The most KV cache groups ``kv_cache_groups`` may list.
MAX_KV_CACHE_GROUPS = 64
#: The prefix of a chunked-local attention group's ``kv_cache_groups`` entry: ``"chunked:8192"`` (vLLM's
#: ``ChunkedLocalAttentionSpec`` with ``attention_chunk_size=8192``, Llama 4); see :func:`chunked_local`.
CHUNKED_LOCAL_PREFIX = "chunked:"


def chunked_local(chunk_size: int) -> str:
    """The ``kv_cache_groups`` entry of a chunked-local attention group whose chunks are ``chunk_size`` tokens."""
    return f"{CHUNKED_LOCAL_PREFIX}{chunk_size}"


def chunk_size_of(entry: object) -> int | None:
    """The chunk size of a well-formed chunked-local ``kv_cache_groups`` entry (``"chunked:<n>"``, ``n`` in
    ``[1, 2**31 - 4]`` without leading zeros; the core's encodings of ``2**31 - 2`` and ``2**31 - 3`` are a Mamba
    group's and a ring group's), else None."""
    if not isinstance(entry, str) or not entry.startswith(CHUNKED_LOCAL_PREFIX):
        return None
    digits = entry[len(CHUNKED_LOCAL_PREFIX) :]
    if not digits.isascii() or not digits.isdigit() or digits.startswith("0"):
        return None
    n = int(digits)
    return n if n <= I32_MAX - 3 else None


__all__ = [
    "CONFIG_FIELDS",
    "DEFAULT_BLOCK_SIZE",
    "POLICIES",
    "PREEMPTION_MODES",
    "PREEMPTION_VICTIMS",
    "PREFIX_HASH_ALGOS",
    "ConfigField",
    "FieldSpec",
    "SchedulerConfig",
    "check_preemption_costs",
    "check_tenant_limits",
    "chunked_local",
    "fields_markdown",
    "tenant_cache_salt",
]

Policy = Literal["fcfs", "priority", "fair", "sjf", "slo"]
PreemptionMode = Literal["recompute", "swap", "auto"]
PrefixHashAlgo = Literal["xxh3_128", "sha256", "sha256_pickle"]
KvLoadFailurePolicy = Literal["recompute", "fail"]
PreemptionVictim = Literal["default", "lcf", "cost"]

POLICIES: tuple[str, ...] = get_args(Policy)
PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)
PREFIX_HASH_ALGOS: tuple[str, ...] = get_args(PrefixHashAlgo)
KV_LOAD_FAILURE_POLICIES: tuple[str, ...] = get_args(KvLoadFailurePolicy)
PREEMPTION_VICTIMS: tuple[str, ...] = get_args(PreemptionVictim)

# vLLM's default block size; every module that needs a default block size reads it from here.
DEFAULT_BLOCK_SIZE = 16
I32_MAX = 2**31 - 1
# The pool keeps ~50 bytes of bookkeeping per block; 2**24 blocks (~800 MB) is far above any real GPU's pool.
MAX_NUM_BLOCKS = 2**24


@dataclass(frozen=True)
class FieldSpec:
    """What the table says about a field beyond its name, type and default: its valid values and its doc."""

    doc: str
    lo: int = 0
    # The upper bound: for an int field, None means int32's maximum; for a float field, None means "finite".
    hi: int | None = None
    hi_open: bool = False  # a float field's upper bound is excluded
    hi_field: str | None = None  # another field whose value bounds this one from above too
    valid: str | None = None  # the valid values in words, for the fields that explicit code checks
    lo_open: bool = False  # a float field's lower bound is excluded


def _spec(
    doc: str,
    *,
    lo: int = 0,
    hi: int | None = None,
    hi_open: bool = False,
    hi_field: str | None = None,
    valid: str | None = None,
    lo_open: bool = False,
) -> dict[str, FieldSpec]:
    return {"spec": FieldSpec(doc, lo, hi, hi_open, hi_field, valid, lo_open)}


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


def tenant_cache_salt(tenant: str, cache_salt: str | None) -> str:
    """The block-0 salt of a request of ``tenant`` with ``cache_salt`` under ``isolate_tenant_cache``:
    ``kvsched-tenant:<n>:<tenant>``, then ``:<cache_salt>`` if one is given (``<n>``: the tenant's length in UTF-8
    bytes). Distinct pairs give distinct salts, so tenants never share a cached block whatever salts their
    clients choose; the Rust core builds the same string (``hashing.rs``)."""
    salt = f"kvsched-tenant:{len(tenant.encode())}:{tenant}"
    return salt if cache_salt is None else f"{salt}:{cache_salt}"


def check_tenant_limits(name: str, limits: Any) -> dict[str, int]:
    """A per-tenant limit field (``tenant_max_running``, ``tenant_max_waiting``): a mapping of tenant (non-empty
    str) to an int in [1, 2**31 - 1]; returns a private copy, else raises ``InvalidConfigError``."""
    if not isinstance(limits, Mapping):
        raise InvalidConfigError(f"{name} must be a mapping of str to int, got {limits!r}")
    out = {}
    for tenant, limit in limits.items():
        if not isinstance(tenant, str):
            raise InvalidConfigError(f"{name} must map str tenants to int limits, got the key {tenant!r}")
        if not tenant:
            raise InvalidConfigError("a tenant name must be a non-empty string")
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidConfigError(f"{name} must map str tenants to int limits, got {limit!r} for {tenant!r}")
        if not 1 <= limit <= I32_MAX:
            raise InvalidConfigError(f"the {name} of tenant {tenant!r} must be in [1, {I32_MAX}], got {limit}")
        out[tenant] = limit
    return out


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
    """Configuration of a :class:`~kvsched.Scheduler` (field names and defaults follow vLLM).

    The table of fields, with what each does and its valid values, is in ``docs/semantics.md``
    ("Configuration"), generated from the field metadata here. A bad value raises ``InvalidConfigError``.
    """

    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=_spec("tokens per KV block", lo=1, hi=4096))
    num_blocks: int = field(
        default=4096,
        metadata=_spec(
            "blocks in the pool, including the null block 0; `num_blocks * block_size * dcp_world_size` must fit "
            "in int32 slot ids",
            lo=2,
            hi=MAX_NUM_BLOCKS,
        ),
    )
    max_num_seqs: int = field(default=256, metadata=_spec("most requests in `running`", lo=1))
    max_num_batched_tokens: int = field(default=8192, metadata=_spec("token budget per step", lo=1))
    max_model_len: int = field(
        default=8192,
        metadata=_spec(
            "most tokens (prompt + output) of one request. The KV cache may hold fewer tokens than `max_model_len`, "
            "as vLLM's scheduler allows (its engine sizes the cache, not the scheduler): `add_request` then refuses "
            "every request that could never fit (see [Requests that could never fit](#requests-that-could-never-fit))",
            lo=2,
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_spec("reuse the full KV blocks of identical prefixes (chained block hashes)")
    )
    enable_kv_cache_events: bool = field(
        default=False,
        metadata=_spec(
            "record the blocks entering and leaving the prefix cache as vLLM's KV cache events, taken with "
            "`take_kv_cache_events()` (see [KV cache events](#kv-cache-events)); off, they cost nothing"
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=_spec(
            "if False, a prompt is computed in one step; `max_num_batched_tokens` may be below `max_model_len` (as "
            "in vLLM's scheduler): `add_request` refuses the requests that could not be recomputed in one step (see "
            "[Requests that could never fit](#requests-that-could-never-fit))"
        ),
    )
    long_prefill_token_threshold: int = field(
        default=0, metadata=_spec("if > 0, caps the tokens one request gets per step")
    )
    policy: Policy = field(
        default="fcfs",
        metadata=_spec(
            "the order of the waiting queue: first come first served, by priority, weighted fair share across "
            "tenants, shortest uncached prompt first, or earliest TTFT deadline first (see "
            "[Admission policies](#admission-policies))"
        ),
    )
    num_lookahead_tokens: int = field(
        default=0,
        metadata=_spec(
            "extra KV slots reserved for running requests (speculative decoding, vLLM's `num_lookahead_tokens`)",
            hi=1024,
        ),
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata=_spec(
            "draft tokens per request per step, `k` below (vLLM's `num_speculative_tokens`): the padding of new "
            "decodes, the placeholder drafts of async scheduling, the most drafts a request holds. None: "
            "`num_lookahead_tokens` (EAGLE-style drafters reserve one KV slot per draft; an n-gram drafter reserves "
            "none and sets only this)",
            hi=1024,
        ),
    )
    prefix_hash_algo: PrefixHashAlgo = field(
        default="xxh3_128",
        metadata=_spec(
            "the block hash: fast, or collision resistant (for adversarial multi-tenant use); `sha256_pickle` is "
            "SHA-256 with vLLM's default block hash (the pickle of parent, tokens and no extra keys) for every "
            "block without extra keys, chained from the seed as block 0's parent"
        ),
    )
    prefix_hash_seed: int | str | bytes | None = field(
        default=None,
        metadata=_spec(
            "seeds the hash chain; None draws a random seed per scheduler. With `sha256_pickle`: None, or 32 bytes "
            "that are block 0's parent hash as they are (vLLM's `NONE_HASH`)",
            valid="None, an int, a str or bytes",
        ),
    )
    scheduler_reserve_full_isl: bool = field(
        default=True,
        metadata=_spec(
            "vLLM's full-prompt admission gate (vLLM 0.33 default: on): a waiting request is admitted only if the "
            "free blocks can hold **all** of its tokens beyond its prefix hits, not just its first chunk (see "
            "phase B)"
        ),
    )
    cache_aware_admission_window: int = field(
        default=0,
        metadata=_spec(
            "`fcfs` only (> 0 with another policy is refused); how many waiting requests phase B may reorder "
            "warm-before-cold (see [Cache-aware admission window](#cache-aware-admission-window-fcfs)), and among "
            "which session affinity promotes (see [Session affinity](#session-affinity))"
        ),
    )
    cache_aware_admission_threshold: float = field(
        default=0.5, metadata=_spec("KV usage at or above which the admission window applies", hi=1)
    )
    tenant_weights: Mapping[str, float] = field(
        default_factory=dict,
        metadata=_spec(
            "`fair`: weight per tenant; tenants not listed weigh 1.0 (`set_tenant_weight` changes it at run time)",
            valid="a mapping of tenant (non-empty str) to weight (finite, > 0)",
        ),
    )
    fair_prefill_weight: float = field(default=1.0, metadata=_spec("virtual-counter charge per prompt token computed"))
    fair_decode_weight: float = field(default=2.0, metadata=_spec("virtual-counter charge per output token"))
    isolate_tenant_cache: bool = field(
        default=False,
        metadata=_spec(
            "key every request's cached blocks by its tenant (the tenant salts block 0, with the `cache_salt` if "
            "any), so no request hits another tenant's cached prefix (see "
            "[Tenant isolation and limits](#tenant-isolation-and-limits))"
        ),
    )
    max_running_per_tenant: int | None = field(
        default=None,
        metadata=_spec(
            "most running requests of a tenant not in `tenant_max_running`: admission skips the requests of a "
            "tenant at its limit; None = no limit",
            lo=1,
        ),
    )
    tenant_max_running: Mapping[str, int] = field(
        default_factory=dict,
        metadata=_spec(
            "running limit per tenant, overriding `max_running_per_tenant`",
            valid="a mapping of tenant (non-empty str) to an int in [1, 2147483647]",
        ),
    )
    max_waiting_per_tenant: int | None = field(
        default=None,
        metadata=_spec(
            "most waiting (not running) requests of a tenant not in `tenant_max_waiting`: `add_request` refuses a "
            "request of a tenant at its limit with `QueueFullError`; None = no limit",
            lo=1,
        ),
    )
    tenant_max_waiting: Mapping[str, int] = field(
        default_factory=dict,
        metadata=_spec(
            "waiting limit per tenant, overriding `max_waiting_per_tenant`",
            valid="a mapping of tenant (non-empty str) to an int in [1, 2147483647]",
        ),
    )
    priority_aging_steps: int = field(
        default=0,
        metadata=_spec(
            "`priority` only (> 0 with another policy is refused); a waiting request gains one priority level per "
            "this many steps of age (see [Priority aging](#priority-aging))"
        ),
    )
    default_ttft_slo_s: float | None = field(
        default=None,
        metadata=_spec(
            "`slo`: the TTFT target (seconds) of a request added without `ttft_slo_s`; None: such requests have no "
            "deadline and go after every request that has one (see [SLO order](#slo-order))",
            lo_open=True,
        ),
    )
    max_wait_steps: int | None = field(
        default=None,
        metadata=_spec(
            "aging for every policy: a request that has waited this many steps without being admitted goes ahead "
            "of the policy's order, oldest first (see [Aging](#aging-max_wait_steps)); None = off",
            lo=1,
        ),
    )
    session_ttl_steps: int = field(
        default=1000,
        metadata=_spec(
            "session affinity (`fcfs` with an admission window): for how many steps after its last request left "
            "`running` a `session_id` counts as recently active (see [Session affinity](#session-affinity))",
            lo=1,
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_spec(
            "vLLM's `AsyncScheduler`: every scheduled decode leaves output placeholders, so a step scheduled before "
            "the previous one's output is applied already gives each decoding request its next token (see "
            "[Async scheduling](#async-scheduling))"
        ),
    )
    max_loras: int = field(
        default=0,
        metadata=_spec("most distinct `lora_name`s among running requests (vLLM's `max_loras`); 0 = no limit"),
    )
    watermark: float = field(
        default=0.0,
        metadata=_spec(
            "share of `num_blocks` kept free when admitting waiting requests (vLLM's `watermark`)", hi=1, hi_open=True
        ),
    )
    preemption_mode: PreemptionMode = field(
        default="recompute",
        metadata=_spec(
            "what a preemption does with the victim's KV: drop it (vLLM v1), copy it to the CPU pool, or whichever "
            "costs less (see [Preemption modes](#preemption-modes)); `swap` and `auto` need `num_cpu_blocks` > 0"
        ),
    )
    num_cpu_blocks: int = field(default=0, metadata=_spec("blocks in the CPU swap pool", hi=MAX_NUM_BLOCKS))
    recompute_cost_per_token: float = field(
        default=1.0,
        metadata=_spec(
            "`auto`: cost of computing one token of a victim's context again; changed at run time by "
            "`set_preemption_costs`"
        ),
    )
    swap_cost_per_block: float = field(
        default=1.0,
        metadata=_spec("`auto`: cost of copying one block one way (GPU to CPU or back), same unit; settable likewise"),
    )
    preemption_victim: PreemptionVictim = field(
        default="default",
        metadata=_spec(
            "which running request a preemption takes, inside the policy's lowest level: vLLM's choice, the fewest "
            "computed tokens (least computed first), or the most blocks freed per token to compute again, scaled "
            "by the share of the output budget left (see [Victim selection](#victim-selection))"
        ),
    )
    kv_load_failure_policy: KvLoadFailurePolicy = field(
        default="recompute",
        metadata=_spec(
            "KV connector: what a failed asynchronous load does to its request: its tokens are recomputed, or it "
            "finishes with an error (see [KV connector](#kv-connector))"
        ),
    )
    max_num_active_seqs: int | None = field(
        default=None,
        metadata=_spec(
            "most requests admission lets into `running` (vLLM's `max_num_active_seqs`); None = `max_num_seqs`, "
            "which still bounds `running`",
            lo=1,
            hi_field="max_num_seqs",
        ),
    )
    long_prefill_token_threshold_adaptive: bool = field(
        default=False,
        metadata=_spec(
            "vLLM's adaptive threshold: a positive per-request cap is floored at "
            "`max_num_batched_tokens // (len(running) + len(waiting))` (see phase A)"
        ),
    )
    prefill_schedule_interval: int = field(
        default=1,
        metadata=_spec(
            "vLLM's local prefill cadence: while some running request decodes, prefill (admissions with prompt "
            "left and running prompt chunks) runs only on executed steps at least this many after the last one "
            "that carried prefill; 1 = every step (see [Prefill deferral](#prefill-deferral))",
            lo=1,
        ),
    )
    park_grammar_waits: bool = field(
        default=True,
        metadata=_spec(
            "where a request waiting for its grammar waits: True parks it out of `waiting` and queues it at the "
            "front, in the order added, once ready (newer vLLM); False keeps it in `waiting` at its place, skipped "
            "by the admission passes that reach it (vLLM 0.33; `kvsched.vllm` sets False). See [Requests](#requests)"
        ),
    )
    dcp_world_size: int = field(
        default=1,
        metadata=_spec(
            "decode context parallelism (vLLM's `decode_context_parallel_size`): the KV cache is sharded over this "
            "many ranks and a block id covers `block_size * dcp_world_size` tokens (see "
            "[Context parallelism](#context-parallelism))",
            lo=1,
            hi=1024,
        ),
    )
    pcp_world_size: int = field(
        default=1,
        metadata=_spec(
            "prefill context parallelism (vLLM's `prefill_context_parallel_size`); does not change the block unit; "
            "with both > 1, `dcp_world_size` must be a multiple of it",
            lo=1,
            hi=1024,
        ),
    )
    cp_kv_cache_interleave_size: int = field(
        default=1,
        metadata=_spec(
            "vLLM's `cp_kv_cache_interleave_size`: tokens stored on one DCP rank before the next rank's turn; "
            "divides `block_size`; used by the per-rank slot mapping only",
            lo=1,
            hi=1024,
            hi_field="block_size",
        ),
    )
    max_num_encoder_input_tokens: int = field(
        default=0,
        metadata=_spec(
            "encoder tokens a step may compute (vLLM's encoder compute budget). Requests with encoder inputs need "
            "it and `encoder_cache_size` > 0 (see [Encoder inputs](#encoder-inputs))"
        ),
    )
    encoder_cache_size: int = field(
        default=0, metadata=_spec("encoder-cache capacity in encoder tokens (vLLM's `encoder_cache_size`)")
    )
    disable_chunked_mm_input: bool = field(
        default=False,
        metadata=_spec(
            "vLLM's `disable_chunked_mm_input`: a prefill chunk never covers only part of an encoder input, it "
            "stops before it"
        ),
    )
    encoder_decoder: bool = field(
        default=False,
        metadata=_spec(
            "vLLM's encoder-decoder scheduling (Whisper, BART): an admission's `cross_attention_tokens` are its "
            "encoder inputs, charged to the step's `max_num_encoder_input_tokens` and to a slot count that starts "
            "at `encoder_cache_size` (vLLM's `EncoderDecoderCacheManager`); needs a cross-attention group in "
            "`kv_cache_groups` (see [Encoder-decoder scheduling](#encoder-decoder-scheduling))"
        ),
    )
    park_kv_loads: bool = field(
        default=True,
        metadata=_spec(
            "where a request whose asynchronous KV load is in progress waits: True parks it and queues it at the "
            "back of `kv_waiting` once its load is reported over; False puts it back at the front of `kv_waiting` "
            "with the requests skipped in its step and keeps it there at its place, skipped by the admission passes "
            "that reach it while it loads (vLLM 0.33; `kvsched.vllm` sets False). See [KV connector](#kv-connector)"
        ),
    )
    reserve_inflight_prefills: bool = field(
        default=False,
        metadata=_spec(
            "vLLM 0.33's reservation for asynchronous KV loads: such a load is admitted only if its blocks fit "
            "beside what the in-flight prefills still need (`kvsched.vllm` sets True). See "
            "[KV connector](#kv-connector)"
        ),
    )
    defer_block_free: bool = field(
        default=False,
        metadata=_spec(
            "vLLM 0.33 with a KV consumer connector and several batches in flight: blocks freed while a step in "
            "flight scheduled their request go back to the pool only once the steps scheduled before the free are "
            "applied, and a preemption victim with a step in flight is not preempted (`kvsched.vllm` sets it for "
            "such deployments). See [Deferred block frees](#deferred-block-frees)"
        ),
    )
    defer_async_loads: bool = field(
        default=False,
        metadata=_spec(
            "With `defer_block_free` (vLLM 0.33 with HiSparse, or set on a built scheduler): an asynchronous KV "
            "load admitted while a step is in flight is registered with the connector only once the steps "
            "scheduled before its admission are applied. See [Deferred block frees](#deferred-block-frees)"
        ),
    )
    drop_preempted_output: bool = field(
        default=False,
        metadata=_spec(
            "vLLM 0.33 with a KV connector that requires KV delivery (producer roles): a preempted request's "
            "output of steps in flight is dropped instead of delivered (`kvsched.vllm` sets it from the "
            "connector's `requires_kv_delivery`). See [In-flight steps](#in-flight-steps)"
        ),
    )
    kv_connector_groups: bool = field(
        default=False,
        metadata=_spec(
            "vLLM's KV connectors with `SupportsHMA`: the connector's hooks get one block table per KV cache "
            "group (in group order; one without `kv_cache_groups`), and at a finish a window's blocks that left "
            "the window of the processed tokens (and an align-mode Mamba group's states below the last processed "
            "token's) are freed before the connector sees them; allows a connector, and `defer_block_free`, with "
            "full-attention, sliding-window, Mamba and ring groups (`kvsched.vllm` sets it for such connectors). See "
            "[KV connectors with several groups](#kv-connectors-with-several-groups)"
        ),
    )
    divergent_local_hits: bool = field(
        default=False,
        metadata=_spec(
            "vLLM's KV connectors that complete divergent local hybrid hits (NIXL, MoRI-IO): with a connector, "
            "align-mode Mamba groups with prefix caching and a full-attention group, a new request's local hit is "
            "each group's own, looked up alone, as long as the full-attention hit unless a group's runs deeper; "
            "when a group's is shorter and the connector finds no tokens, the usual hit replaces it; no effect "
            "otherwise (`kvsched.vllm` sets it from the connector's `supports_divergent_local_hybrid_hits`). See "
            "[Divergent local hits](#divergent-local-hits)"
        ),
    )
    max_loras_counts_unscheduled: bool = field(
        default=True,
        metadata=_spec(
            "which LoRA adapters count against `max_loras` when a waiting request is admitted: every running "
            "request's (vLLM 0.33), or with False only those of the running requests scheduled in this step "
            "(vLLM 0.32)"
        ),
    )
    continue_after_self_preemption: bool = field(
        default=True,
        metadata=_spec(
            "`priority`: when the running request being scheduled cannot get blocks and is itself the lowest-ranked "
            "victim, it is preempted and the pass goes on with the next running request, which ranks higher and may "
            "fit in the blocks it freed (vLLM 0.33); with False the pass over the running requests ends there "
            "(vLLM 0.32)"
        ),
    )
    skip_encoder_blocked_admissions: bool = field(
        default=True,
        metadata=_spec(
            "a waiting request whose encoder input at the start of its chunk cannot be scheduled this step (the "
            "encoder budget or cache is short and no token before the input is left to compute; an encoder-decoder "
            "request whose encoder output does not fit the budget or the slots) is skipped and keeps its place, the "
            "admission pass going on (vLLM 0.33); with False the admission pass ends there (vLLM 0.32)"
        ),
    )
    exact_encoder_cut_and_release: bool = field(
        default=True,
        metadata=_spec(
            "with a drafter's prefill lookahead (`prefill_lookahead_tokens`) and encoder inputs: a chunk is cut just "
            "before an encoder input that does not fit, and a consumed input is released at its end (vLLM 0.33); "
            "with False both leave the lookahead: the cut stops that many tokens before the input (at nothing when "
            "the chunk starts within them) and the release waits until that many tokens past its end (vLLM 0.32)"
        ),
    )
    skip_lookahead_cut_admissions: bool = field(
        default=True,
        metadata=_spec(
            "a waiting request whose chunk the prefill lookahead (`prefill_lookahead_tokens`) cuts to nothing is "
            "skipped and keeps its place, the admission pass going on (vLLM 0.33); with False the admission pass ends "
            "there (vLLM 0.32)"
        ),
    )
    cache_drafts_at_update: bool = field(
        default=True,
        metadata=_spec(
            "with speculative decoding, the blocks a step's accepted tokens complete are cached when its output is "
            "applied (vLLM 0.33); with False only requests with output placeholders (async scheduling) cache then, "
            "the others at their next allocation (vLLM 0.32)"
        ),
    )
    trim_computed_on_stop: bool = field(
        default=True,
        metadata=_spec(
            "a stop inside a step's tokens (a draft accepted past EOS or `max_tokens`) cuts the request's computed "
            "count back to the tokens kept (vLLM 0.33); with False the count stays, so the blocks a KV connector "
            "gets at the finish also cover the cut tokens (vLLM 0.32). The blocks cached at that update never "
            "cover them"
        ),
    )
    cache_upto_in_flight: bool = field(
        default=True,
        metadata=_spec(
            "the blocks cached when a step's output is applied (see `cache_drafts_at_update`) reach the request's "
            "computed tokens less those of its steps still in flight (vLLM 0.33); with False, less its output "
            "placeholders left (vLLM 0.32's asynchronous scheduler). They differ only after invalid blocks of a "
            "synchronous KV load rolled back a request with a step in flight (see [KV connector](#kv-connector))"
        ),
    )
    hash_lookahead_tokens: int = field(
        default=0,
        metadata=_spec(
            "tokens after each full block that its prefix-cache hash also covers (vLLM 0.33's look-ahead block "
            "hashes for EAGLE-style drafters, `num_hash_lookahead_tokens`): a block gets its hash, and can be "
            "cached, only once the request has these tokens after it, and a hit on it needs them to match too (see "
            "[Prefix caching](#prefix-caching))",
            hi=1024,
        ),
    )
    prefill_lookahead_tokens: int = field(
        default=0,
        metadata=_spec(
            "prefill tokens past a chunk's end that the drafter reads (vLLM's `num_prefill_lookahead_tokens`: the "
            "number of draft tokens for a multi-module MTP drafter, 1 for other EAGLE-style drafters). A chunk's "
            "encoder inputs reach that many tokens past its end (see [Encoder inputs](#encoder-inputs)). Above 1, a "
            "prefill chunk never ends fewer than this many tokens before the request's known tokens end (it is "
            "shortened to leave them, possibly to nothing), and the last `prefill_lookahead_tokens - 1` computed "
            "tokens are not final: the blocks entering the prefix cache stop that many tokens short (with several "
            "groups only with `drop_trailing_hit_block`, and then not in Mamba groups outside its rules, "
            "`mamba_eagle_group` off). 0 changes nothing, nor does 1 without encoder inputs "
            "(see [Speculative decoding](#speculative-decoding))",
            hi=1024,
        ),
    )
    extra_retained_tokens: int = field(
        default=0,
        metadata=_spec(
            "tokens below the window that every sliding-window group keeps (vLLM's `SlidingWindowSpec."
            "extra_retained_tokens`, `num_prefill_lookahead_tokens - 1` with a multi-module MTP drafter): a "
            "window's blocks leave the request that many tokens later and its admission cap holds that many tokens "
            "more; prefix hits still need only the window's blocks. Needs a sliding window (see "
            "[Sliding-window attention](#sliding-window-attention))",
            hi=1024,
        ),
    )
    hash_block_size: int | None = field(
        default=None,
        metadata=_spec(
            "tokens per prefix-cache hash unit (vLLM's `hash_block_size`, set through `prefix_match_unit`): a "
            "block's hash chains over `block_size / hash_block_size` units and is the hash of its last unit; hits, "
            "caching and eviction stay whole blocks, except with prefix caching, align-mode Mamba groups "
            "(`mamba_align`) and every other group full attention, where hits end on a unit boundary inside a block "
            "(see [Prefix hits inside a block](#prefix-hits-inside-a-block)). None = `block_size`. Below "
            "`block_size` it must divide it and needs `kv_cache_groups`; with prefix caching not with "
            "`hash_lookahead_tokens`, `drop_trailing_hit_block` or `enable_kv_cache_events`, and with a Mamba group "
            "only as above (see [Prefix caching](#prefix-caching))",
            lo=1,
            hi=4096,
        ),
    )
    drop_trailing_hit_block: bool = field(
        default=False,
        metadata=_spec(
            "the longest prefix hit gives up its last block, which is computed again (vLLM's EAGLE trailing-block "
            "drop, with a KV connector or without look-ahead hashes); with a sliding window or several groups, "
            "vLLM's EAGLE rules for them (with `mamba_align` also prefill chunk ends and Mamba checkpoints one "
            "block lower); not with a chunked-local group (see [Prefix caching](#prefix-caching))"
        ),
    )
    sliding_window: int | None = field(
        default=None,
        metadata=_spec(
            "every layer attends to the last this many tokens only (vLLM's `SlidingWindowSpec`): blocks wholly "
            "outside the window go back to the pool as the request advances, and a prefix hit needs only the "
            "window's blocks (see [Sliding-window attention](#sliding-window-attention)); None = full attention",
            lo=1,
        ),
    )
    kv_cache_groups: tuple[int | str | None, ...] | None = field(
        default=None,
        metadata=_spec(
            "several KV cache groups in one pool, the attention groups with `block_size` (vLLM's hybrid models: full "
            "attention plus sliding-window, chunked-local, Mamba or ring-buffer layers; encoder-decoder models: plus "
            "cross attention): one entry per group, None for full attention, an int window, `'chunked:<c>'` for "
            "chunked-local attention in chunks of `c` tokens (with a full-attention group), `'cross'` for cross "
            "attention, `'mamba'` for a Mamba group (both need `enable_prefix_caching=False`, a Mamba group not "
            "with `mamba_align`) or `'ring'` for a ring-buffer group (one block per request, never cached); the "
            "first group that is neither Mamba nor ring holds the decoder's tokens and is not `'cross'`; each request "
            "holds one block table per group and a prefix hit must be valid for every group (see [Several KV cache "
            "groups](#several-kv-cache-groups)); None = one group",
            valid="None or 2 to 64 entries, each None, an int >= 1, 'chunked:<c>' (c >= 1), 'cross', 'mamba' or 'ring'",
        ),
    )
    kv_cache_group_block_sizes: tuple[int, ...] | None = field(
        default=None,
        metadata=_spec(
            "each KV cache group's block size in tokens, in group order (vLLM's hybrid models whose groups have "
            "different page sizes): a block of group `g` holds this many tokens, one pool of equal pages serving "
            "every group; each a multiple of `block_size` (a replayed window's, `prefix_replay_groups`, any size), "
            "some group's that is neither Mamba, ring nor replayed equal to it (the first such is the primary group, "
            "which may come after groups of larger blocks); `block_size` is "
            "then the prefix-cache hash unit (vLLM's `hash_block_size`) and hits are aligned to the sizes' least "
            "common multiple (vLLM's scheduler block size). Sizes that differ need full-attention, sliding-window and "
            "ring groups only (a ring holds one block whatever its size, a replayed window any) and no "
            "`hash_block_size` other than `block_size` (see [Several KV cache groups](#several-kv-cache-groups)); "
            "None = `block_size` for every group",
            valid="None or one int per group, each a multiple of `block_size` (a replayed window's any size)",
        ),
    )
    max_num_scheduled_tokens: int | None = field(
        default=None,
        metadata=_spec(
            "tokens computed per step (vLLM's `max_num_scheduled_tokens`), a budget apart from the model inputs "
            "`max_num_batched_tokens` counts; None = `max_num_batched_tokens` (see [Budgets](#budgets))",
            lo=1,
            hi_field="max_num_batched_tokens",
        ),
    )
    mamba_speculative_blocks: int = field(
        default=0,
        metadata=_spec(
            "extra state blocks a request holds in each Mamba group for speculative decoding (vLLM's "
            "`MambaSpec.num_speculative_blocks`): `1 + mamba_speculative_blocks` blocks per Mamba group; above 0 "
            "needs a `'mamba'` group (see [Several KV cache groups](#several-kv-cache-groups))",
            hi=1024,
        ),
    )
    mamba_align: bool = field(
        default=False,
        metadata=_spec(
            'Mamba groups in vLLM\'s `mamba_cache_mode` "align": block-sized state blocks in a table that grows '
            "with the request (real blocks only at its running state) and prefill chunks that end at block "
            "boundaries; with `enable_prefix_caching`, Mamba prefix hits and cached states at block boundaries "
            "(with `enable_kv_cache_events`, stored and removed events for them); needs a `'mamba'` group "
            "(see [Several KV cache groups](#several-kv-cache-groups))"
        ),
    )
    zero_new_blocks: bool = field(
        default=False,
        metadata=_spec(
            "with `kv_cache_groups`, report every attention block an allocation takes in the step's "
            "`zero_block_ids` (vLLM's `needs_kv_cache_zeroing`, which its workers zero before use) as a `'mamba'` "
            "group implies: vLLM also zeroes them when the attention layers store more than one precision; "
            "needs `kv_cache_groups`"
        ),
    )
    prefix_cache_retention_interval: int | None = field(
        default=None,
        metadata=_spec(
            "sparse prefix-cache retention of align-mode Mamba states and sliding-window blocks (vLLM's "
            "`prefix_cache_retention_interval`): None caches every block; 0 only what a later request can resume "
            "at (the prompt's last block boundary before its last token, the shared-prefix junction): a Mamba "
            "group's state there, a window's blocks before it that a hit needs (one block further with "
            "`drop_trailing_hit_block`); a multiple of `block_size` those and the same at the end of every that "
            "many tokens; above 0 needs a sliding window or a `'mamba'` group (see "
            "[Several KV cache groups](#several-kv-cache-groups))"
        ),
    )
    mamba_prefill_checkpoint_alignment: int | None = field(
        default=None,
        metadata=_spec(
            "prefill checkpoints of align-mode Mamba groups (vLLM's `MambaSpec` with `num_prefill_checkpoint_blocks` "
            "above 0 and this `prefill_checkpoint_alignment`): the last prefill chunk, when it starts at a block "
            "boundary, exports the state at a block boundary inside it (a multiple of this many tokens from its "
            "start) into an extra block instead of ending there; None = none; needs `mamba_align` (see "
            "[Several KV cache groups](#several-kv-cache-groups))",
            lo=1,
        ),
    )
    ring_block_size: int | None = field(
        default=None,
        metadata=_spec(
            "the rows of the `'ring'` groups' rings (vLLM's `CircularBufferSpec.block_size`): a ring holds one block "
            "whatever its rows; only the blocks of a speculative decode step an asynchronous KV load reserves count "
            "a ring's by them, as vLLM counts that step at every group's block size; None = `block_size`; needs a "
            "`'ring'` group (see [Several KV cache groups](#several-kv-cache-groups))",
            lo=1,
        ),
    )
    prefix_replay_groups: tuple[int, ...] = field(
        default=(),
        metadata=_spec(
            "the sliding-window groups a prefix hit rebuilds by bounded replay (vLLM's `SlidingWindowMLASpec` with "
            "`bounded_replay`, as in DeepSeek V4.1), by their index in `kv_cache_groups`: they are never cached nor "
            "looked up, and a request admitted with a prefix hit (local or loaded by a KV connector) computes the "
            "hit's last window again (their common window W) to rebuild them, while the other groups keep the hit's "
            "blocks; a hit of at most W tokens is dropped, a connector's hit is floored to whole blocks, and a load "
            "that carries the window (every group) replays nothing. Each entry a plain sliding-window group, all of "
            "one window, with a full-attention or sliding-window group that is not replayed (the primary group; a "
            "replayed window may come first and have blocks of any size); not with `mamba_align`, `encoder_decoder` or "
            "swap (see [Bounded prefix replay](#bounded-prefix-replay)); empty = none",
            valid="empty, or distinct indices of sliding-window groups in `kv_cache_groups`",
        ),
    )
    mamba_defer_new_states_only: bool = field(
        default=True,
        metadata=_spec(
            "align-mode Mamba groups with prefix caching: a hit is deferred a step when the state it ends at was "
            "cached by an allocation in the same `schedule()` call (vLLM 0.33); with False also when an "
            "allocation in the call re-cached it: the state at the prompt's last block boundary that leaves a "
            "token, whenever an allocation's cacheable tokens, floored to a block, end there, even when it was "
            "cached before by a hit or an earlier step (vLLM 0.32; see "
            "[Several KV cache groups](#several-kv-cache-groups))"
        ),
    )
    mamba_eagle_group: bool = field(
        default=True,
        metadata=_spec(
            "with `drop_trailing_hit_block`: align-mode Mamba groups take the drop's rules (vLLM's `is_eagle_group` "
            "marks them, or marks no group); with False (vLLM when it marks the drafter's attention groups only) a "
            "Mamba lookup is none of the drop's (one that shortens the hit makes the drop's lookups check again), "
            "the tokens a Mamba group caches are floored to a block, and under sparse retention it keeps no state "
            "one block below a shared-prefix junction (see [Several KV cache groups](#several-kv-cache-groups))"
        ),
    )
    drop_junction_below: bool = field(
        default=True,
        metadata=_spec(
            "with `drop_trailing_hit_block`, sparse retention and several KV cache groups: a window's blocks (and "
            "the state of a Mamba group that takes the drop's rules) that a hit one block below a shared-prefix "
            "junction needs are kept too (vLLM 0.33); with False only those of a hit at the junction (vLLM 0.32; "
            "see [Several KV cache groups](#several-kv-cache-groups))"
        ),
    )
    draft_slots: int = field(
        default=0,
        metadata=_spec(
            "model inputs a drafter adds to every scheduled request, taken from `max_num_batched_tokens` (vLLM's "
            "`max_num_new_slots_for_drafting`: 1 for a draft model, `k - 1` for parallel EAGLE, `k` for PARD); "
            "below `max_num_batched_tokens` (see [Budgets](#budgets))",
            hi=I32_MAX - 1,
        ),
    )
    decode_stagger: int = field(
        default=1,
        metadata=_spec(
            "`schedule()` calls between two steps of one request that are not prefill chunks (vLLM's "
            "`decode_stagger`: `pipeline_parallel_size` on model runner V2 with async scheduling; `kvsched.vllm` "
            "sets it): after a step that leaves a request nothing known to compute, phase A skips it until this "
            "many calls later; 1 = no wait (see [Pipeline parallelism](#pipeline-parallelism))",
            lo=1,
            hi=1024,
        ),
    )
    max_concurrent_batches: int | None = field(
        default=None,
        metadata=_spec(
            "the most steps the caller keeps in flight (vLLM's `max_concurrent_batches`: the pipeline-parallel "
            "size, plus one with async scheduling on model runner V2; `kvsched.vllm` sets it); sizes what a "
            "sliding-window request may hold at admission (one step's budget per batch); None = 2 with "
            "`async_scheduling`, else 1",
            lo=1,
            hi=1024,
        ),
    )

    def __post_init__(self) -> None:
        for f in CONFIG_FIELDS:
            value = f.check(getattr(self, f.name))
            if value is not getattr(self, f.name):
                object.__setattr__(self, f.name, value)
        self._check_other_fields()
        self._check_rules()

    def _check_other_fields(self) -> None:
        """The fields whose type the table cannot state: the hash seed, the tenant weights and limits."""
        seed = self.prefix_hash_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, str, bytes))):
            raise InvalidConfigError(f"prefix_hash_seed must be None, an int, a str or bytes, got {seed!r}")
        root_ok = seed is None or (isinstance(seed, bytes) and len(seed) == 32)
        if self.prefix_hash_algo == "sha256_pickle" and not root_ok:
            raise InvalidConfigError(
                "prefix_hash_seed must be None or 32 bytes (block 0's parent hash) with prefix_hash_algo "
                f"'sha256_pickle', got {seed!r}"
            )
        weights = self.tenant_weights
        if not isinstance(weights, Mapping):
            raise InvalidConfigError(f"tenant_weights must be a mapping of str to float, got {weights!r}")
        for tenant, w in weights.items():
            check_tenant_weight(tenant, w, InvalidConfigError, InvalidConfigError)
        # Frozen, yet the caller's mapping must not change it afterwards: keep a private copy.
        object.__setattr__(self, "tenant_weights", {str(k): float(v) for k, v in weights.items()})
        for name in ("tenant_max_running", "tenant_max_waiting"):
            object.__setattr__(self, name, check_tenant_limits(name, getattr(self, name)))
        groups = self.kv_cache_groups
        if groups is not None:
            what = (
                "kv_cache_groups must be None or a list of None (full attention), int windows, 'chunked:<chunk "
                "size>' (chunked-local attention), 'cross' (cross attention), 'mamba' (Mamba) and 'ring' (ring "
                "buffer), got "
            )
            if isinstance(groups, (str, bytes, Mapping)) or not hasattr(groups, "__iter__"):
                raise InvalidConfigError(f"{what}{groups!r}")
            groups = tuple(groups)
            for window in groups:
                if isinstance(window, str):
                    if window not in (CROSS_ATTENTION, MAMBA, RING) and chunk_size_of(window) is None:
                        raise InvalidConfigError(f"{what}{self.kv_cache_groups!r}")
                elif window is not None and (isinstance(window, bool) or not isinstance(window, int)):
                    raise InvalidConfigError(f"{what}{self.kv_cache_groups!r}")
            object.__setattr__(self, "kv_cache_groups", groups)
        if self.kv_cache_group_block_sizes is not None:
            what = "kv_cache_group_block_sizes must be None or a list of ints in [1, 2147483647], got "
            sizes = _int_tuple(self.kv_cache_group_block_sizes, 1, what)
            object.__setattr__(self, "kv_cache_group_block_sizes", sizes)
        what = "prefix_replay_groups must be a list of group indices (ints in [0, 2147483647]), got "
        object.__setattr__(self, "prefix_replay_groups", _int_tuple(self.prefix_replay_groups, 0, what))

    def _check_rules(self) -> None:
        """The rules that tie fields together (the Rust core applies them in the same order)."""
        if self.num_blocks * self.block_size > I32_MAX:
            raise InvalidConfigError(
                f"num_blocks * block_size must fit in int32 slot ids, got {self.num_blocks} * {self.block_size}"
            )
        dcp, pcp = self.dcp_world_size, self.pcp_world_size
        if pcp > 1 and dcp > 1 and dcp % pcp:
            raise InvalidConfigError(
                "with pcp_world_size > 1, dcp_world_size must be 1 or a multiple of pcp_world_size (DCP spans the "
                f"PCP axis), got dcp_world_size={dcp} and pcp_world_size={pcp}"
            )
        if self.num_blocks * self.kv_block_size > I32_MAX:
            raise InvalidConfigError(
                "num_blocks * block_size * dcp_world_size must fit in int32 positions, got "
                f"{self.num_blocks} * {self.block_size} * {dcp}"
            )
        for f in CONFIG_FIELDS:
            if f.spec.hi_field is not None:
                value, bound = getattr(self, f.name), getattr(self, f.spec.hi_field)
                if value is not None and value > bound:
                    raise InvalidConfigError(f"{f.name} must be in [{f.spec.lo}, {bound}], got {value}")
        if self.draft_slots >= self.max_num_batched_tokens:
            raise InvalidConfigError(
                f"draft_slots must be below max_num_batched_tokens ({self.max_num_batched_tokens}): every scheduled "
                f"request takes its tokens plus draft_slots of it, got {self.draft_slots}"
            )
        if self.block_size % self.cp_kv_cache_interleave_size:
            raise InvalidConfigError(
                f"cp_kv_cache_interleave_size must divide block_size ({self.block_size}), "
                f"got {self.cp_kv_cache_interleave_size}"
            )
        if self.cache_aware_admission_window > 0 and self.policy != "fcfs":
            raise InvalidConfigError(
                "cache_aware_admission_window > 0 needs policy 'fcfs' (the window reorders the FCFS queue; "
                f"policy {self.policy!r} has its own order), got window {self.cache_aware_admission_window}"
            )
        if self.preemption_mode != "recompute" and self.num_cpu_blocks == 0:
            raise InvalidConfigError(
                f"preemption_mode {self.preemption_mode!r} needs a CPU pool: num_cpu_blocks must be > 0, got 0"
            )
        if self.priority_aging_steps > 0 and self.policy != "priority":
            raise InvalidConfigError(f"priority_aging_steps > 0 needs policy 'priority', got {self.policy!r}")
        window = self.sliding_window
        if window is not None:
            # vLLM: DCP and PCP do not support sliding-window attention; the CPU pool and the KV cache events do not
            # know its null blocks yet.
            if dcp > 1 or pcp > 1:
                raise InvalidConfigError(
                    f"sliding_window ({window}) needs dcp_world_size == 1 and pcp_world_size == 1, got {dcp} and {pcp}"
                )
            if self.preemption_mode != "recompute":
                raise InvalidConfigError(
                    f"sliding_window ({window}) needs preemption_mode 'recompute', got {self.preemption_mode!r}"
                )
        if self.drop_trailing_hit_block and any(chunk_size_of(w) is not None for w in self.kv_cache_groups or ()):
            raise InvalidConfigError(
                "drop_trailing_hit_block cannot be combined with a chunked-local group (vLLM's chunked-local "
                "attention has no trailing-block drop)"
            )
        if self.mamba_prefill_checkpoint_alignment is not None and not self.mamba_align:
            raise InvalidConfigError(
                "mamba_prefill_checkpoint_alignment needs mamba_align (prefill checkpoints are vLLM's "
                "mamba_cache_mode 'align')"
            )
        if self.ring_block_size is not None and RING not in (self.kv_cache_groups or ()):
            raise InvalidConfigError("ring_block_size needs a ring group ('ring') in kv_cache_groups")
        if self.zero_new_blocks and self.kv_cache_groups is None:
            raise InvalidConfigError("zero_new_blocks needs kv_cache_groups (several KV cache groups)")
        self._check_prefill_lookahead()
        self._check_groups()
        self._check_replay_groups()
        self._check_group_block_sizes()
        self._check_retention()
        self._check_hash_block()
        if self.encoder_decoder and CROSS_ATTENTION not in (self.kv_cache_groups or ()):
            raise InvalidConfigError(
                "encoder_decoder needs a cross-attention group ('cross') in kv_cache_groups (the encoder output's "
                "blocks)"
            )

    def _check_prefill_lookahead(self) -> None:
        """What ``prefill_lookahead_tokens`` above 1 and ``extra_retained_tokens`` need (the core's
        ``validate_prefill_lookahead``)."""
        groups = self.kv_cache_groups or ()
        windows = self.sliding_window is not None or any(isinstance(w, int) and not isinstance(w, bool) for w in groups)
        if self.extra_retained_tokens > 0 and not windows:
            raise InvalidConfigError(
                f"extra_retained_tokens ({self.extra_retained_tokens}) needs a sliding window (sliding_window or a "
                "window group)"
            )

    def _check_retention(self) -> None:
        """What ``prefix_cache_retention_interval`` needs (the core's ``validate_retention``)."""
        r = self.prefix_cache_retention_interval
        if r is None:
            return
        groups = self.kv_cache_groups or ()
        windows = self.sliding_window is not None or any(isinstance(w, int) and not isinstance(w, bool) for w in groups)
        if r > 0 and MAMBA not in groups and not windows:
            raise InvalidConfigError(
                f"prefix_cache_retention_interval ({r}) needs a sliding window or a Mamba group (it has no effect "
                "on full attention; 0 or None)"
            )
        if r % self.block_size:
            raise InvalidConfigError(
                f"prefix_cache_retention_interval ({r}) must be a multiple of block_size ({self.block_size})"
            )
        lcm = math.lcm(self.block_size, *self.group_block_sizes())
        if r % lcm:
            raise InvalidConfigError(
                f"prefix_cache_retention_interval ({r}) must be a multiple of the KV cache groups' block sizes' least "
                f"common multiple ({lcm})"
            )

    def _check_hash_block(self) -> None:
        """What a ``hash_block_size`` below ``block_size`` needs (the core's ``validate_hash_block``)."""
        h, bs = self.hash_block_size, self.block_size
        if h is None or h == bs:
            return
        if bs % h:
            raise InvalidConfigError(f"hash_block_size ({h}) must divide block_size ({bs})")
        below = f"hash_block_size ({h}) below block_size ({bs})"
        if self.kv_cache_groups is None:
            raise InvalidConfigError(
                f"{below} needs kv_cache_groups (vLLM hashes finer than the block only with several KV cache groups)"
            )
        if not self.enable_prefix_caching:
            return
        if MAMBA in self.kv_cache_groups:
            if self.partial_hit_unit() is None:
                raise InvalidConfigError(
                    f"{below} with a Mamba group and prefix caching needs align-mode Mamba groups (mamba_align) and "
                    "every other group full attention (prefix hits inside a block)"
                )
            for on, name in (
                (self.num_cpu_blocks > 0, "num_cpu_blocks (swapping)"),
                (bool(self.kv_connector_groups), "kv_connector_groups (a KV connector)"),
                (self.divergent_local_hits, "divergent_local_hits"),
                (self.dcp_world_size > 1 or self.pcp_world_size > 1, "context parallelism"),
                (self.prefill_lookahead_tokens > 1, "prefill_lookahead_tokens"),
            ):
                if on:
                    raise InvalidConfigError(
                        f"{below} with a Mamba group and prefix caching (prefix hits inside a block) cannot be "
                        f"combined with {name} (not implemented)"
                    )
        for on, name in (
            (self.hash_lookahead_tokens > 0, "hash_lookahead_tokens"),
            (self.drop_trailing_hit_block, "drop_trailing_hit_block"),
            (self.enable_kv_cache_events, "enable_kv_cache_events"),
        ):
            if on:
                raise InvalidConfigError(
                    f"{below} cannot be combined with {name} with prefix caching (the prompt-tail cache entries "
                    "vLLM adds inside a block are not implemented)"
                )

    def _check_group_block_sizes(self) -> None:
        """What ``kv_cache_group_block_sizes`` needs (the core's ``validate_group_block_sizes``)."""
        sizes, groups, bs = self.kv_cache_group_block_sizes, self.kv_cache_groups or (), self.block_size
        if sizes is None:
            return
        if len(sizes) != len(groups):
            raise InvalidConfigError(
                f"kv_cache_group_block_sizes must give one size per KV cache group ({len(groups)} groups), got "
                f"{len(sizes)}"
            )
        for g, s in enumerate(sizes):
            # A replayed window is never hashed: its blocks may hold any number of tokens.
            unit = 1 if g in self.prefix_replay_groups else bs
            if s <= 0 or s % unit or s * self.num_blocks > I32_MAX:
                raise InvalidConfigError(
                    f"kv_cache_group_block_sizes must be multiples of block_size ({bs}) (a replayed window's any size) "
                    f"with num_blocks * size <= {I32_MAX}, got {s} for group {g}"
                )
        if sizes[self.primary_group] != bs:
            raise InvalidConfigError(
                f"kv_cache_group_block_sizes must give block_size ({bs}) to a group that is not Mamba, ring or "
                f"replayed, got {list(sizes)}"
            )
        if all(s == bs for s in sizes):
            return
        other = any(w in (CROSS_ATTENTION, MAMBA) or chunk_size_of(w) is not None for w in groups)
        for on, name in (
            (other, "chunked-local, cross-attention or Mamba groups"),
            (self.hash_block_size not in (None, bs), "a hash_block_size other than block_size"),
        ):
            if on:
                raise InvalidConfigError(
                    f"kv_cache_group_block_sizes of different sizes cannot be combined with {name} (not implemented)"
                )

    def partial_hit_unit(self) -> int | None:
        """Tokens per prefix-match unit when a prefix hit can end inside a block (vLLM's partial hash hits): a
        ``hash_block_size`` below ``block_size`` with prefix caching on, align-mode Mamba groups (``mamba_align``)
        and every other group full attention. None otherwise (hits end on whole blocks)."""
        h, groups = self.hash_block_size, self.kv_cache_groups or ()
        if h is None or h >= self.block_size or self.block_size % h:
            return None
        # a ring group is never looked up, so it leaves hits inside a block alone (vLLM counts only the groups that
        # take part in prefix caching)
        fine = all(w is None or w in (MAMBA, RING) for w in groups)
        return h if self.enable_prefix_caching and self.mamba_align and MAMBA in groups and fine else None

    def group_block_sizes(self) -> tuple[int, ...]:
        """Each KV cache group's block size (``kv_cache_group_block_sizes``, or ``kv_block_size`` for every
        group)."""
        if self.kv_cache_group_block_sizes is not None:
            return self.kv_cache_group_block_sizes
        return (self.kv_block_size,) * len(self.kv_cache_groups or ())

    def _check_groups(self) -> None:
        """What several KV cache groups need (the core's ``validate_groups``)."""
        groups = self.kv_cache_groups
        spec_blocks = (
            f"mamba_speculative_blocks ({self.mamba_speculative_blocks}) needs a Mamba group in kv_cache_groups"
        )
        align = "mamba_align needs a Mamba group in kv_cache_groups"
        if groups is None:
            if self.mamba_speculative_blocks > 0:
                raise InvalidConfigError(spec_blocks)
            if self.mamba_align:
                raise InvalidConfigError(align)
            return
        if len(groups) < 2 or len(groups) > MAX_KV_CACHE_GROUPS:
            raise InvalidConfigError(
                f"kv_cache_groups must list 2 to {MAX_KV_CACHE_GROUPS} groups (one group is the plain config or "
                f"sliding_window), got {len(groups)}"
            )
        bad = next((w for w in groups if isinstance(w, int) and not 1 <= w <= I32_MAX), None)
        if bad is not None:
            raise InvalidConfigError(f"kv_cache_groups windows must be in [1, {I32_MAX}], got {bad}")
        if any(chunk_size_of(w) is not None for w in groups) and None not in groups:
            raise InvalidConfigError(
                "kv_cache_groups with a chunked-local group needs a full-attention group (the core looks a "
                "chunked-local hit up within the full-attention hit)"
            )
        first = next((w for w in groups if w not in (MAMBA, RING)), MAMBA)
        if first == MAMBA:
            raise InvalidConfigError(
                "kv_cache_groups needs a group that is not Mamba or ring (it holds the decoder's tokens)"
            )
        if first == CROSS_ATTENTION:
            raise InvalidConfigError(
                "kv_cache_groups cannot start with a cross-attention group (the first group that is not Mamba or ring "
                "holds the decoder's tokens)"
            )
        if self.enable_prefix_caching and CROSS_ATTENTION in groups:
            raise InvalidConfigError(
                "kv_cache_groups with a cross-attention group needs enable_prefix_caching=False (cross-attention "
                "blocks are never cached, and vLLM cannot look up a prefix with them)"
            )
        if self.enable_prefix_caching and MAMBA in groups and not self.mamba_align:
            raise InvalidConfigError(
                "kv_cache_groups with a Mamba group needs enable_prefix_caching=False or mamba_align (vLLM's "
                "mamba_cache_mode 'none' keeps one state per request, never cached)"
            )
        if self.mamba_speculative_blocks > 0 and MAMBA not in groups:
            raise InvalidConfigError(spec_blocks)
        if self.mamba_align and MAMBA not in groups:
            raise InvalidConfigError(align)
        if self.mamba_align and self.disable_chunked_mm_input:
            raise InvalidConfigError(
                "mamba_align cannot be combined with disable_chunked_mm_input (vLLM's mamba_cache_mode 'align' needs "
                "chunks that end at block boundaries inside an encoder input)"
            )
        if self.sliding_window is not None:
            raise InvalidConfigError(
                f"kv_cache_groups cannot be combined with sliding_window ({self.sliding_window}): give the window "
                "per group"
            )
        dcp, pcp = self.dcp_world_size, self.pcp_world_size
        if dcp > 1 or pcp > 1:
            raise InvalidConfigError(
                f"kv_cache_groups needs dcp_world_size == 1 and pcp_world_size == 1, got {dcp} and {pcp}"
            )
        if self.preemption_mode != "recompute":
            raise InvalidConfigError(f"kv_cache_groups needs preemption_mode 'recompute', got {self.preemption_mode!r}")
        if self.defer_block_free and not self.kv_connector_groups:
            raise InvalidConfigError(
                "kv_cache_groups is not supported with defer_block_free (only with kv_connector_groups)"
            )
        if self.preemption_victim != "default":
            raise InvalidConfigError(
                f"kv_cache_groups needs the default preemption_victim, got {self.preemption_victim!r}"
            )

    def _check_replay_groups(self) -> None:
        """What ``prefix_replay_groups`` needs (the core's ``validate_replay_groups``): plain sliding-window groups of
        one window, a full-attention or sliding-window group that is not replayed (the primary group), and none of
        the features whose counts the replay's rewind would change (align-mode Mamba splits, encoder-decoder,
        swap)."""
        replay = self.prefix_replay_groups
        if not replay:
            return
        groups = self.kv_cache_groups
        if groups is None:
            raise InvalidConfigError("prefix_replay_groups needs kv_cache_groups (several KV cache groups)")
        window: int | None = None
        for i, g in enumerate(replay):
            if g >= len(groups):
                raise InvalidConfigError(
                    f"prefix_replay_groups entry {g} is not a group (kv_cache_groups has {len(groups)})"
                )
            if g in replay[:i]:
                raise InvalidConfigError(f"prefix_replay_groups lists group {g} more than once")
            w = groups[g]
            if not isinstance(w, int) or isinstance(w, bool):
                raise InvalidConfigError(f"prefix_replay_groups entry {g} is not a sliding-window group")
            if window is None:
                window = w
            elif w != window:
                raise InvalidConfigError(f"prefix_replay_groups' windows must agree, got {window} and {w}")
        if all(w in (MAMBA, RING) or g in replay for g, w in enumerate(groups)):
            raise InvalidConfigError(
                "prefix_replay_groups lists every attention group; a replayed window needs a full-attention or "
                "sliding-window group that is not replayed"
            )
        if self.mamba_align:
            raise InvalidConfigError("prefix_replay_groups cannot be combined with mamba_align")
        if self.encoder_decoder:
            raise InvalidConfigError("prefix_replay_groups cannot be combined with encoder_decoder")
        if self.num_cpu_blocks > 0:
            raise InvalidConfigError("prefix_replay_groups cannot be combined with swap (num_cpu_blocks)")

    @property
    def replay_window(self) -> int:
        """The replay window W: the common window of ``prefix_replay_groups``; 0 without replay groups."""
        if not self.prefix_replay_groups or self.kv_cache_groups is None:
            return 0
        w = self.kv_cache_groups[self.prefix_replay_groups[0]]
        return w if isinstance(w, int) else 0

    @property
    def primary_group(self) -> int:
        """The KV cache group whose block table holds the decoder's tokens (``new_block_ids``): the first that is
        neither Mamba, a ring nor a replayed window (``prefix_replay_groups``) and, with
        ``kv_cache_group_block_sizes``, whose blocks hold ``block_size`` tokens (the first of the others when none
        does); 0 with one group."""
        replay = self.prefix_replay_groups
        groups = self.kv_cache_groups or (None,)
        candidates = [g for g, w in enumerate(groups) if w not in (MAMBA, RING) and g not in replay]
        sizes = self.kv_cache_group_block_sizes or ()
        return next(
            (g for g in candidates if g < len(sizes) and sizes[g] == self.block_size),
            candidates[0] if candidates else 0,
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

    def __hash__(self) -> int:
        # Frozen, so hashable; tenant_weights is a dict: hash its items instead.
        values = [getattr(self, f) for f in self.__dataclass_fields__]
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in values))

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens one request can be given in a step: the token budget (``max_num_scheduled_tokens``,
        else ``max_num_batched_tokens``), and the model inputs less the request's ``draft_slots``."""
        tokens = self.max_num_batched_tokens if self.max_num_scheduled_tokens is None else self.max_num_scheduled_tokens
        return min(tokens, self.max_num_batched_tokens - self.draft_slots)

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

    @property
    def concurrent_batches(self) -> int:
        """Steps in flight at most: ``max_concurrent_batches``, or 2 with async scheduling, else 1."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        return 2 if self.async_scheduling else 1

    def max_blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.kv_block_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FieldKind = Literal["bool", "int", "optional_int", "float", "optional_float", "choice", "other"]


@dataclass(frozen=True)
class ConfigField:
    """One row of the table of :class:`SchedulerConfig` fields."""

    name: str
    kind: FieldKind
    default: Any
    spec: FieldSpec
    choices: tuple[str, ...] = ()

    @property
    def hi(self) -> int:
        """An int field's fixed upper bound."""
        return I32_MAX if self.spec.hi is None else self.spec.hi

    def check(self, value: Any) -> Any:
        """``value``'s type and fixed range (the rules that involve other fields are the config's); returns the
        value to store: a float field holds a float."""
        name, spec = self.name, self.spec
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise InvalidConfigError(f"{name} must be a bool, got {value!r}")
        elif self.kind == "int" or (self.kind == "optional_int" and value is not None):
            _check_int(name, value, spec.lo, self.hi)
        elif self.kind == "float" or (self.kind == "optional_float" and value is not None):
            return _check_float(name, value, spec)
        elif self.kind == "choice" and value not in self.choices:
            raise InvalidConfigError(f"{name} must be one of {self.choices}, got {value!r}")
        return value

    def valid_values(self) -> str:
        """The valid values, in the words of the docs table."""
        spec = self.spec
        if spec.valid is not None:
            return spec.valid
        if self.kind == "bool":
            return "True or False"
        if self.kind == "choice":
            quoted = [f'`"{c}"`' for c in self.choices]
            return ", ".join(quoted[:-1]) + " or " + quoted[-1]
        if self.kind in ("float", "optional_float"):
            if spec.hi is None:
                text = f"finite, {'>' if spec.lo_open else '>='} {spec.lo}"
            else:
                text = f"[{spec.lo}, {spec.hi}{')' if spec.hi_open else ']'}"
            return "None or " + text if self.kind == "optional_float" else text
        if spec.hi_field is not None:
            text = f"[{spec.lo}, `{spec.hi_field}`]"
        elif spec.hi is None:
            text = f">= {spec.lo}"
        else:
            text = f"[{spec.lo}, {_power_text(spec.hi)}]"
        return "None or " + text if self.kind == "optional_int" else text


def _power_text(n: int) -> str:
    """Large powers of two as ``2**k``."""
    k = n.bit_length() - 1
    return f"2**{k}" if n > 65536 and n == 1 << k else str(n)


def _check_int(name: str, value: Any, minimum: int, maximum: int = I32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= maximum:
        raise InvalidConfigError(f"{name} must be in [{minimum}, {maximum}], got {value}")


def _int_tuple(value: Any, minimum: int, what: str) -> tuple[int, ...]:
    """A list-of-ints field as a tuple, each int in ``[minimum, I32_MAX]``; else InvalidConfigError with ``what``
    (the message up to the value) and the value as given."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise InvalidConfigError(f"{what}{value!r}")
    items = tuple(value)
    if any(isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= I32_MAX for v in items):
        raise InvalidConfigError(f"{what}{value!r}")
    return items


def _check_float(name: str, value: Any, spec: FieldSpec) -> float:
    # The message shows the value as the float stored (as the Rust core, which sees only floats, shows it).
    if not _is_real(value):
        raise InvalidConfigError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    try:
        f = float(value)
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if spec.hi is None:
        if not (math.isfinite(f) and (f > spec.lo if spec.lo_open else f >= spec.lo)):
            raise InvalidConfigError(f"{name} must be finite and {'>' if spec.lo_open else '>='} {spec.lo}, got {f!r}")
    elif not (spec.lo <= f < spec.hi if spec.hi_open else spec.lo <= f <= spec.hi):
        raise InvalidConfigError(f"{name} must be in [{spec.lo}, {spec.hi}{')' if spec.hi_open else ']'}, got {f!r}")
    return f


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _field_kind(hint: Any) -> tuple[FieldKind, tuple[str, ...]]:
    if hint is bool:
        return "bool", ()
    if hint is int:
        return "int", ()
    if hint is float:
        return "float", ()
    if get_origin(hint) is Literal:
        return "choice", get_args(hint)
    if hint == (int | None):
        return "optional_int", ()
    if hint == (float | None):
        return "optional_float", ()
    return "other", ()


def _config_fields() -> tuple[ConfigField, ...]:
    hints = get_type_hints(SchedulerConfig)
    table = []
    for f in fields(SchedulerConfig):
        kind, choices = _field_kind(hints[f.name])
        default = f.default_factory() if callable(f.default_factory) else f.default
        table.append(ConfigField(f.name, kind, default, f.metadata["spec"], choices))
    return tuple(table)


#: The table of fields, in declaration order.
CONFIG_FIELDS = _config_fields()


def fields_markdown() -> str:
    """The table of fields as the Markdown table of ``docs/semantics.md`` ("Configuration")."""
    lines = ["| field | default | valid values | meaning |", "|---|---|---|---|"]
    for f in CONFIG_FIELDS:
        default = f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)
        lines.append(f"| `{f.name}` | `{default}` | {f.valid_values()} | {f.spec.doc} |")
    return "\n".join(lines) + "\n"
