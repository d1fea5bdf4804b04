"""kvsched's own settings inside vLLM: engine-wide knobs and per-request attributes.

Engine-wide: ``--additional-config '{"kvsched": {...}}'`` (``VllmConfig.additional_config["kvsched"]``). Every key
is a :class:`~kvsched.config.SchedulerConfig` field, validated by that class's own field table, or one of the
adapter's options (:data:`ADAPTER_OPTIONS`). A field that vLLM's own settings decide (block size, pool size,
budgets, chunking, async scheduling, ...) is refused with the vLLM flag that sets it; a field the adapter must fix
to match vLLM 0.33 is refused unless it has that value. The scheduling policy may come from either side: the kvsched
``policy`` applies when vLLM's ``--scheduling-policy`` is ``fcfs`` (its default) or names the same policy; anything
else is a contradiction and an error.

Per request: ``SamplingParams.extra_args``, which vLLM's OpenAI server fills from the request body's ``vllm_xargs``.
The keys :data:`REQUEST_KEYS` are kvsched's, either at the top level (``{"tenant": "a"}``, the only form
``vllm_xargs`` can carry: its values are scalars or lists) or inside the reserved ``"kvsched"`` mapping
(``{"kvsched": {"tenant": "a"}}``, from Python). Every other top-level key belongs to someone else (vLLM passes
other libraries' keys, ``kv_transfer_params`` among them, through the same dict) and is ignored; inside the
``"kvsched"`` mapping an unknown key is an error. Where vLLM set its own ``Request.session_id`` (request body
``session_id``, the ``X-Session-ID`` header, or ``vllm_xargs.session_id``), that is the request's ``session_id``.

Nothing here runs per step except :meth:`TenantLog.maybe_log` (a clock read, and every interval one pass over the
running requests).
"""

from __future__ import annotations

import difflib
import hmac
import inspect
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvsched._errors import (
    ClientAttributeError,
    InvalidConfigError,
    InvalidRequestError,
    QueueFullError,
    SchedulerTypeError,
)
from kvsched.config import CONFIG_FIELDS, SchedulerConfig

from ._compat import RULES
from ._errors import UnsupportedFeatureError

__all__ = [
    "ADAPTER_FIXED",
    "ADAPTER_OPTIONS",
    "CLIENT_ATTRIBUTES",
    "ENGINE_FIELDS",
    "GATEWAY_TOKEN_KEY",
    "NAMESPACE",
    "REQUEST_KEYS",
    "AdapterOptions",
    "RequestAttrs",
    "TenantLog",
    "build_config",
    "effective_policy",
    "read_additional_config",
    "tenant_counts",
]

NAMESPACE = "kvsched"
WHERE = "--additional-config kvsched"

# SchedulerConfig fields that vLLM's own settings decide: field -> where to set it in vLLM.
ENGINE_FIELDS: dict[str, str] = {
    "block_size": "--block-size",
    "num_blocks": "--gpu-memory-utilization or --num-gpu-blocks-override",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "enable_prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
    "enable_chunked_prefill": "--enable-chunked-prefill / --no-enable-chunked-prefill",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "long_prefill_token_threshold_adaptive": "--long-prefill-token-threshold-adaptive",
    "num_lookahead_tokens": "--speculative-config",
    "num_speculative_tokens": "--speculative-config",
    "hash_lookahead_tokens": "--speculative-config (disable_eagle_block_drop, disable_lookahead_block_hashes)",
    "prefill_lookahead_tokens": "--speculative-config (vLLM's num_prefill_lookahead_tokens: MTP modules)",
    "extra_retained_tokens": "--speculative-config (the windows' extra_retained_tokens with multi-module MTP)",
    "drop_trailing_hit_block": "--speculative-config (disable_eagle_block_drop, disable_lookahead_block_hashes)",
    "mamba_eagle_group": "the model's drafter layers (the KV cache groups vLLM marks is_eagle_group)",
    "hash_block_size": "--prefix-match-unit (vLLM's hash_block_size, with several KV cache groups)",
    "prefix_hash_algo": "--prefix-caching-hash-algo",
    "prefix_hash_seed": "PYTHONHASHSEED (vLLM's NONE_HASH, with the default --prefix-caching-hash-algo sha256)",
    "scheduler_reserve_full_isl": "--scheduler-reserve-full-isl",
    "async_scheduling": "--async-scheduling / --no-async-scheduling",
    "watermark": "--watermark",
    "max_num_active_seqs": "--max-num-active-seqs",
    "prefill_schedule_interval": "--prefill-schedule-interval",
    "max_loras": "--max-loras",
    "kv_load_failure_policy": "--kv-transfer-config's kv_load_failure_policy",
    "dcp_world_size": "--decode-context-parallel-size",
    "pcp_world_size": "--prefill-context-parallel-size",
    "cp_kv_cache_interleave_size": "--cp-kv-cache-interleave-size",
    "max_num_encoder_input_tokens": "vLLM's encoder compute budget for the model (MultiModalBudget)",
    "encoder_cache_size": "vLLM's encoder cache size for the model (MultiModalBudget)",
    "encoder_decoder": "the model (an encoder-decoder model: vLLM's is_encoder_decoder)",
    "mamba_speculative_blocks": "the model's Mamba layers (MambaSpec's num_speculative_blocks)",
    "mamba_align": "--mamba-cache-mode (vLLM's mamba_cache_mode 'align')",
    "zero_new_blocks": "the model's KV cache precisions (vLLM's needs_kv_cache_zeroing)",
    "ring_block_size": "the model's compressor rings (CircularBufferSpec's block size)",
    "prefix_replay_groups": "the model's bounded-replay sliding windows (SlidingWindowMLASpec with bounded_replay)",
    "prefix_cache_retention_interval": "--prefix-cache-retention-interval",
    "mamba_prefill_checkpoint_alignment": (
        "the model's Mamba layers (MambaSpec's num_prefill_checkpoint_blocks and prefill_checkpoint_alignment)"
    ),
    "disable_chunked_mm_input": "--disable-chunked-mm-input",
    "defer_block_free": (
        "--kv-transfer-config's kv_role (a consumer role) with --async-scheduling or --pipeline-parallel-size"
    ),
    "drop_preempted_output": "--kv-transfer-config (the connector's requires_kv_delivery)",
    "divergent_local_hits": "--kv-transfer-config (the connector's supports_divergent_local_hybrid_hits)",
    "defer_async_loads": "vLLM's scheduler (its defer_async_loads, on with deferred frees where vLLM turns it on)",
    "enable_kv_cache_events": "--kv-events-config",
    "sliding_window": "the model's attention (one sliding-window KV cache group)",
    "kv_cache_groups": "the model's attention (its KV cache groups)",
    "kv_cache_group_block_sizes": "the model's attention (its KV cache groups' block sizes)",
    "kv_connector_groups": "--kv-transfer-config with a sliding-window model or several KV cache groups",
    "max_num_scheduled_tokens": "vLLM's max_num_scheduled_tokens (its SchedulerConfig)",
    "draft_slots": "--speculative-config (the drafting method's extra query slots)",
    "decode_stagger": "--pipeline-parallel-size (with --async-scheduling on model runner V2)",
    "max_concurrent_batches": "--pipeline-parallel-size and --async-scheduling (vLLM's max_concurrent_batches)",
}

_NO_SWAP = (
    "vLLM's workers copy no KV for a scheduler: its SchedulerOutput carries no swap-out/swap-in lists (only "
    "GPU-to-GPU copy-on-write copies and connector metadata that only a connector's own worker half reads), so "
    "kvsched.vllm preempts by recomputing, as vLLM does. vLLM's OffloadingConnector (--kv-transfer-config) keeps "
    "CPU copies of full blocks that a resumed request loads back instead; see docs/vllm.md"
)

# SchedulerConfig fields the adapter fixes to vLLM 0.33's behaviour: field -> (the only value accepted, why).
ADAPTER_FIXED: dict[str, tuple[Any, str]] = {
    "preemption_mode": ("recompute", _NO_SWAP),
    "num_cpu_blocks": (0, "the CPU swap pool serves preemption_mode 'swap' and 'auto'; " + _NO_SWAP),
    "recompute_cost_per_token": (1.0, "it prices preemption_mode 'auto'; " + _NO_SWAP),
    "swap_cost_per_block": (1.0, "it prices preemption_mode 'auto'; " + _NO_SWAP),
    "park_grammar_waits": (False, "vLLM 0.33 keeps a request waiting for its grammar at its place in `waiting`"),
    "park_kv_loads": (False, "vLLM 0.33 keeps a request whose KV load is in progress at its place"),
    "reserve_inflight_prefills": (True, "vLLM 0.33 admits a KV load only beside its in-flight prefills"),
    # The rules where the supported vLLM releases differ: the installed release's (kvsched.vllm.RULES).
    **{
        name: (getattr(RULES, name), f"the installed vLLM {RULES.version} has this rule (kvsched.vllm.RULES)")
        for name in (
            "max_loras_counts_unscheduled",
            "continue_after_self_preemption",
            "skip_encoder_blocked_admissions",
            "exact_encoder_cut_and_release",
            "skip_lookahead_cut_admissions",
            "cache_drafts_at_update",
            "trim_computed_on_stop",
            "cache_upto_in_flight",
            "mamba_defer_new_states_only",
            "drop_junction_below",
        )
    },
}


@dataclass
class AdapterOptions:
    """The adapter's own options in ``additional_config["kvsched"]`` (not scheduler fields)."""

    #: Seconds between two ``kvsched tenants`` log lines (INFO, logger ``vllm.kvsched``); 0 turns them off.
    tenant_stats_interval_s: float = 10.0
    #: The per-request attributes (of :data:`CLIENT_ATTRIBUTES`) taken from any request; None: all of them. A
    #: request that sets another one is refused with :class:`~kvsched.ClientAttributeError` naming it, unless it
    #: carries the gateway token (``gateway_token_env``).
    client_attributes: frozenset[str] | None = None
    #: The smallest ``ttft_slo_s`` a request may ask for (None: any).
    min_ttft_slo_s: float | None = None
    #: The inclusive range of ``order_key`` (None: any int64).
    order_key_range: tuple[int, int] | None = None
    #: The inclusive range of vLLM's ``priority`` (None: any).
    priority_range: tuple[int, int] | None = None
    #: The name of an environment variable of the engine that holds the gateway's token: a request whose
    #: ``extra_args["kvsched_gateway_token"]`` equals it may set every attribute (bounds still apply).
    gateway_token_env: str | None = None


ADAPTER_OPTIONS: tuple[str, ...] = (
    "tenant_stats_interval_s",
    "client_attributes",
    "min_ttft_slo_s",
    "order_key_range",
    "priority_range",
    "gateway_token_env",
)
# The attributes a request may carry that ``client_attributes`` can restrict: kvsched's and vLLM's ``priority``.
CLIENT_ATTRIBUTES: tuple[str, ...] = ("tenant", "session_id", "ttft_slo_s", "order_key", "priority")
# The top-level extra_args key of the gateway's token.
GATEWAY_TOKEN_KEY = "kvsched_gateway_token"
_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in CONFIG_FIELDS)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None if it is not a real number (bools are not) or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return f if math.isfinite(f) else None


def _suggest(key: Any, names: Collection[str]) -> str:
    close = difflib.get_close_matches(str(key), list(names), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def read_additional_config(vllm_config: Any) -> tuple[dict[str, Any], AdapterOptions]:
    """The kvsched settings in ``vllm_config.additional_config``: (SchedulerConfig fields, adapter options).

    Raises :class:`~kvsched.InvalidConfigError` for an unknown key (naming the closest valid ones), a field that
    vLLM's own settings decide (naming the vLLM flag), or a bad adapter option; and
    :class:`~kvsched.vllm.UnsupportedFeatureError` for a fixed field with another value. Field values are checked
    by :func:`build_config`. ``additional_config`` that is not a dict (a platform's own object) holds none."""

    extra = getattr(vllm_config, "additional_config", None)
    settings = extra.get(NAMESPACE) if isinstance(extra, Mapping) else None
    if settings is None:
        return {}, AdapterOptions()
    if not isinstance(settings, Mapping):
        raise InvalidConfigError(f"{WHERE} must be a JSON object of settings, got {settings!r}")
    fields: dict[str, Any] = {}
    options = AdapterOptions()
    for key, value in settings.items():
        if key in ENGINE_FIELDS:
            raise InvalidConfigError(
                f"{WHERE}: {key!r} is decided by vLLM's own configuration; set it with {ENGINE_FIELDS[key]}"
            )
        if key in ADAPTER_FIXED:
            fixed, why = ADAPTER_FIXED[key]
            if value != fixed or isinstance(value, bool) != isinstance(fixed, bool):
                raise UnsupportedFeatureError(
                    f"{WHERE}: kvsched.vllm.Scheduler supports only {key}={fixed!r}, got {value!r}: {why}"
                )
            continue
        if key == "tenant_stats_interval_s":
            seconds = _finite(value)
            if seconds is None or seconds < 0:
                raise InvalidConfigError(f"{WHERE}: tenant_stats_interval_s must be finite and >= 0, got {value!r}")
            options.tenant_stats_interval_s = seconds
            continue
        if key in ADAPTER_OPTIONS:
            _read_trust_option(options, key, value)
            continue
        if key not in _FIELD_NAMES:
            raise InvalidConfigError(
                f"{WHERE}: unknown setting {key!r}{_suggest(key, _FIELD_NAMES + ADAPTER_OPTIONS)}; the settings are "
                "kvsched.SchedulerConfig's fields (docs/semantics.md, 'Configuration') and "
                f"{', '.join(ADAPTER_OPTIONS)}"
            )
        fields[key] = value
    return fields, options


def _int_range(key: str, value: Any) -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and -_I64 <= v < _I64 for v in value)
    if not ok or value[0] > value[1]:
        raise InvalidConfigError(f"{WHERE}: {key} must be a list [lo, hi] of two int64s with lo <= hi, got {value!r}")
    return int(value[0]), int(value[1])


def _read_trust_option(options: AdapterOptions, key: str, value: Any) -> None:
    """One of the trust-boundary options (docs/security.md) into ``options``; a bad value raises
    :class:`~kvsched.InvalidConfigError`."""
    if key == "client_attributes":
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise InvalidConfigError(
                f"{WHERE}: client_attributes must be a list of attribute names ({', '.join(CLIENT_ATTRIBUTES)}), "
                f"got {value!r}"
            )
        for name in value:
            if name not in CLIENT_ATTRIBUTES:
                raise InvalidConfigError(
                    f"{WHERE}: client_attributes: unknown attribute {name!r}{_suggest(name, CLIENT_ATTRIBUTES)}; "
                    f"the attributes are {', '.join(CLIENT_ATTRIBUTES)}"
                )
        options.client_attributes = frozenset(value)
    elif key == "min_ttft_slo_s":
        seconds = _finite(value)
        if seconds is None or seconds <= 0:
            raise InvalidConfigError(f"{WHERE}: min_ttft_slo_s must be finite and > 0, got {value!r}")
        options.min_ttft_slo_s = seconds
    elif key == "order_key_range":
        options.order_key_range = _int_range(key, value)
    elif key == "priority_range":
        options.priority_range = _int_range(key, value)
    else:  # gateway_token_env
        if not isinstance(value, str) or not value:
            raise InvalidConfigError(f"{WHERE}: gateway_token_env must name an environment variable, got {value!r}")
        if not os.environ.get(value):
            raise InvalidConfigError(
                f"{WHERE}: gateway_token_env names the environment variable {value!r}, which is unset or empty in "
                "the engine's environment"
            )
        options.gateway_token_env = value


def effective_policy(vllm_policy: str, kvsched_policy: Any) -> Any:
    """The policy the core runs: vLLM's ``--scheduling-policy`` unless the kvsched settings name one. vLLM's
    default ``fcfs`` gives way; ``priority`` contradicts any other kvsched policy (an error, not a silent pick)."""
    if kvsched_policy is None or kvsched_policy == vllm_policy:
        return vllm_policy
    if vllm_policy == "fcfs":
        return kvsched_policy
    raise InvalidConfigError(
        f"{WHERE}: policy {kvsched_policy!r} contradicts vLLM's --scheduling-policy {vllm_policy!r}; keep one: drop "
        f"--scheduling-policy (its default 'fcfs' lets {WHERE} choose) or the kvsched policy"
    )


def build_config(engine_fields: dict[str, Any], knobs: dict[str, Any]) -> SchedulerConfig:
    """``SchedulerConfig(**engine_fields, **knobs)``; a bad knob (its value, or a rule tying it to another field)
    raises :class:`~kvsched.InvalidConfigError` with the message of the field table, marked as the kvsched
    settings'. A config that fails without the knobs too fails as before (vLLM's own settings are at fault)."""
    try:
        return SchedulerConfig(**{**engine_fields, **knobs})
    except InvalidConfigError as e:
        if not knobs:
            raise
        SchedulerConfig(**engine_fields)
        raise InvalidConfigError(f"{WHERE}: {e}") from None


# ---- per request --------------------------------------------------------------------------------------------

REQUEST_KEYS: tuple[str, ...] = ("tenant", "session_id", "ttft_slo_s", "order_key")
_EMPTY: dict[str, Any] = {}
_I64 = 2**63
# Top-level extra_args keys vLLM itself puts there.
_VLLM_KEYS = frozenset({"kv_transfer_params", "ec_transfer_params"})
_OWN_KEYS = frozenset({NAMESPACE, GATEWAY_TOKEN_KEY})
_logger = logging.getLogger("vllm.kvsched")


def _check_name(req_id: str, where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SchedulerTypeError(f"request {req_id!r}: {where} must be a str, got {value!r} ({type(value).__name__})")
    if not value:
        raise InvalidRequestError(f"request {req_id!r}: {where} must be a non-empty str")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidRequestError(f"request {req_id!r}: {where} must be valid unicode") from None
    return value


def _check_value(req_id: str, key: str, where: str, value: Any) -> Any:
    """One kvsched attribute's value (``where`` names it in messages), checked (type, then range) as the core
    checks it."""
    if key in ("tenant", "session_id"):
        return _check_name(req_id, where, value)
    if key == "ttft_slo_s":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchedulerTypeError(
                f"request {req_id!r}: {where} must be a number of seconds, got {value!r} ({type(value).__name__})"
            )
        f = _finite(value)
        if f is None or f <= 0:
            raise InvalidRequestError(f"request {req_id!r}: {where} must be finite and > 0, got {value!r}")
        return f
    # order_key
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchedulerTypeError(f"request {req_id!r}: {where} must be an int, got {value!r} ({type(value).__name__})")
    if not -_I64 <= value < _I64:
        raise InvalidRequestError(f"request {req_id!r}: {where} must fit in int64, got {value}")
    return value


class RequestAttrs:
    """Reads and checks the kvsched attributes of vLLM requests, for a core that takes ``core_keywords``.

    An attribute the core does not take yet is an error for the request (the request asked for a scheduling
    behaviour this build cannot give), except ``session_id``, which vLLM also fills from its own request fields
    for other uses: without session affinity in the core it is ignored."""

    def __init__(self, core_keywords: Collection[str], options: AdapterOptions | None = None) -> None:
        self.supported = frozenset(k for k in REQUEST_KEYS if k in core_keywords)
        self._near_misses: set[str] = set()
        options = options or AdapterOptions()
        self._allowed = options.client_attributes
        self._min_ttft = options.min_ttft_slo_s
        self._ranges = {"order_key": options.order_key_range, "priority": options.priority_range}
        env = options.gateway_token_env
        self._token = os.environ[env].encode() if env is not None else None
        self._bounded = self._allowed is not None or self._min_ttft is not None or any(self._ranges.values())

    @classmethod
    def for_core(cls, add_request: Any, options: AdapterOptions | None = None) -> RequestAttrs:
        """For the core whose ``add_request`` is given (its keyword names are read from its signature)."""
        try:
            names: Collection[str] = inspect.signature(add_request).parameters
        except (TypeError, ValueError):  # no signature: assume the attributes kvsched has always taken
            names = ("tenant",)
        return cls(names, options)

    def read(self, request: Any) -> dict[str, Any]:
        """The core's ``add_request`` keywords for ``request`` (a vLLM ``Request``): only the attributes it sets.

        Raises :class:`~kvsched.InvalidRequestError` (a bad value, an unknown key in the ``"kvsched"`` mapping, a
        key given twice, an attribute this core does not take) or :class:`~kvsched.SchedulerTypeError` (a value
        of the wrong type), each naming the key."""
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
        vllm_session = getattr(request, "session_id", None)
        if not extra and vllm_session is None:
            if self._bounded:
                self._enforce(request, _EMPTY, None)
            return _EMPTY
        req_id = request.request_id
        found: dict[str, tuple[str, Any]] = {}  # key -> (where it was given, value)
        if extra:
            for key in extra:
                if key in REQUEST_KEYS:
                    found[key] = (f"extra_args[{key!r}]", extra[key])
                elif key not in _OWN_KEYS and key not in _VLLM_KEYS:
                    self._warn_near_miss(key)
            nested = extra.get(NAMESPACE)
            if nested is not None:
                if not isinstance(nested, Mapping):
                    raise SchedulerTypeError(
                        f"request {req_id!r}: extra_args[{NAMESPACE!r}] must be a mapping of kvsched attributes "
                        f"({', '.join(REQUEST_KEYS)}), got {nested!r}"
                    )
                for key, value in nested.items():
                    if key not in REQUEST_KEYS:
                        raise InvalidRequestError(
                            f"request {req_id!r}: unknown kvsched attribute extra_args[{NAMESPACE!r}][{key!r}]"
                            f"{_suggest(key, REQUEST_KEYS)}; the attributes are {', '.join(REQUEST_KEYS)}"
                        )
                    if key in found:
                        raise InvalidRequestError(
                            f"request {req_id!r}: {key!r} is given twice, in extra_args and in "
                            f"extra_args[{NAMESPACE!r}]; give it once"
                        )
                    found[key] = (f"extra_args[{NAMESPACE!r}][{key!r}]", value)
        attrs: dict[str, Any] = {}
        for key, (where, value) in found.items():
            value = _check_value(req_id, key, where, value)
            if key == "session_id" and vllm_session is not None:
                continue  # vLLM's own session id wins (it resolved body, header and vllm_xargs already)
            attrs[key] = value
        if vllm_session is not None:
            attrs["session_id"] = _check_name(req_id, "Request.session_id", vllm_session)
        if "session_id" in attrs and "session_id" not in self.supported:
            del attrs["session_id"]
        if self._bounded:
            self._enforce(request, attrs, extra)
        unsupported = [k for k in attrs if k not in self.supported]
        if unsupported:
            raise InvalidRequestError(
                f"request {req_id!r}: this kvsched build does not take the attribute(s) {', '.join(unsupported)} "
                "yet (docs/vllm.md)"
            )
        return attrs

    def _enforce(self, request: Any, attrs: Mapping[str, Any], extra: Mapping[str, Any] | None) -> None:
        """The trust boundary (docs/security.md): an attribute the request may not set, or a value out of the
        operator's bounds, raises :class:`~kvsched.ClientAttributeError` naming it. vLLM's ``priority`` counts as
        set when it is not 0 (its default)."""
        req_id = request.request_id
        given = dict(attrs)
        priority = getattr(request, "priority", 0)
        if priority:
            given["priority"] = priority
        if self._allowed is not None and not self._from_gateway(req_id, extra):
            for key in given:
                if key not in self._allowed:
                    allowed = ", ".join(sorted(self._allowed)) or "none"
                    raise ClientAttributeError(
                        f"request {req_id!r}: the attribute {key!r} may not be set by clients (client_attributes: "
                        f"{allowed}); a gateway sets it (docs/security.md)",
                        attribute=key,
                    )
        slo = given.get("ttft_slo_s")
        if slo is not None and self._min_ttft is not None and slo < self._min_ttft:
            raise ClientAttributeError(
                f"request {req_id!r}: ttft_slo_s {slo!r} is below min_ttft_slo_s {self._min_ttft!r}",
                attribute="ttft_slo_s",
            )
        for key in ("order_key", "priority"):
            bounds, value = self._ranges[key], given.get(key)
            if bounds is not None and value is not None and not bounds[0] <= value <= bounds[1]:
                raise ClientAttributeError(
                    f"request {req_id!r}: {key} {value} is out of {key}_range [{bounds[0]}, {bounds[1]}]",
                    attribute=key,
                )

    def _from_gateway(self, req_id: str, extra: Mapping[str, Any] | None) -> bool:
        """Whether the request carries the gateway's token; a wrong one is refused, naming the key."""
        if self._token is None or not extra or GATEWAY_TOKEN_KEY not in extra:
            return False
        token = extra[GATEWAY_TOKEN_KEY]
        if isinstance(token, str) and hmac.compare_digest(token.encode(errors="replace"), self._token):
            return True
        raise ClientAttributeError(f"request {req_id!r}: wrong {GATEWAY_TOKEN_KEY}", attribute=GATEWAY_TOKEN_KEY)

    def check(self, request: Any) -> tuple[dict[str, Any], Exception | None]:
        """:meth:`read` that never raises: (the keywords, None), or ({}, the error)."""
        try:
            return self.read(request), None
        except (InvalidRequestError, SchedulerTypeError) as e:
            return _EMPTY, e

    @staticmethod
    def request_error(error: Exception) -> Any:
        """vLLM's ``RequestError`` that fails a request for ``error``: a validation error (HTTP 400 from the
        OpenAI server), or for :class:`~kvsched.QueueFullError` a retryable one (HTTP 503); logged at INFO, as
        vLLM logs its own validation failures (offline ``LLM.generate`` keeps only the finish reason)."""
        from vllm.outputs import RequestError  # in both supported releases (vllm.v1.engine re-exports it in 0.33)

        if isinstance(error, QueueFullError):
            _logger.info("Request refused: %s", error)
            return RequestError(code="queue_full", message=str(error), retryable=True)
        _logger.info("Request failed validation: %s", error)
        return RequestError(code="validation_error", message=str(error))

    def _warn_near_miss(self, key: Any) -> None:
        """A top-level key close to one of ours (``"tennant"``) is logged once: it may be a typo, or another
        library's key, so it cannot be an error."""
        if not isinstance(key, str) or key in self._near_misses or len(self._near_misses) >= 256:
            return
        self._near_misses.add(key)
        close = difflib.get_close_matches(key, REQUEST_KEYS, n=1, cutoff=0.75)
        if close:
            _logger.warning(
                "extra_args key %r is not a kvsched attribute and is ignored (did you mean %r? kvsched reads %s)",
                key,
                close[0],
                ", ".join(REQUEST_KEYS),
            )


def tenant_of(request: Any) -> str:
    """The tenant a request was added with (``"default"`` when it named none)."""
    extra = request.sampling_params.extra_args if request.sampling_params is not None else None
    if not extra:
        return "default"
    nested = extra.get(NAMESPACE)
    tenant = extra.get("tenant")
    if tenant is None and isinstance(nested, Mapping):
        tenant = nested.get("tenant")
    return tenant if isinstance(tenant, str) and tenant else "default"


# ---- per-tenant counts --------------------------------------------------------------------------------------


def tenant_counts(sched: Any) -> dict[str, dict[str, float]]:
    """Per tenant, in the core's registration order: running and waiting requests, prompt and output tokens
    served so far, weight and fair-share counter (``sched`` is a :class:`kvsched.vllm.Scheduler`)."""
    core = sched.core
    running = Counter(tenant_of(sched.requests[r]) for r in core.running_req_ids())
    out: dict[str, dict[str, float]] = {}
    for name, t in core.tenant_stats().items():
        out[name] = {
            "running": running.get(name, 0),
            "waiting": t.num_waiting_reqs,
            "prefill_tokens": t.num_prefill_tokens,
            "decode_tokens": t.num_decode_tokens,
            "weight": t.weight,
            "counter": t.counter,
        }
    return out


class TenantLog:
    """A ``kvsched tenants`` line every ``interval_s`` seconds (INFO, logger ``vllm.kvsched``, so that vLLM's
    log handler prints it), once some request named a tenant: vLLM's ``SchedulerStats`` has no field a
    scheduler could fill per tenant without patching vLLM's metrics."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock() + interval_s

    def maybe_log(self, sched: Any) -> str | None:
        """Logs (and returns) the line when the interval has passed and tenants are known; else None."""
        if self.interval_s <= 0:
            return None
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        counts = tenant_counts(sched)
        if not any(name != "default" for name in counts):
            return None
        line = "kvsched tenants: " + "; ".join(
            f"{name}: running {c['running']}, waiting {c['waiting']}, prompt tokens {c['prefill_tokens']}, "
            f"output tokens {c['decode_tokens']}, weight {c['weight']:g}, counter {c['counter']:.6g}"
            for name, c in counts.items()
        )
        _logger.info("%s", line)
        return line
