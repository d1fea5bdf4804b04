"""``kvsched.vllm.Scheduler``: vLLM's ``SchedulerInterface`` (0.32 and 0.33) on top of kvsched's Rust core.

The core decides everything that is a scheduling decision: which requests run, how many tokens each computes,
which KV blocks they get (the same block ids as vLLM's block pool would hand out), which prefixes hit the cache,
whom to preempt, and when a request stops. This class keeps vLLM's ``Request`` objects, mirrors onto them the
bookkeeping vLLM's own scheduler does (computed tokens, in-flight and placeholder counts, status, outputs,
events), and turns the core's columnar output into vLLM's ``SchedulerOutput`` and ``EngineCoreOutputs``.

The bookkeeping follows ``vllm/v1/core/sched/scheduler.py`` and ``async_scheduler.py`` of the installed vLLM
release field by field (where 0.32 and 0.33 differ, ``_compat.RULES`` says which way), so that the differential
test (``tests/test_vllm_differential.py``) can compare every field of every output and every request's state with
vLLM's own scheduler after every call.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.core.sched.output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.stats import KV_FETCH_STAGES, PrefixCacheStats, RequestSpecDecodeMetrics, SchedulerStats
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.metrics import SpecDecodingStats
from vllm.v1.structured_output.utils import strip_speculative_padding

from kvsched._core import int_list, vllm_sha256_block_hashes, vllm_sha256_extend_block_hashes
from kvsched._errors import InvalidRequestError, QueueFullError, SchedulerTypeError, UnknownRequestError
from kvsched._types import FinishReason as KvFinishReason
from kvsched._types import RequestStatus as KvRequestStatus
from kvsched.config import CROSS_ATTENTION, MAMBA, RING, tenant_cache_salt
from kvsched.kv_connector import claim_invalid_blocks
from kvsched.scheduler import Scheduler as _CoreScheduler

from ._aux import AuxBridge
from ._cohort import Cohort, CohortRequest, dissolve, fold, form
from ._compat import RULES
from ._config import (
    UnsupportedFeatureError,
    _check_kv_cache_config,
    _refuse,
    check_kv_connector,
    check_multimodal,
    encoder_budget,
    kvsched_config_from_vllm,
)
from ._connector import ConnectorBridge
from ._ec_connector import EcBridge, EncoderCacheView
from ._kv_events import KVEventTranslator, make_publisher
from ._kv_view import KVCacheManagerView
from ._kv_view import lora_key as _lora_key
from ._mm import EncoderInputMap
from ._pins import BlockPins
from ._policy import RequestAttrs, TenantLog, read_additional_config

if TYPE_CHECKING:
    import numpy.typing as npt
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

__all__ = ["Scheduler"]

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING = RequestStatus.WAITING
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
_WAITING_FOR_STREAMING_REQ = RequestStatus.WAITING_FOR_STREAMING_REQ
_KV_WAITING_FOR_REMOTE_KVS = int(KvRequestStatus.WAITING_FOR_REMOTE_KVS)
_KV_WAITING_FOR_GRAMMAR = int(KvRequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)

# kvsched finish reason -> the vLLM status a stopped request ends in.
# Steady decoding steps in a row (the same requests, one token each, nothing else in between) before their counters
# move through a cohort (_cohort.py).
_COHORT_AFTER = 6
_FINISHED_STATUS = {
    int(KvFinishReason.STOP): RequestStatus.FINISHED_STOPPED,
    int(KvFinishReason.LENGTH): RequestStatus.FINISHED_LENGTH_CAPPED,
}
# What a bad kvsched attribute of a request raises (the adapter's check, or the core's).
_BAD_REQUEST = (InvalidRequestError, SchedulerTypeError)
_PAUSE_NAMES = {
    PauseState.UNPAUSED: "unpaused",
    PauseState.PAUSED_NEW: "paused_new",
    PauseState.PAUSED_ALL: "paused_all",
}


def _is_vllm_sha256_hasher(hasher: Any, hash_block_size: int) -> bool:
    """Whether ``hasher`` (a ``Request``'s block hasher) is vLLM's ``get_request_block_hasher`` closure with the
    pickle-based SHA-256 (vLLM's default ``prefix_caching_hash_algo``), no lookahead tokens and this hash block
    size. Then kvsched's core can compute the hashes of its blocks that have no extra keys
    (:func:`kvsched._core.vllm_sha256_block_hashes`); one hash is checked against vLLM's own function first, so a
    Python whose pickle differs falls back to vLLM's hasher."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens

    code = getattr(hasher, "__code__", None)
    if code is None or code is not get_request_block_hasher(hash_block_size, sha256).__code__:
        return False
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in hasher.__closure__ or ()), strict=False))
    if (
        cells.get("caching_hash_fn") is not sha256
        or cells.get("num_hash_lookahead_tokens", 0) != 0  # vLLM 0.32's hasher has no lookahead
        or cells.get("hash_block_size") != hash_block_size
    ):
        return False
    hash_fn: Any = sha256
    parent = hash_fn(b"kvsched.vllm")
    tokens = [(i * 7919) % 70001 + (i % 5) * 2**31 - 2**20 for i in range(hash_block_size)]
    want = hash_block_tokens(hash_fn, parent, tokens, None)
    return bool(vllm_sha256_block_hashes(parent, tokens, hash_block_size) == [want])


def _aux_enabled(vllm_config: Any) -> bool:
    """Whether vLLM builds an auxiliary output connector (vLLM 0.33: ``aux_output_config``; 0.32 has none)."""
    config = getattr(vllm_config, "aux_output_config", None)
    return bool(config is not None and getattr(config, "enabled", False))


# vLLM 0.33's SchedulerOutput carries the multimodal data model runner V2 installs (vLLM 0.32's does not).
_HAS_ENCODER_INPUT_UPDATES = "encoder_input_updates" in SchedulerOutput.__dataclass_fields__


# The next input part of a streaming-input session (vLLM's StreamingUpdate, multimodal parts aside), queued until
# its current part stops; None ends its input.
class _Part(NamedTuple):
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    sampling_params: Any


# A step in flight: vLLM's output, the core's, its token counts, its requests in order (every entry is a
# request: none had finished when it was scheduled), Scheduler._num_forgotten then, and each entry's computed count
# after the step (None when a cohort moved the counters: then computed in update_from_output if needed).
_InFlight = tuple[SchedulerOutput, Any, list[int], list[Request], int, "npt.NDArray[np.int32] | None"]


# The request fields vLLM's _update_after_schedule changes (request, computed tokens, in-flight tokens, prefill-chunk
# flag, output placeholders, drafts): saved and put back around the connector's metadata call.
_UpdatedState = tuple[Request, int, int, bool, int, list[int]]


def _updated_state(r: Request, num_computed_tokens: int) -> _UpdatedState:
    return (
        r,
        num_computed_tokens,
        r.num_in_flight_tokens,
        r.is_prefill_chunk,
        r.num_output_placeholders,
        r.spec_token_ids,
    )


def _restore_state(state: _UpdatedState) -> None:
    r, computed, in_flight, chunk, placeholders, drafts = state
    r.num_computed_tokens, r.num_in_flight_tokens, r.is_prefill_chunk = computed, in_flight, chunk
    r.num_output_placeholders, r.spec_token_ids = placeholders, drafts


class Scheduler(SchedulerInterface):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's scheduler interface (0.32 and 0.33), scheduled by kvsched's Rust core.

    ``vllm serve MODEL --scheduler-cls kvsched.vllm.Scheduler`` or
    ``vllm.LLM(model, scheduler_cls="kvsched.vllm.Scheduler")``. Synchronous and asynchronous scheduling both
    work (the engine's ``async_scheduling`` setting picks the behaviour of vLLM's ``Scheduler`` or
    ``AsyncScheduler``). Unsupported features are refused here with
    :class:`~kvsched.vllm.UnsupportedFeatureError`.
    """

    # Read by vLLM's engine core; kvsched hashes prefixes itself.
    use_eagle_prefix_cache_hashing = False

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        structured_output_manager: StructuredOutputManager,
        block_size: int,
        hash_block_size: int | None = None,
        mm_registry: Any = MULTIMODAL_REGISTRY,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        windows, attention_block_size, mamba_speculative_blocks = _check_kv_cache_config(
            kv_cache_config, block_size, dcp, bool(vllm_config.cache_config.enable_prefix_caching)
        )
        config, self.num_spec_tokens = kvsched_config_from_vllm(
            vllm_config,
            kv_cache_config,
            block_size,
            hash_block_size,
            windows,
            attention_block_size=attention_block_size,
            mamba_speculative_blocks=mamba_speculative_blocks,
        )
        # Each KV cache group's sliding window (None: full attention, "cross", "mamba"), in vLLM's group order.
        self._group_windows: tuple[int | str | None, ...] = tuple(windows)
        self._num_groups = len(windows)
        # DeepSeek V4.1's bounded prefix replay: the replayed windows' groups and their window (0: none).
        self._replay_groups = tuple(config.prefix_replay_groups)
        self._replay_window = int(windows[self._replay_groups[0]]) if self._replay_groups else 0  # type: ignore[arg-type]
        # (vLLM's scheduler attributes of the same.)
        self.prefix_replay_group_ids = self._replay_groups
        self.prefix_replay_tokens = self._replay_window
        # vLLM's needs_kv_cache_zeroing (a model with Mamba layers, or attention layers of several precisions): new
        # attention blocks reported to the workers.
        self._zeroes_new_blocks = MAMBA in windows or bool(config.zero_new_blocks)
        self.needs_kv_cache_zeroing = self._zeroes_new_blocks  # (vLLM's attribute)
        # vLLM's mamba_cache_mode "align": a Mamba group's table grows with the request's tokens.
        self._mamba_align = bool(config.mamba_align)
        # Groups that can grow without the primary group: align-mode Mamba groups, and groups whose blocks are not
        # a multiple of the primary group's (a replayed window's: DeepSeek V4.1's sliding-window cache).
        sizes = config.kv_cache_group_block_sizes or ()
        self._groups_grow_alone = self._mamba_align or any(size % config.block_size for size in sizes)
        # A Mamba group's prefill checkpoint can be keyed by the block below its entry (the trailing-block drop, or
        # look-ahead hashes of several tokens):
        # the prefill stats then read the tokens of each block's hash from the core.
        self._checkpoints_keyed_below = bool(
            (config.drop_trailing_hit_block or config.hash_lookahead_tokens > 1)
            and config.mamba_prefill_checkpoint_alignment is not None
        )
        # With a multi-module MTP drafter a Mamba group's cached states can lie past the primary group's cached
        # blocks (the reprefillable tail the primary group leaves out: a prefill checkpoint, or all of it in Mamba
        # groups outside the drop's rules), so every block of their tables counts (vLLM's estimate reads them all).
        self._mamba_past_cached = bool(config.prefill_lookahead_tokens > 1 and MAMBA in (config.kv_cache_groups or ()))
        # Prefix hits inside a block: a block of any group can be keyed inside it (a hit's or a prompt tail's
        # entry), and a copy of the block a hit ends inside lies past the cached blocks, so the prefill stats read
        # the tokens of every block's hash, in every group, from the core.
        self._partial_keys = config.partial_hit_unit() is not None
        self._mamba_past_cached |= self._partial_keys
        # Groups of different block sizes: each group caches the blocks of its own size the hashes allow (look-ahead
        # hashes can end before the aligned prefix, the trailing-block drop caches a block past it) and a larger
        # full-attention block can be keyed by the prompt's tail inside it, so the prefill stats read the tokens of
        # every block's hash, in every cached group, from the core (vLLM's estimate over each group's blocks).
        self._mixed_keys = len(set(sizes)) > 1
        # Encoder-decoder scheduling (``is_encoder_decoder`` set on a built scheduler with a cross-attention group,
        # as vLLM's tests do): a request's encoder output takes cross-attention blocks at its admission; the
        # identifiers encoded in one step are released in the next step's free_encoder_mm_hashes, as vLLM's
        # EncoderDecoderCacheManager does.
        # An encoder-decoder model (model_config.is_encoder_decoder) schedules so from its construction, with the
        # core's encoder_decoder mode (vLLM's encoder compute budget and EncoderDecoderCacheManager slot count).
        self._enc_dec = config.encoder_decoder
        self._enc_dec_allocated: list[str] = []
        self._enc_dec_to_free: list[str] = []
        # Multimodal models: vLLM's encoder compute budget and encoder cache size for the model.
        # (Both can be set later: max_num_encoder_input_tokens and encoder_cache_manager below.)
        max_num_encoder_input_tokens, encoder_cache_size = encoder_budget(vllm_config, mm_registry)
        if encoder_cache_size:
            config = dataclasses.replace(
                config,
                max_num_encoder_input_tokens=max_num_encoder_input_tokens,
                encoder_cache_size=encoder_cache_size,
            )
        self._mm = EncoderInputMap() if encoder_cache_size and not self._enc_dec else None
        # Model runner V2 (vLLM 0.33): per request, the encoder inputs whose data the workers hold
        # (SchedulerOutput.encoder_input_updates installs and releases them).
        self._pending_encoder_inputs: dict[str, set[int]] = {}
        self._encoder_stats = bool(
            log_stats and getattr(vllm_config.observability_config, "enable_logging_iteration_details", False)
        )
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.structured_output_manager = structured_output_manager
        self.log_stats = log_stats
        self.block_size = block_size
        self.hash_block_size = hash_block_size if hash_block_size is not None else block_size
        self.max_model_len = config.max_model_len
        self.max_num_running_reqs = config.max_num_seqs
        self._priority_policy = config.policy == "priority"
        self.max_num_active_reqs = config.max_num_active_seqs or config.max_num_seqs
        # vLLM's local prefill cadence: prefill_schedule_interval without data parallelism, else 1 (the DP engine
        # core throttles through schedule(throttle_prefills=True)).
        self.local_prefill_interval = config.prefill_schedule_interval
        self.max_num_scheduled_tokens = (
            vllm_config.scheduler_config.max_num_scheduled_tokens or config.max_num_batched_tokens
        )
        self.use_v2_model_runner = bool(vllm_config.use_v2_model_runner)
        self.use_pp = int(vllm_config.parallel_config.pipeline_parallel_size) > 1
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.model_uses_mrope = bool(vllm_config.model_config.uses_mrope)
        self.connector: Any = None
        self._ec_connector: Any = None
        self.num_lookahead_tokens = config.num_lookahead_tokens
        # vLLM 0.33's look-ahead block hashes: a block's hash (vLLM's hasher on the Request, as the core's) waits
        # for the tokens after it, so a block "fills" for hashing that many tokens later.
        self._hash_lookahead = config.hash_lookahead_tokens
        # A multi-module MTP drafter's reprefillable tail: the core's cached blocks stop that many tokens short of
        # the tokens being cached (with several groups only with the trailing-block drop).
        groups = config.kv_cache_groups or ()
        self._reprefillable = (
            0 if len(groups) > 1 and not config.drop_trailing_hit_block else max(0, config.prefill_lookahead_tokens - 1)
        )
        # vLLM's model runner V2 skips drafting in a step whose drafts nobody can use (skip_drafts, vLLM 0.33).
        self.can_skip_drafts = RULES.skip_drafts and self.num_lookahead_tokens > 0 and self.use_v2_model_runner
        self.spec_decode_metrics_level = str(
            getattr(vllm_config.observability_config, "per_request_spec_decode_metrics", "none") or "none"
        )
        # AsyncScheduler's placeholder drafts: one shared, read-only list.
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens
        self._drafts_received = False  # update_draft_token_ids gave some request drafts
        self.kv_config = config
        # A sliding window's block tables (every group's) of the requests awaiting their first output, read before an
        # update.
        self._window_tables: dict[str, tuple[list[int], ...]] = {}
        # With them, the Mamba groups' tokens of each block's hash (_group_key_tokens), the cached blocks and the
        # Mamba blocks' hashes.
        self._key_tokens: dict[str, tuple[dict[int, list[int]], int, dict[int, list[bytes | None]]]] = {}
        # KV connector (vLLM's kv_transfer_config): vLLM's own scheduler-role connector, built as vLLM's scheduler
        # builds it, reached by the core through the bridge's id-keyed hooks.
        self._bridge: ConnectorBridge | None = None
        self._connector_prefix_cache_stats: PrefixCacheStats | None = None
        # Finished requests whose blocks a KV transfer still holds: req_id -> [awaiting recv, awaiting send]. They
        # stay in `requests` (finished) until the engine reports the transfer, as in vLLM.
        self._held: dict[str, list[bool]] = {}
        self._to_release: list[str] = []
        self._kv_failure_fails = False
        # vLLM drops the in-flight output of a request it preempts when the connector must deliver KV (producer
        # roles): the core's drop_preempted_output.
        self._requires_kv_delivery = False
        self._defer_async_loads_unused = False
        # Block pins of a KV connector that binds the block pool (vLLM's SimpleCPUOffloadConnector), else None.
        self._pins: BlockPins | None = None
        if vllm_config.kv_transfer_config is not None:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

            connector = KVConnectorFactory.create_connector(
                config=vllm_config, role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config
            )
            if check_kv_connector(vllm_config, connector):
                self._pins = BlockPins(self)
            self.connector = connector
            self._bridge = ConnectorBridge(
                connector,
                get_request=lambda req_id: self.requests[req_id],
                record_prefix_lookup=self._record_prefix_lookup,
                connector_prefix_cache_stats=lambda: self._connector_prefix_cache_stats,
                mark_slow=lambda req_id: self._slow_req_ids.add(req_id),
                log_stats=self.log_stats,
                windows=self._group_windows,
                looking_up=self._pins.looking_up if self._pins is not None else None,
                replay_groups=self._replay_groups,
                replay_window=self._replay_window,
                block_size=self.block_size,
                hash_block_size=self.hash_block_size,
                drop_trailing_hit_block=config.drop_trailing_hit_block,
            )
            if log_stats:
                self._connector_prefix_cache_stats = PrefixCacheStats()
            self._kv_failure_fails = vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
            self._requires_kv_delivery = bool(connector.requires_kv_delivery)
            # A connector that completes divergent local hybrid hits (vLLM's NIXL and MoRI-IO; a MultiConnector when
            # every one of its connectors does) has vLLM look a new request's hit up group by group.
            divergent = bool(connector.supports_divergent_local_hybrid_hits)
            config = dataclasses.replace(
                config, drop_preempted_output=self._requires_kv_delivery, divergent_local_hits=divergent
            )
        self._core = _CoreScheduler(config, kv_connector=self._bridge)
        # Encoder-cache connector (vLLM's ec_transfer_config): vLLM's own scheduler-role connector, built as
        # vLLM's scheduler builds it; the core asks it (through the bridge) which encoder outputs it can load and
        # whether a request's are still in transit.
        # Per request with encoder inputs, for update_state_after_free: the computed tokens before its first
        # chunk since it was (re)admitted, and its inputs the connector was told were freed.
        self._ec_from: dict[str, int] = {}
        self._ec_freed: dict[str, int] = {}
        # EC request_finished transfer parameters of requests finishing in the call being applied.
        self._ec_params: dict[str, Any] = {}
        if vllm_config.ec_transfer_config is not None:
            from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
            from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

            self.ec_connector = ECConnectorFactory.create_connector(config=vllm_config, role=ECConnectorRole.SCHEDULER)
        # vLLM's KV cache events (kv_events_config), published as vLLM's scheduler publishes them.
        self._kv_events = KVEventTranslator(vllm_config, kv_cache_config, lambda req_id: self.requests[req_id])
        self.kv_event_publisher = make_publisher(vllm_config)
        # kvsched's per-request attributes from extra_args, and the periodic per-tenant log line (docs/vllm.md).
        options = read_additional_config(vllm_config)[1]
        self._request_attrs = RequestAttrs.for_core(self._core.add_request, options)
        self._tenant_log = TenantLog(options.tenant_stats_interval_s)
        # isolate_tenant_cache: vLLM's own block hashes of a request get its tenant as a salt too (connectors and
        # KV cache events see them).
        self._isolate = config.isolate_tenant_cache
        # Requests refused before the core took them (their tenant's waiting queue was full): they finish with
        # an error output at the next update_from_output and never reach the core.
        self._refused: set[str] = set()
        # Streaming-input sessions (resumable requests): their queued next parts (None: the end of their input).
        self._parts: dict[str, deque[_Part | None]] = {}
        # Sessions whose part stopped with KV kept: their next admission looks nothing up in the prefix cache.
        self._resident_sessions: set[str] = set()

        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self.finished_req_ids_dict: dict[int, set[str]] | None = defaultdict(set) if include_finished_set else None
        self.prev_step_scheduled_req_ids: set[str] = set()
        self._reset_preempted_req_ids: set[str] = set()
        self._blocked: dict[str, Request] = {}  # waiting for their grammar, in arrival order
        self._ready: set[str] = set()  # blocked, grammar ready, not yet reached by admission
        self._grammar_errors: dict[str, Any] = {}
        # Requests whose prefill stats are not finalised yet (no output so far): their cached-block count is read
        # before each update that includes them.
        self._awaiting_first_output: set[str] = set()
        # Requests with structured output (fixed when the request is built): the only ones whose grammar flags
        # schedule() has to look at.
        self._so_req_ids: set[str] = set()
        # Requests whose next update entry needs vLLM's full per-request bookkeeping (_update_slow): pending
        # events or prefill stats, stale in-flight output, structured output, a client other than 0. A superset
        # is harmless (the slow path is complete); entries leave it once _update_slow finds nothing pending.
        self._slow_req_ids: set[str] = set()
        # Requests invalid blocks rolled back with async placeholders left (vLLM keeps them, so their token count
        # no longer follows from their computed count): slow until a preemption clears the placeholders.
        self._kv_offset: set[str] = set()
        # Requests that took tokens (a prefill chunk's, with synchronous scheduling) while a later step of theirs
        # was in flight (pipeline parallelism): they hold more tokens than those steps' computed counts, so the
        # blocks those steps' tokens fill no longer follow from the computed counts. Slow (their token lists
        # tell) until no step of theirs is in flight.
        self._tokens_ahead: set[str] = set()
        self._pause_state = PauseState.UNPAUSED
        # Steps scheduled and not yet applied, oldest first (_InFlight).
        self._in_flight: deque[_InFlight] = deque()
        # Requests forgotten (finished, aborted) so far: a list of Request objects built for a step stays valid
        # (every id still names the same object) while this count does not change.
        self._num_forgotten = 0
        # The previous step's scheduled ids and requests, and _num_forgotten then: reused by the next step when
        # the core schedules the same requests in the same order (steady decoding).
        self._last_req_ids: list[str] = []
        self._last_reqs: list[Request] = []
        self._mirroring_preemption = False  # _preempt_request is being called for a preemption the core made
        self._last_num_forgotten = -1
        # The requests of steady decoding whose per-step counters move together (_cohort.py), or None.
        self._cohort: Cohort | None = None
        # Consecutive steady decoding steps (see schedule()) with no other update in between; a cohort forms at
        # _cohort_after of them.
        self._steady_streak = 0
        self._cohort_after = _COHORT_AFTER
        # num_scheduled_tokens of the last one-token-each step (a private template) and the ids it was built for.
        self._ones_template: dict[str, int] | None = None
        self._ones_template_ids: list[str] | None = None
        self._prefix_cache_stats = PrefixCacheStats() if log_stats else None
        # Spec-decoding stats of the update being applied, and its grammar-invalidated draft counts.
        self._spec_stats: SpecDecodingStats | None = None
        self._num_invalid_spec_tokens: dict[str, int] | None = None
        # Block hashers seen on requests -> whether the core can compute their hashes (_is_vllm_sha256_hasher).
        self._hasher_in_core: dict[Any, bool] = {}
        # Whether the core keys a block without extra keys with vLLM's own hash (prefix_hash_algo "sha256_pickle"),
        # so a filled block's vLLM hash is read from the core rather than computed again.
        # (With a hash block smaller than the block the core keeps one hash per block, the last hash block's: the
        # request's hashes of the other hash blocks come from vLLM's hash here.)
        self._core_keys_vllm = (
            config.prefix_hash_algo == "sha256_pickle"
            and config.enable_prefix_caching
            and self.hash_block_size == self.block_size
        )
        self.current_step = 0
        self._kv_view: KVCacheManagerView | None = None
        # vLLM 0.33's auxiliary output connector (routed experts), set now or later (aux_output_connector).
        self._aux = AuxBridge(self)
        if self.connector is not None:
            # vLLM binds its KV cache manager to the connector once its scheduler is built; the connector gets the
            # read-only view (check_kv_connector refused those that would change vLLM's block pool).
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
        if _aux_enabled(vllm_config):
            from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

            self.aux_output_connector = AuxOutputSchedulerConnector(self.kv_cache_manager, self.connector)

    # ---- requests ---------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        req_id = request.request_id
        if req_id in self.requests:
            if req_id in self._grammar_errors or req_id in self._refused:
                # The next input of a streaming-input session whose first request was refused (or is failing):
                # that refusal answers for the id.
                return
            existing = self.requests[req_id]
            if existing.is_finished() and existing.resumable:
                # A finished streaming-input session whose blocks wait for a KV connector's send: vLLM queues the
                # input on the finished request, where nothing takes it.
                return
            if req_id not in self._parts:
                raise InvalidRequestError(f"request {req_id!r} is already known (and not a streaming-input session)")
            self._add_session_input(self.requests[req_id], request)
            return
        # No refusal of a request raises from here: vLLM's engine core dies on an exception from add_request. A
        # refused request finishes with FINISHED_ERROR and its error at the next update_from_output.
        unsupported = self._unsupported(request)
        if unsupported is not None:
            self._grammar_errors[req_id] = self._request_attrs.request_error(unsupported)
            self.requests[req_id] = request
            self._refused.add(req_id)
            return
        sp = request.sampling_params
        blocked = request.status == _WAITING_FOR_GRAMMAR
        # kvsched's per-request attributes (tenant, session, TTFT target, order key) from extra_args. A request
        # with a bad one is added without them, never admitted (not ready), and finishes with FINISHED_ERROR and
        # a validation error at the next update_from_output, the way a grammar that fails to compile does
        # (docs/vllm.md).
        attrs, rejected = self._request_attrs.check(request)
        if rejected is None and self._kv_events.enabled and request.kv_cache_report_mode == "full":
            # vLLM then also publishes the blocks of every prefix-cache lookup that hits, admitted or not.
            rejected = UnsupportedFeatureError(
                f"request {req_id!r}: kvsched.vllm.Scheduler does not support extra_args['kv_cache_report_mode'] "
                "'full' (KV cache events for prefix-cache hits) yet; leave it at 'incremental'"
            )
        client_salt = request.cache_salt
        encoder_inputs = None
        cross_tokens = 0
        if request.mm_features and self._enc_dec:
            # Encoder-decoder: the encoder output is the cross-attention layers' input, not prompt positions.
            cross_tokens = sum(f.mm_position.get_num_embeds() for f in request.mm_features)
            budget = self.max_num_encoder_input_tokens
            if rejected is None and cross_tokens > budget:
                # vLLM's scheduler would skip it at every step (its encoder input never fits the budget).
                rejected = UnsupportedFeatureError(
                    f"request {req_id!r}: its encoder inputs ({cross_tokens} tokens) exceed the encoder compute "
                    f"budget ({budget} tokens); vLLM's scheduler would never schedule it"
                )
        elif request.mm_features:
            if self._mm is None:
                raise UnsupportedFeatureError(
                    f"request {req_id!r}: multimodal inputs for a model without an encoder cache "
                    f"({self.vllm_config.model_config.model!r} does not accept multimodal inputs)"
                )
            encoder_inputs = self._mm.encoder_inputs(request)
        if self._isolate and rejected is None:
            self._salt_block_hashes(request, attrs.get("tenant", "default"))
        try:
            rejected, in_core = self._add_to_core(
                rejected,
                attrs,
                req_id,
                request.prompt_token_ids,
                max_tokens=request.max_tokens,
                # vLLM 0.33's check_stop lets EOS and stop ids end a request before min_tokens (its sampler masks
                # them until then); min_tokens only gates repetition detection, which is refused. So the core, which
                # checks min_tokens first, gets 0 and stops exactly where vLLM's scheduler stops.
                min_tokens=0,
                # vLLM's sampling params hold no EOS id when ignore_eos is set.
                eos_token_id=sp.eos_token_id,
                stop_token_ids=sp.stop_token_ids or (),
                priority=request.priority,
                arrival_time=request.arrival_time,
                cache_salt=client_salt,  # the core adds the tenant itself under isolate_tenant_cache
                lora_name=_lora_key(request.lora_request),
                ready=not blocked,
                resumable=bool(request.resumable),
                # Prompt logprobs: vLLM never reads the prefix cache for them (and leaves them out of its stats).
                skip_reading_prefix_cache=bool(request.skip_reading_prefix_cache),
                encoder_inputs=encoder_inputs,
                **({"cross_attention_tokens": cross_tokens} if cross_tokens else {}),
            )
        except BaseException:
            if self._mm is not None:
                self._mm.release(req_id)
            raise
        if rejected is not None:
            self._grammar_errors[req_id] = self._request_attrs.request_error(rejected)
            blocked = False  # never made ready, even once its grammar compiles
        self.requests[req_id] = request
        if not in_core:
            self._refused.add(req_id)
            return
        if self.spec_decode_metrics_level != "none":
            request.spec_decode_metrics = RequestSpecDecodeMetrics.new(self.num_spec_tokens)
        if request.prefill_stats is not None:
            self._awaiting_first_output.add(req_id)
        if blocked:
            self._blocked[req_id] = request
        if request.structured_output_request is not None:
            self._so_req_ids.add(req_id)
        if request.resumable and rejected is None:
            self._parts[req_id] = deque()
        if self._bridge is not None:
            self.connector.on_new_request(request)
            params = request.kv_transfer_params
            if params and params.get("do_remote_prefill"):
                self._bridge._set_stage(req_id, "waiting_to_start")
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)
        if self._needs_slow_update(request):
            self._slow_req_ids.add(req_id)

    def _add_session_input(self, session: Request, request: Request) -> None:
        """vLLM's ``add_request`` for the id of a live streaming-input session: ``request`` is its next part
        (resumable) or the end of its input (not resumable). A streaming session waiting for input takes a part at once
        and ends at once (aborted) at the end of its input; otherwise either is queued for its following stop."""
        req_id = session.request_id
        waiting_for_input = session.status == _WAITING_FOR_STREAMING_REQ
        if not request.resumable:
            if waiting_for_input:
                self.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            else:
                self._core.finish_input(req_id)
                self._parts[req_id].append(None)
            return
        sp = request.sampling_params
        error: Exception | None = None
        if sp is None or request.prompt_token_ids is None or request.prompt_embeds is not None:
            error = UnsupportedFeatureError(
                f"request {req_id!r}: a streaming-input part needs prompt token ids and sampling parameters"
            )
        elif request.mm_features:
            error = UnsupportedFeatureError(
                f"request {req_id!r}: kvsched.vllm.Scheduler does not support multimodal streaming-input parts yet"
            )
        else:
            try:
                self._core.append_input(
                    req_id,
                    request.prompt_token_ids,
                    max_tokens=request.max_tokens,
                    eos_token_id=sp.eos_token_id,  # None when ignore_eos is set
                    stop_token_ids=sp.stop_token_ids or (),
                    arrival_time=request.arrival_time,
                )
            except _BAD_REQUEST as e:
                error = e
        if error is not None:
            # The core refused the part (it could make the streaming session too long for the KV cache or the model):
            # the streaming session fails with that error at the next update_from_output, as a refused request does.
            self._grammar_errors[req_id] = self._request_attrs.request_error(error)
            return
        part = _Part(list(request.prompt_token_ids), request.max_tokens, request.arrival_time, sp)
        if waiting_for_input:
            self._take_part(session, part)
        else:
            self._parts[req_id].append(part)

    def _take_part(self, session: Request, part: _Part) -> None:
        """vLLM's ``_update_request_as_session``, on the mirrored request (the core took the part itself): the
        kept output tokens join the prompt, then the part's tokens; the part's limits and sampling parameters
        replace the streaming session's; status WAITING. Every output token but the last sampled one is kept
        (vLLM 0.33's rule; vLLM 0.32 keeps the tokens up to the computed count: the same tokens, except after a
        stop inside accepted drafts, where 0.32's count stays past the tokens; the core then caps it at the tokens
        kept, and so does this mirror)."""
        keep_end = session.num_tokens - 1
        if session.num_computed_tokens > keep_end:
            session.num_computed_tokens = keep_end
        prompt = session.prompt_token_ids
        assert prompt is not None
        all_tokens = session._all_token_ids
        kept = all_tokens[session.num_prompt_tokens : keep_end]
        del all_tokens[keep_end:]
        del session.block_hashes[keep_end // self.hash_block_size :]
        session._output_token_ids.clear()
        prompt.extend(kept)
        all_tokens.extend(part.prompt_token_ids)
        prompt.extend(part.prompt_token_ids)
        session.update_block_hashes()
        session.num_prompt_tokens = len(prompt)
        session.arrival_time = part.arrival_time
        session.sampling_params = part.sampling_params
        session.max_tokens = part.max_tokens
        session.status = _WAITING
        if self.log_stats:
            session.record_event(EngineCoreEventType.QUEUED)
            self._slow_req_ids.add(session.request_id)

    def _stop_part(self, request: Request) -> bool:
        """vLLM's ``_handle_stopped_request`` for a streaming-input session whose part the core ended (the core
        did the same to its own state): the streaming session resumes from its materialized tokens and takes its next
        queued part, or waits for input. Returns True when the end of its input was queued (the core finished
        it)."""
        request.num_computed_tokens -= request.num_output_placeholders
        request.spec_token_ids = []
        request.drop_stale_output = True
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        req_id = request.request_id
        parts = self._parts[req_id]
        if parts and parts[0] is None:
            return True
        if request.num_computed_tokens > 0:
            self._resident_sessions.add(req_id)
        if parts:
            part = parts.popleft()
            assert part is not None
            self._take_part(request, part)
        else:
            request.status = _WAITING_FOR_STREAMING_REQ
        return False

    def _add_to_core(
        self, rejected: Exception | None, attrs: dict[str, Any], *args: Any, ready: bool, **kwargs: Any
    ) -> tuple[Exception | None, bool]:
        """The core's ``add_request`` with the request's kvsched attributes ``attrs``; returns why the request is
        rejected (``rejected``, or the core's refusal of an attribute or of the request) and whether the core
        holds it. A request rejected for an attribute is added without its attributes, not ready. A request the
        core refuses without them (its own fault: a prompt that can never fit the KV cache, ...), and one its
        tenant's full waiting queue refuses (``QueueFullError``), stay out of the core."""
        add: Any = self._core.add_request
        try:
            if rejected is None:
                try:
                    add(*args, ready=ready, **kwargs, **attrs)
                    return None, True
                except _BAD_REQUEST as e:
                    if not attrs:
                        return e, False
                    rejected = e  # a rule only the core knows
            add(*args, ready=False, **kwargs)
            return rejected, True
        except QueueFullError as e:
            return e, False
        except _BAD_REQUEST as e:
            return rejected or e, False

    def _salt_block_hashes(self, request: Request, tenant: str) -> None:
        """Under ``isolate_tenant_cache``: the tenant joins the request's cache salt, which keys block 0 of vLLM's
        hashes, and the hashes vLLM computed with the client's salt alone are computed again."""
        request.cache_salt = tenant_cache_salt(tenant, request.cache_salt)
        if request._block_hasher is not None:
            request.block_hashes.clear()
            request.update_block_hashes()

    @staticmethod
    def _unsupported(request: Request) -> UnsupportedFeatureError | None:
        """Why kvsched.vllm cannot serve ``request`` (None: it can)."""
        what = None
        sp = request.sampling_params
        if request.pooling_params is not None or sp is None:
            what = "pooling requests"
        elif request.prompt_token_ids is None or request.prompt_embeds is not None:
            what = "prompt embeddings"
        elif sp.repetition_detection is not None:
            what = "repetition detection"
        if what is None:
            return None
        return UnsupportedFeatureError(
            f"request {request.request_id!r}: kvsched.vllm.Scheduler does not support {what} yet"
        )

    @staticmethod
    def _needs_slow_update(request: Request) -> bool:
        """Whether the request's next update entry needs ``_update_slow`` for a reason that outlives one step."""
        return bool(
            request.events
            or request.prefill_stats is not None
            or request.num_stale_output_tokens > 0
            or request.structured_output_request is not None
            or request.client_index
            or request.status > _PREEMPTED
            # Every output of the request carries these (a plain entry's output has none): a streaming-input
            # session keeps the stop reason of an earlier part.
            or request.trace_headers
            or request.num_nans_in_logits
            or request.stop_reason is not None
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            ids: Iterable[str] = (request_ids,)
        elif request_ids is not None:
            # vLLM frees the requests in the iteration order of this set; so do we (block ids depend on it).
            ids = set(request_ids)
        else:
            ids = list(self.requests)
        valid: list[Request] = []
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid.append(request)
        if not valid:
            return valid
        refused = self._refused
        self._core.abort_requests([r.request_id for r in valid if r.request_id not in refused])
        if self._kv_events.enabled:
            self._kv_events.collect(self._core)  # while the requests its stored events name are known
        aux = self._aux.connector
        for request in valid:
            request.status = finished_status
            if aux is not None:
                self._aux.request_finished(request)
            if request.request_id in refused:
                refused.discard(request.request_id)
            elif self._bridge is not None:
                self._connector_finished(request)
            elif self.ec_connector is not None:
                self._ec_finished(request)
            if self._ec_from:
                # Finished outside a step's update: no update_state_after_free for it (vLLM frees its encoder
                # cache references without telling the connector).
                self._ec_from.pop(request.request_id, None)
                self._ec_freed.pop(request.request_id, None)
            self._forget(request)
        if self._bridge is not None:
            self._release_finished()
        return valid

    def _connector_finished(self, request: Request) -> dict[str, Any] | None:
        """vLLM's ``request_finished`` hook for a request the core just finished (its status set); returns the
        transfer parameters. Blocks the connector does not keep are released by ``_release_finished``."""
        bridge = self._bridge
        assert bridge is not None
        req_id = request.request_id
        # A deferred load was never registered: no transfer will report it over.
        loading = req_id in bridge.loading and req_id not in bridge.deferred
        if self._pins is not None:
            # vLLM's hashes of its cached blocks, for the connector (the core no longer knows the request).
            self._pins.learn_finished(request, bridge.finished.get(req_id, []))
        delay, params = bridge.finish(request)
        if self.ec_connector is not None:
            # vLLM asks the EC connector next; its delayed free keeps the KV blocks too.
            delay |= self._ec_finished(request)
        if delay or loading:
            self._held[req_id] = [loading, delay]
            if self._core.config.kv_connector_groups:
                # vLLM frees the blocks that left a window at the finish, after the frees of the requests that
                # finished before (the core keeps them with the held blocks until told).
                self._release_finished()
                self._core.free_held_window_blocks(req_id)
        if not delay:
            self._to_release.append(req_id)
        return params

    def _ec_forget_finished(self, reqs: list[Request]) -> None:
        """After an update: the EC free bookkeeping of the step's requests that finished goes."""
        ec_from = self._ec_from
        for request in reqs:
            if request.is_finished() and ec_from.pop(request.request_id, None) is not None:
                self._ec_freed.pop(request.request_id, None)

    def _ec_free_one(self, request: Request) -> None:
        """vLLM's ``_free_encoder_inputs`` connector calls for one entry of an update (where vLLM's loop makes
        them, before the request's stop is handled): ``update_state_after_free`` for each input the request
        referenced since its (re)admission (it ends past the computed tokens the request started from) and has
        now consumed (it ends at or before its computed tokens less output placeholders), in input order."""
        ec = self.ec_connector
        assert ec is not None
        req_id = request.request_id
        start = self._ec_from[req_id]
        features = request.mm_features
        upto = request.num_computed_tokens - request.num_output_placeholders
        config = self._core.config
        if not config.exact_encoder_cut_and_release:  # vLLM 0.32: the release waits for the drafter's lookahead
            upto -= config.prefill_lookahead_tokens
        k = self._ec_freed.get(req_id, 0)
        while k < len(features):
            pos = features[k].mm_position
            end = pos.offset + pos.length
            if end > upto:
                break
            if end > start:
                ec.update_state_after_free(request, k)
            k += 1
        self._ec_freed[req_id] = k

    def _ec_rolled_back(self, request: Request) -> None:
        """A running request whose computed tokens invalid blocks cut back: vLLM references again each input its
        steps go over anew (those ending past the new count) and tells the connector of their free once consumed,
        those it had already consumed included."""
        req_id = request.request_id
        start = self._ec_from[req_id] = min(self._ec_from[req_id], request.num_computed_tokens)
        k = self._ec_freed.get(req_id, 0)
        features = request.mm_features
        while k > 0 and features[k - 1].mm_position.offset + features[k - 1].mm_position.length > start:
            k -= 1
        self._ec_freed[req_id] = k

    def _ec_finished(self, request: Request) -> bool:
        """vLLM's EC ``request_finished`` call for a finished request: whether it asks to delay the free; its
        transfer parameters go in the request's last output (``_ec_params``)."""
        assert self.ec_connector is not None
        delay, params = self.ec_connector.request_finished(request)
        if params is not None:
            self._ec_params[request.request_id] = params
        return bool(delay)

    def _release_finished(self) -> None:
        """Hand back to the pool, in finish order, the blocks the core held for the connector's answer."""
        if self._to_release:
            ids, self._to_release = self._to_release, []
            self._core.update_kv_transfers(finished_sending=ids)

    def _forget(self, request: Request) -> None:
        req_id = request.request_id
        if type(request) is CohortRequest:
            fold(request)  # it leaves with its own counters
        self._num_forgotten += 1
        self.finished_req_ids.add(req_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(req_id)
        self._blocked.pop(req_id, None)
        self._ready.discard(req_id)
        self._awaiting_first_output.discard(req_id)
        self._so_req_ids.discard(req_id)
        self._slow_req_ids.discard(req_id)
        self._kv_offset.discard(req_id)
        self._tokens_ahead.discard(req_id)
        if self._parts:
            self._parts.pop(req_id, None)
            self._resident_sessions.discard(req_id)
        if self._mm is not None:
            self._mm.release(req_id)
            self._pending_encoder_inputs.pop(req_id, None)
        if req_id not in self._held:
            del self.requests[req_id]

    # ---- schedule ---------------------------------------------------------------------------------------

    def _promote_ready(self) -> None:
        """Tell the core about requests whose grammar finished compiling. Their status turns WAITING only when an
        admission pass reaches them (``_sync_ready``), as in vLLM's ``_handle_blocked_waiting_request``."""
        for req_id, request in list(self._blocked.items()):
            if req_id in self._ready:
                continue
            so_req = request.structured_output_request
            grammar = so_req.grammar if so_req is not None else None
            if grammar is None:
                continue
            if isinstance(grammar, Exception):
                from vllm.outputs import RequestError

                del self._blocked[req_id]
                self._grammar_errors[req_id] = RequestError(
                    code="validation_error", message=f"Invalid structured outputs: {grammar}"
                )
                continue
            self._core.set_ready(req_id)
            self._ready.add(req_id)

    def _sync_ready(self) -> None:
        """After a step: ready requests that admission reached are no longer waiting for their grammar."""
        for req_id in list(self._ready):
            if self._core.get_request_status(req_id) != _KV_WAITING_FOR_GRAMMAR:
                self._ready.discard(req_id)
                request = self._blocked.pop(req_id)
                if request.status == _WAITING_FOR_GRAMMAR:
                    request.status = _WAITING

    def _sync_loaded(self, bridge: ConnectorBridge, out: Any) -> None:
        """After a step: requests whose load was reported over and that admission reached are WAITING (PREEMPTED
        if preempted before) with the core's computed count, as vLLM's ``_update_waiting_for_remote_kv`` leaves
        them; those it admitted are mirrored as every admission is."""
        admitted = set(out.new_req_ids)
        admitted.update(out.resumed_req_ids)
        for req_id in list(bridge.loaded):
            if self._core.get_request_status(req_id) == _KV_WAITING_FOR_REMOTE_KVS:
                continue
            bridge.loaded.discard(req_id)
            bridge.load_order.pop(req_id, None)
            if req_id not in admitted:
                request = self.requests[req_id]
                request.status = _PREEMPTED if request.num_preemptions else _WAITING
                request.num_computed_tokens = self._core.get_num_computed_tokens(req_id)

    @property
    def num_executed_steps(self) -> int:
        """Steps that scheduled tokens (vLLM's prefill cadence counts these, not ``schedule()`` calls)."""
        return int(self._core.prefill_cadence[0])

    @property
    def last_prefill_step(self) -> int:
        """The executed step that last carried prefill."""
        return int(self._core.prefill_cadence[1])

    @property
    def prefill_capacity_bound(self) -> bool:
        """Whether the last released step left prefills waiting (throttling then stops deferring)."""
        return bool(self._core.prefill_cadence[2])

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        # throttle_prefills: vLLM's data-parallel prefill balancing (set by its DP engine core); the core defers
        # prefill on such a step exactly as vLLM's scheduler does.
        self.current_step += 1
        if self._blocked:
            self._promote_ready()
        bridge = self._bridge
        if bridge is not None:
            bridge.begin_step()
        if self._pins is None:
            out = self._core.schedule(bool(throttle_prefills))
        else:
            with self._pins.deferred():
                out = self._core.schedule(bool(throttle_prefills))
        if self._ready:
            self._sync_ready()
        if bridge is not None and bridge.loaded:
            self._sync_loaded(bridge, out)
        aux = self._aux.connector
        if aux is not None and bridge is not None and bridge.started_loading:
            for req_id in bridge.started_loading:
                request = self.requests[req_id]
                aux.request_loading(request, request.num_computed_tokens)
        requests = self.requests
        log_stats = self.log_stats
        now = time.monotonic() if log_stats else 0.0

        # The core lists every request preempted since the previous step, including those reset_prefix_cache
        # preempted (already mirrored there).
        preempted = self._reset_preempted_req_ids
        for req_id in out.preempted_req_ids:
            if req_id not in preempted:
                self._mirror_preempt(requests[req_id], now)
                preempted.add(req_id)

        req_ids: list[str] = out.req_ids
        # Every scheduled entry has a token at least: a total of one per entry is one each (steady decoding).
        num_sched: list[int] = (
            [1] * len(req_ids) if out.total_num_scheduled_tokens == len(req_ids) else out.num_scheduled_tokens.tolist()
        )
        computed: list[int] = int_list(out.num_computed_tokens)
        block_ptr_arr = out.new_block_ids_indptr
        block_ids: list[int] = out.new_block_ids.tolist()
        # Several KV cache groups: every group's new blocks and their offsets (the primary group's, the first that
        # is not Mamba, are new_block_ids; cross-attention and Mamba groups have their own offsets).
        group_ids: list[list[int]] | None = None
        group_ptrs: list[list[int]] = []
        if self._num_groups > 1:
            group_ids = [out.group_new_block_ids(g).tolist() for g in range(self._num_groups)]
            group_ptrs = [out.group_new_block_ids_indptr(g).tolist() for g in range(self._num_groups)]
        spec_ids = out.spec_token_ids
        spec_ptr: list[int] | None = out.spec_token_ids_indptr.tolist() if len(spec_ids) else None
        spec_list: list[int] = spec_ids.tolist() if spec_ptr is not None else []
        new_ids = out.new_req_ids
        resumed_ids = out.resumed_req_ids
        v2 = self.use_v2_model_runner
        async_sched = self.async_scheduling
        num_spec = self.num_spec_tokens
        spec_placeholders = self._spec_token_placeholders
        drafts_needed = not self.can_skip_drafts
        # Drafts can sit on a running request only with speculative decoding configured (or once the runner sent
        # some): only then does a running request need its drafts cleared.
        clear_drafts = bool(num_spec) or self._drafts_received
        prev = self.prev_step_scheduled_req_ids
        all_token_ids: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        has_so = False
        pending_so = False

        # Phase A: the running requests, which the core lists first. Their columns are slices of the core's
        # (zips with the full num_sched stop at the last running entry); the per-request Python work is vLLM's
        # _update_after_schedule (three or four attribute updates).
        num_run = len(req_ids) - len(new_ids) - len(resumed_ids)
        run_ids = req_ids[:num_run]  # a copy: CachedRequestData gets its own list
        num_forgotten = self._num_forgotten
        # Steady decoding schedules the same requests in the same order step after step: then the previous
        # step's Request list still holds (nothing finished since), and it covers prev_step_scheduled_req_ids.
        same_as_last = (
            num_run == len(req_ids) and num_forgotten == self._last_num_forgotten and req_ids == self._last_req_ids
        )
        run_reqs: list[Request] = self._last_reqs if same_as_last else list(map(requests.__getitem__, run_ids))
        # Only running requests (steady decoding): the whole columns, no copies.
        all_run = num_run == len(req_ids)
        run_computed = computed if all_run else computed[:num_run]
        # No entry is a prefill chunk or carries drafts (the core says so): no per-request chunk test below.
        one_token_each = bool(out.one_token_each)
        # Each entry's computed count after this step (for the blocks that fill in update_from_output; a step
        # whose counters move through a cohort leaves it to be computed there if needed).
        after_arr: npt.NDArray[np.int32] | None = None
        # vLLM's num_output_tokens column (outputs and placeholders before this step's), from the core's counts.
        num_outputs: list[int] = int_list(self._core.step_num_output_tokens(out))
        run_outputs = num_outputs if all_run else num_outputs[:num_run]
        run_blocks: list[tuple[list[int], ...] | None] = [None] * num_run
        # Align-mode Mamba groups and groups of smaller blocks can grow without the primary group: a running request
        # with entries in any group.
        any_ptr = block_ptr_arr
        if self._groups_grow_alone:
            any_ptr = np.sum([np.asarray(p, dtype=np.int64) for p in group_ptrs], axis=0)
        if any_ptr[num_run]:  # some running request got new blocks (a block filled up)
            got = np.flatnonzero(any_ptr[1 : num_run + 1] != any_ptr[:num_run]).tolist()
            if group_ids is None:
                ptr: list[int] = block_ptr_arr.tolist()
                for i in got:
                    run_blocks[i] = (block_ids[ptr[i] : ptr[i + 1]],)
            else:
                for i in got:
                    run_blocks[i] = tuple(ids[p[i] : p[i + 1]] for ids, p in zip(group_ids, group_ptrs, strict=True))
        if spec_ptr is not None:
            for i in range(num_run):
                if spec_ptr[i + 1] > spec_ptr[i]:
                    spec_tokens[run_ids[i]] = spec_list[spec_ptr[i] : spec_ptr[i + 1]]
        if not drafts_needed:
            # vLLM's skip_drafts: drafts are needed unless every request's surely go unused (state before the step).
            for request, c, n in zip(run_reqs, run_computed, num_sched, strict=False):
                if not self._drafts_unused(request, c, n):
                    drafts_needed = True
                    break
        if clear_drafts:
            for request in run_reqs:
                if request.spec_token_ids:
                    request.spec_token_ids = []
        # Model runner V1 gets the whole token list of a running request it did not see in the previous step.
        # (After every step prev holds exactly that step's ids, unless a reset emptied it since.)
        prev_covers_run = v2 or (same_as_last and len(prev) == num_run) or prev.issuperset(run_ids)
        if not prev_covers_run:
            for req_id, request in zip(run_ids, run_reqs, strict=True):
                if req_id not in prev:
                    all_token_ids[req_id] = request._all_token_ids.copy()
        if self._so_req_ids:
            # Structured-output flags, from the state before this step's placeholders.
            so_ids = self._so_req_ids
            for req_id, request, c, n in zip(run_ids, run_reqs, run_computed, num_sched, strict=False):
                if req_id in so_ids and c + n >= len(request._all_token_ids) + request.num_output_placeholders:
                    has_so = True
                    pending_so = pending_so or (async_sched and request.num_output_placeholders > 0)
        # Model runner V2 with multimodal inputs: each scheduled request's confirmed progress before this step
        # (computed tokens less those in flight), for encoder_input_updates.
        confirmed: dict[str, int] | None = None
        if v2 and self._mm is not None and _HAS_ENCODER_INPUT_UPDATES:
            confirmed = {}
            pending_enc = self._pending_encoder_inputs
            for req_id, request, c in zip(run_ids, run_reqs, run_computed, strict=True):
                if req_id in pending_enc:
                    confirmed[req_id] = c - max(request.num_output_placeholders, request.num_in_flight_tokens)
        # With a KV connector: each scheduled request's state as vLLM's build_connector_meta sees it (before its
        # _update_after_schedule), put back around that call (_connector_meta_before_update).
        pre_update: list[_UpdatedState] | None = None
        if bridge is not None or self.ec_connector is not None or aux is not None:
            pre_update = list(map(_updated_state, run_reqs, run_computed))
        # Steady decoding (the previous step's requests, one token each, nothing else written on them): the
        # counters move through a cohort (_cohort.py). One that does not cover this step is dissolved.
        steady = (
            same_as_last
            and num_run
            and one_token_each
            and out.total_num_scheduled_tokens == len(req_ids)
            and pre_update is None
            and not (async_sched and (num_spec or clear_drafts))
        )
        self._steady_streak = self._steady_streak + 1 if steady else 0
        cohort = self._cohort
        if cohort is not None and not (steady and cohort.intact and cohort.reqs is run_reqs):
            dissolve(cohort)
            cohort = self._cohort = None
        if cohort is None:
            after_arr = out.num_computed_tokens + out.num_scheduled_tokens
        if cohort is not None:
            # Every member: one more computed and in-flight token (and output placeholder); still no chunk.
            cohort.scheduled += 1
        elif one_token_each:
            # Every entry samples one token and carries no drafts: none is a prefill chunk.
            assert after_arr is not None
            run_after = after_arr[:num_run].tolist()
            if out.total_num_scheduled_tokens == len(req_ids):  # one token each (steady decoding)
                if async_sched:
                    for request, c in zip(run_reqs, run_after, strict=True):
                        request.num_computed_tokens = c
                        request.num_in_flight_tokens += 1
                        request.is_prefill_chunk = False
                        request.num_output_placeholders += 1
                else:
                    for request, c in zip(run_reqs, run_after, strict=True):
                        request.num_computed_tokens = c
                        request.num_in_flight_tokens += 1
                        request.is_prefill_chunk = False
                if steady and self._steady_streak >= self._cohort_after:
                    # Joining and leaving a cohort cost more than one step's loops above: formed only once the
                    # same requests decoded undisturbed for several steps (not where requests finish and arrive
                    # every few steps).
                    self._cohort = form(run_reqs, async_sched)
                    if self._cohort is not None:
                        self._cohort_fills(self._cohort, run_after)
            elif async_sched:
                for request, c, n in zip(run_reqs, run_after, num_sched, strict=False):
                    request.num_computed_tokens = c
                    request.num_in_flight_tokens += n
                    request.is_prefill_chunk = False
                    request.num_output_placeholders += 1
            else:
                for request, c, n in zip(run_reqs, run_after, num_sched, strict=False):
                    request.num_computed_tokens = c
                    request.num_in_flight_tokens += n
                    request.is_prefill_chunk = False
            if async_sched and (num_spec or clear_drafts):
                for request in run_reqs:
                    request.spec_token_ids = spec_placeholders
        elif async_sched:
            for request, c, n in zip(run_reqs, run_computed, num_sched, strict=False):
                c += n
                request.num_computed_tokens = c
                request.num_in_flight_tokens += n
                if c < len(request._all_token_ids) + request.num_output_placeholders:
                    request.is_prefill_chunk = True
                else:
                    request.is_prefill_chunk = False
                    request.num_output_placeholders += 1
            if num_spec or clear_drafts:
                for req_id, request in zip(run_ids, run_reqs, strict=True):
                    if not request.is_prefill_chunk:
                        request.num_output_placeholders += len(spec_tokens.get(req_id, ()))
                        request.spec_token_ids = spec_placeholders
        else:
            for request, c, n in zip(run_reqs, run_computed, num_sched, strict=False):
                c += n
                request.num_computed_tokens = c
                request.num_in_flight_tokens += n
                request.is_prefill_chunk = c < len(request._all_token_ids)

        # Phase B: requests admitted in this step, new or resumed after a preemption (few per step).
        new_reqs_data: list[NewRequestData] = []
        res_v2_data: list[NewRequestData] = []
        res_ids: list[str] = []
        res_blocks: list[tuple[list[int], ...] | None] = []
        res_computed: list[int] = []
        res_outputs: list[int] = []
        step_reqs = run_reqs
        if num_run < len(req_ids):
            step_reqs = run_reqs.copy()
            new_set = set(new_ids)
            uses_mrope = self.model_uses_mrope
            for i in range(num_run, len(req_ids)):
                req_id = req_ids[i]
                request = requests[req_id]
                step_reqs.append(request)
                n = num_sched[i]
                c = computed[i]
                b0 = int(block_ptr_arr[i])
                b1 = int(block_ptr_arr[i + 1])
                blocks = (
                    (block_ids[b0:b1],)
                    if group_ids is None
                    else tuple(ids[p[i] : p[i + 1]] for ids, p in zip(group_ids, group_ptrs, strict=True))
                )
                if spec_ptr is not None and spec_ptr[i + 1] > spec_ptr[i]:
                    spec_tokens[req_id] = spec_list[spec_ptr[i] : spec_ptr[i + 1]]
                if not drafts_needed and not self._drafts_unused(request, c, n):
                    drafts_needed = True
                request.status = _RUNNING
                request.num_computed_tokens = c
                hit = c
                if self._replay_window:
                    # vLLM's Request.replay_start, sent in NewRequestData; a replay (always of the whole window:
                    # a shorter hit is dropped) started the computed count below the hit.
                    request.replay_start = self._core.get_replay_start(req_id)
                    if c > 0 and request.replay_start == c:
                        hit = c + self._replay_window
                self._on_admitted(request, hit, now)
                if req_id in new_set or v2:
                    data = NewRequestData.from_request(
                        request, blocks, request._all_token_ids if v2 else None, uses_mrope=uses_mrope
                    )
                    # Model runner V2 gets a resumed request as a new one, after the new ones.
                    (new_reqs_data if req_id in new_set else res_v2_data).append(data)
                else:
                    res_ids.append(req_id)
                    res_blocks.append(blocks)
                    res_computed.append(c)
                    res_outputs.append(num_outputs[i])
                    if req_id not in prev:
                        all_token_ids[req_id] = request._all_token_ids.copy()
                if pre_update is not None:
                    pre_update.append(_updated_state(request, c))
                if confirmed is not None and request.mm_features:
                    confirmed[req_id] = c - max(request.num_output_placeholders, request.num_in_flight_tokens)
                # vLLM's _update_after_schedule (and AsyncScheduler's), for this request.
                request.num_computed_tokens = c + n
                request.num_in_flight_tokens += n
                chunk = c + n < len(request._all_token_ids) + request.num_output_placeholders
                request.is_prefill_chunk = chunk
                if not chunk:
                    if request.structured_output_request is not None:
                        has_so = True
                        pending_so = pending_so or (async_sched and request.num_output_placeholders > 0)
                    if async_sched:
                        request.num_output_placeholders += 1 + len(spec_tokens.get(req_id, ()))
                        request.spec_token_ids = spec_placeholders

        if res_v2_data:
            new_reqs_data += res_v2_data
        if res_ids:
            run_ids += res_ids
            run_blocks += res_blocks
            run_computed += res_computed
            run_outputs += res_outputs
        new_token_ids: list[list[int]] = []
        if self.use_pp and not async_sched:
            # Pipeline parallelism without async scheduling: the first stage gets the tokens each running or
            # resumed request computes in this step (less its drafts) from the scheduler, as vLLM sends them.
            sched_of = dict(zip(req_ids, num_sched, strict=True))
            for req_id, c in zip(run_ids, run_computed, strict=True):
                n = sched_of[req_id] - len(spec_tokens.get(req_id, ()))
                new_token_ids.append(requests[req_id]._all_token_ids[c : c + n])
        cached = CachedRequestData(
            req_ids=run_ids,
            resumed_req_ids=set(res_ids),
            new_token_ids=new_token_ids,
            all_token_ids=all_token_ids,
            new_block_ids=run_blocks,
            num_computed_tokens=run_computed,
            num_output_tokens=run_outputs,
        )
        if not v2 and not (prev_covers_run and num_run == len(req_ids) == len(prev)):
            prev.clear()
            prev.update(req_ids)
        encoder_inputs: dict[str, list[int]] = {}
        free_encoder_mm_hashes: list[str] = []
        encoder_stats = None
        if self._mm is not None:
            encoder_inputs = self._scheduled_encoder_inputs(req_ids, out)
            if len(out.free_encoder_hashes):
                free_encoder_mm_hashes = self._mm.freed(out.free_encoder_hashes.tolist())
            if self._encoder_stats and encoder_inputs:
                encoder_stats = self._encoder_input_stats(encoder_inputs)
        elif self._enc_dec:
            encoder_inputs, free_encoder_mm_hashes = self._enc_dec_encoder_inputs(out)
            if self._encoder_stats and encoder_inputs:
                encoder_stats = self._encoder_input_stats(encoder_inputs)
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self._num_scheduled_tokens(req_ids, num_sched, out, same_as_last),
            total_num_scheduled_tokens=out.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=spec_tokens,
            scheduled_encoder_inputs=encoder_inputs,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=free_encoder_mm_hashes,
            preempted_req_ids=preempted,
            has_structured_output_requests=has_so,
            pending_structured_output_tokens=pending_so,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
            **({"skip_drafts": not drafts_needed} if RULES.skip_drafts else {}),
        )
        if self._zeroes_new_blocks:
            # A model with Mamba layers or mixed precisions: vLLM zeroes the attention blocks the step allocated
            # before use.
            zero = out.zero_block_ids
            if len(zero):
                so.new_block_ids_to_zero = zero.tolist()
            copies = out.kv_cache_block_copies
            if len(copies):
                # Prefix hits inside a block: the blocks copied before the forward pass (vLLM's copy-on-write).
                from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

                so.kv_cache_block_copies = [KVCacheBlockCopy(int(s), int(d)) for s, d in copies.tolist()]
        if encoder_stats is not None:
            so.scheduled_encoder_input_stats = encoder_stats
        if confirmed is not None:
            so.encoder_input_updates = self._encoder_input_updates(new_reqs_data, req_ids, encoder_inputs, confirmed)
        if pre_update is not None:
            self._connector_meta_before_update(bridge, so, pre_update, req_ids, out)
        self.finished_req_ids = set()
        self._reset_preempted_req_ids = set()
        if step_reqs and self._core.config.defer_block_free:
            # vLLM's fence of each scheduled request's blocks: the sequence number of the newest step scheduling it.
            seq = self._core.step_seqs[0]
            for request in step_reqs:
                request.last_sched_seq = seq
        self._in_flight.append((so, out, num_sched, step_reqs, num_forgotten, after_arr))
        self._last_req_ids, self._last_reqs, self._last_num_forgotten = req_ids, step_reqs, num_forgotten
        if self._kv_events.enabled:
            self._kv_events.collect(self._core)
        return so

    def _enc_dec_encoder_inputs(self, out: Any) -> tuple[dict[str, list[int]], list[str]]:
        """Encoder-decoder: every encoder input of each request admitted (new or resumed) in this step, in the
        step's order, and the identifiers the previous step encoded (vLLM's EncoderDecoderCacheManager releases
        them one step later)."""
        scheduled: dict[str, list[int]] = {}
        fresh = set(out.new_req_ids) | set(out.resumed_req_ids)
        for req_id in out.req_ids:
            if req_id not in fresh:
                continue
            features = self.requests[req_id].mm_features
            if features:
                scheduled[req_id] = list(range(len(features)))
                self._enc_dec_allocated.extend(f.identifier for f in features)
        freed = self._enc_dec_to_free
        self._enc_dec_to_free, self._enc_dec_allocated = self._enc_dec_allocated, []
        return scheduled, freed

    @property
    def is_encoder_decoder(self) -> bool:
        """vLLM's flag: encoder-decoder scheduling (only set on a built scheduler, as vLLM's tests do)."""
        return self._enc_dec

    @is_encoder_decoder.setter
    def is_encoder_decoder(self, value: bool) -> None:
        value = bool(value)
        if value == self._enc_dec:
            return
        if not value:
            raise UnsupportedFeatureError("kvsched.vllm.Scheduler cannot turn encoder-decoder scheduling off")
        if CROSS_ATTENTION not in self._group_windows:
            raise UnsupportedFeatureError(
                "kvsched.vllm.Scheduler supports encoder-decoder scheduling only with a cross-attention KV cache "
                "group (CrossAttentionSpec)"
            )
        if (
            self._mm is not None
            or self.use_v2_model_runner
            or self.requests
            or self._ec_connector is not None
            or self._aux.connector is not None
        ):
            raise UnsupportedFeatureError(
                "kvsched.vllm.Scheduler does not support encoder-decoder scheduling with an encoder cache, with "
                "model runner V2 (encoder_input_updates), with an encoder-cache or auxiliary output connector, or "
                "once requests were added"
            )
        # The core takes encoder-decoder scheduling at its construction: a new one (it holds no request).
        config = dataclasses.replace(self._core.config, encoder_decoder=True)
        self._core = _CoreScheduler(config, kv_connector=self._bridge)
        self.kv_config = config
        self._kv_view = None
        self._request_attrs = RequestAttrs.for_core(self._core.add_request, read_additional_config(self.vllm_config)[1])
        self._enc_dec = True

    @staticmethod
    def _scheduled_encoder_inputs(req_ids: list[str], out: Any) -> dict[str, list[int]]:
        """vLLM's ``scheduled_encoder_inputs``: per request, the indices (into its ``mm_features``) of the
        encoder inputs the runner computes in this step."""
        values = out.scheduled_encoder_inputs
        if not len(values):
            return {}
        indptr = out.scheduled_encoder_inputs_indptr
        rows = np.flatnonzero(indptr[1:] != indptr[:-1]).tolist()
        values_list: list[int] = values.tolist()
        ptr: list[int] = indptr.tolist()
        return {req_ids[i]: values_list[ptr[i] : ptr[i + 1]] for i in rows}

    def _encoder_input_updates(
        self,
        new_reqs_data: list[NewRequestData],
        req_ids: list[str],
        encoder_inputs: dict[str, list[int]],
        confirmed: dict[str, int],
    ) -> dict[str, dict[int, Any]]:
        """vLLM 0.33's ``encoder_input_updates`` for model runner V2: a request (re)installed on the workers holds
        the data of its inputs (shared-memory handles aside, which vLLM's processor cache acknowledges itself);
        an input scheduled for encoding whose data the workers do not hold gets it; an input wholly inside the
        confirmed progress (not being encoded) is released (``None``)."""
        pending_all = self._pending_encoder_inputs
        for data in new_reqs_data:
            if data.mm_features:
                pending_all[data.req_id] = {
                    i for i, f in enumerate(data.mm_features) if f.data is not None and "address" not in f.data
                }
        updates: dict[str, dict[int, Any]] = {}
        for req_id in req_ids:
            pending = pending_all.get(req_id)
            if pending is None:
                continue
            encoding = encoder_inputs.get(req_id, ())
            if not pending and not encoding:
                continue
            features = self.requests[req_id].mm_features
            for i in encoding:
                data = features[i].data
                if i not in pending and data is not None and "address" not in data:
                    updates.setdefault(req_id, {})[i] = data
                    pending.add(i)
            done = confirmed[req_id]
            for i in list(pending):
                if i in encoding:
                    continue
                pos = features[i].mm_position
                if pos.offset + pos.length <= done:
                    updates.setdefault(req_id, {})[i] = None
                    pending.remove(i)
        return updates

    def _encoder_input_stats(self, encoder_inputs: dict[str, list[int]]) -> Any:
        """vLLM's ``scheduled_encoder_input_stats`` (iteration-details logging)."""
        from vllm.v1.core.sched.output import ScheduledEncoderInputStats

        stats = ScheduledEncoderInputStats()
        for req_id, ids in encoder_inputs.items():
            features = self.requests[req_id].mm_features
            for i in ids:
                stats.num_inputs += 1
                stats.output_tokens += features[i].mm_position.get_num_embeds()
        return stats

    def _num_scheduled_tokens(
        self, req_ids: list[str], num_sched: list[int], out: Any, same_as_last: bool
    ) -> dict[str, int]:
        """The output's ``num_scheduled_tokens`` dict. One token each (steady decoding): a copy of a kept
        template with the same keys in the same order when the step schedules what the previous one did (a
        dict copy costs a small fraction of building one)."""
        if out.total_num_scheduled_tokens != len(req_ids):
            return dict(zip(req_ids, num_sched, strict=True))
        template = self._ones_template
        if template is None or not same_as_last or self._ones_template_ids is not self._last_req_ids:
            template = dict.fromkeys(req_ids, 1)
        self._ones_template, self._ones_template_ids = template, req_ids
        return template.copy()

    def _connector_meta_before_update(
        self,
        bridge: ConnectorBridge | None,
        so: SchedulerOutput,
        pre_update: list[_UpdatedState],
        req_ids: list[str],
        out: Any,
    ) -> None:
        """:meth:`_connector_meta` (KV connector), the auxiliary output and encoder-cache connectors'
        ``build_connector_meta`` with the
        scheduled requests showing their state before this step's update, as vLLM calls its connectors before
        its ``_update_after_schedule``: a connector that keeps the ``Request`` objects (most do) reads the same
        counts from both schedulers. Put back afterwards."""
        post = [_updated_state(r, r.num_computed_tokens) for r, *_ in pre_update]
        for state in pre_update:
            _restore_state(state)
        try:
            if self.ec_connector is not None and self._mm is not None:
                self._ec_admitted(req_ids)
            if bridge is not None:
                self._connector_meta(bridge, so)
            if self._aux.connector is not None:
                so.aux_output_connector_metadata = self._aux.connector.build_connector_meta(so, self.requests)
            if self.ec_connector is not None:
                so.ec_connector_metadata = self.ec_connector.build_connector_meta(so)
        finally:
            for state in post:
                _restore_state(state)

    def _ec_admitted(self, req_ids: list[str]) -> None:
        """For ``update_state_after_free``: the computed tokens (before this step) of each scheduled request with
        images that has none recorded, i.e. since its (re)admission."""
        ec_from = self._ec_from
        requests = self.requests
        for req_id in req_ids:
            if req_id not in ec_from:
                request = requests[req_id]
                if request.mm_features:
                    ec_from[req_id] = request.num_computed_tokens

    def _connector_meta(self, bridge: ConnectorBridge, so: SchedulerOutput) -> None:
        """vLLM's connector part of a step's output: sync-load flag, block state, the connector's metadata."""
        from vllm.v1.core.sched.output import KVConnectorBlockState

        so.has_sync_kv_loads = bridge.has_sync_kv_loads
        req_ids = set(so.num_scheduled_tokens)
        # Align-mode Mamba groups with prefix caching: the boundary states cached since the last step, by request
        # (group by group), with the requests still known that have some.
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for req_id, group, block_id, num_tokens in self._core.take_mamba_boundary_offers():
            offloads.setdefault(req_id, []).append((group, block_id, num_tokens))
        if offloads:
            req_ids.update(req_id for req_id in offloads if req_id in self.requests)
        so.kv_connector_block_state = KVConnectorBlockState(
            req_ids=req_ids,
            resolve_block_ids=self.group_block_ids,
            boundary_state_offloads=offloads,
        )
        so.kv_connector_metadata = self.connector.build_connector_meta(so)
        # Connector-only block state is not sent to the workers.
        so.kv_connector_block_state = None

    @staticmethod
    def _drafts_unused(request: Request, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """vLLM's ``_drafts_unused``: the drafts proposed after this step surely go unused (a partial prefill
        samples nothing; a step that samples the last output token, even with every draft rejected, ends it)."""
        if num_computed_tokens + num_new_tokens < request.num_tokens:
            return True
        min_num_output_tokens = request.num_output_tokens + 1 + (request.num_output_placeholders > 0)
        return bool(min_num_output_tokens >= request.max_tokens)

    def _on_admitted(self, request: Request, num_hit_tokens: int, now: float) -> None:
        """vLLM's bookkeeping when phase B admits a request: prefill stats, prefix-cache stats, SCHEDULED event."""
        if self._resident_sessions and request.request_id in self._resident_sessions:
            # A streaming-input session resumed with its KV: vLLM looks nothing up (no stats, no prefill stats).
            self._resident_sessions.discard(request.request_id)
        elif self._bridge is not None:
            # With a connector the bridge records the stats of every admission that looked the prefix up (the
            # others, a loaded request's, record none, as in vLLM).
            self._bridge._set_stage(request.request_id, None)
        else:
            if request.prefill_stats is not None and request.num_preemptions <= 0:
                request.prefill_stats.set(
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_local_cached_tokens=num_hit_tokens,
                    num_external_cached_tokens=0,
                )
            self._record_prefix_lookup(request, num_hit_tokens)
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED, now)
            self._slow_req_ids.add(request.request_id)

    def _record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        stats = self._prefix_cache_stats
        # vLLM records no prefix-cache query for a request that skips reading the cache (prompt logprobs).
        if stats is not None and self.kv_config.enable_prefix_caching and not request.skip_reading_prefix_cache:
            stats.record(num_tokens=request.num_tokens, num_hits=num_hit_tokens, preempted=request.num_preemptions > 0)

    def _mirror_preempt(
        self, request: Request, now: float, aux_told: bool = False, drop_stale_output: bool = False
    ) -> None:
        """Mirrors a preemption the core made through ``_preempt_request``."""
        self._mirroring_preemption = True
        try:
            if drop_stale_output:
                self._preempt_request(request, now, drop_stale_output=True, aux_told=aux_told)
            else:
                self._preempt_request(request, now, aux_told=aux_told)
        finally:
            self._mirroring_preemption = False

    def _preempt_request(
        self, request: Request, timestamp: float, drop_stale_output: bool = False, *, aux_told: bool = False
    ) -> None:
        """vLLM's ``_preempt_request``. The adapter calls it for each preemption the core made (the core already
        freed the blocks), in the order vLLM preempts, while the request still shows its state before the
        preemption: wrapping it on an instance observes preemptions, as vLLM's tests do. Called by hand on a
        running request (as vLLM's tests call it, after taking the request out of ``running``), the core preempts
        that request now (``preempt_request``: docs/semantics.md, Preemption by hand) and the request object
        follows. The auxiliary output connector hears of it here unless ``aux_told``."""
        if not self._mirroring_preemption:
            req_id = request.request_id
            known: Any = self.requests.get(req_id)
            if known is not request:
                raise KeyError(f"request {req_id!r} is not one of this scheduler's requests")
            if request.status != _RUNNING:
                raise InvalidRequestError(f"request {req_id!r} is not running: only running requests can be preempted")
            if self._aux.connector is not None and not aux_told:
                self._aux.request_finished(request)  # vLLM tells it before the blocks are freed
            self._core.preempt_request(req_id, drop_stale_output=bool(drop_stale_output))
            self._reset_preempted_req_ids.add(req_id)
            aux_told = True
        if self._aux.connector is not None and not aux_told:
            self._aux.request_finished(request)
        self._pending_encoder_inputs.pop(request.request_id, None)
        if self._ec_from:
            # vLLM drops its encoder-cache references without telling the EC connector.
            self._ec_from.pop(request.request_id, None)
            self._ec_freed.pop(request.request_id, None)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        if request.spec_token_ids:
            request.spec_token_ids = []
        request.drop_stale_output = (
            drop_stale_output
            or self._requires_kv_delivery
            or (request.drop_stale_output and request.num_stale_output_tokens > 0)
        )
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        if self._needs_slow_update(request):
            self._slow_req_ids.add(request.request_id)

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        if not scheduler_output.has_structured_output_requests:
            return None
        ids = [
            req_id
            for req_id in scheduler_output.num_scheduled_tokens
            if (r := self.requests.get(req_id)) is not None and r.use_structured_output and not r.is_prefill_chunk
        ]
        if not ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(
            self.requests, ids, scheduler_output.scheduled_spec_decode_tokens
        )
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        # Drafts up to the first -1 (padding) can be accepted.
        return GrammarOutput(ids, bitmask, [len(strip_speculative_padding(spec_tokens.get(r, []))) for r in ids])

    # ---- update -----------------------------------------------------------------------------------------

    def _take_in_flight(self, scheduler_output: SchedulerOutput) -> _InFlight:
        in_flight = self._in_flight
        for i, step in enumerate(in_flight):
            if step[0] is scheduler_output:
                if i and all(not older[0].total_num_scheduled_tokens for older in list(in_flight)[:i]):
                    # The core applies steps in order. Steps that scheduled nothing carry nothing to apply, and
                    # vLLM's scheduler does not need their outputs at all (its engine applies them anyway, in
                    # order): apply them here so a caller may skip them.
                    for _ in range(i):
                        empty = in_flight.popleft()[1]
                        if self._pins is None:
                            self._core.update_from_output(empty, [])
                        else:
                            with self._pins.deferred():
                                self._core.update_from_output(empty, [])
                    i = 0
                del in_flight[i]
                return step
        raise ValueError("update_from_output got a SchedulerOutput this scheduler did not produce, or got it twice")

    def group_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block table of every KV cache group, in vLLM's group order (vLLM's
        ``KVCacheManager.get_block_ids``)."""
        core = self._core
        # A finished request whose blocks are held for a transfer: the tables it holds (vLLM frees them later).
        get = core.get_held_block_ids if req_id in self._held else core.get_block_ids
        if self._num_groups == 1:
            return (get(req_id).tolist(),)
        return tuple(get(req_id, g).tolist() for g in range(self._num_groups))

    def _window_hashed_tokens(self, table: list[int], num_cached_blocks: int, window: int | str | None) -> int:
        """The tokens up to the end of the last block of ``table`` that carries a hash (among its first
        ``num_cached_blocks``); with a sliding window (or chunked-local attention) the null blocks before the
        window carry none, a window of one token caches nothing (but with the trailing-block drop), and sparse
        retention leaves Mamba states and window blocks uncached."""
        bs = self.block_size
        if window is None:
            return min(num_cached_blocks, len(table)) * bs
        if window == 1 and not self.kv_config.drop_trailing_hit_block:
            return 0
        # Sparse retention leaves some of a Mamba table's states and a window's blocks uncached: ask the core which
        # carry a hash.
        sparse = (window == MAMBA or isinstance(window, int)) and (
            self.kv_config.prefix_cache_retention_interval is not None
        )
        for i in range(min(num_cached_blocks, len(table)) - 1, -1, -1):
            if table[i] != 0 and not (sparse and self._core.get_block_hash(table[i]) is None):
                return (i + 1) * bs
        return 0

    def _hashed_tokens(
        self, tables: tuple[list[int], ...], num_cached_blocks: int, key_tokens: dict[int, list[int]] | None = None
    ) -> int:
        """vLLM's ``estimate_cached_tokens``: the fewest tokens any KV cache group's hashed blocks cover.
        ``key_tokens``: the tokens of the hash each block of a group is cached under, for the groups whose keys can
        lie below their entry (``_group_key_tokens``)."""
        if self._mixed_keys:
            # Groups of different block sizes: the fewest tokens any cached group's keys cover (every request whose
            # prefill stats are finalised has its keys read, before and after the update).
            assert key_tokens is not None
            return min((max(key_tokens[g], default=0) for g in key_tokens), default=0)
        limit = None if self._mamba_past_cached else num_cached_blocks
        return min(
            max(key_tokens[g][:limit], default=0)
            if key_tokens is not None and g in key_tokens
            else self._window_hashed_tokens(table, num_cached_blocks, w)
            for g, (table, w) in enumerate(zip(tables, self._group_windows, strict=True))
            # vLLM leaves the groups that are never prefix cached out (cross attention, rings, replayed windows).
            if w != CROSS_ATTENTION and w != RING and g not in self._replay_groups
        )

    def _group_key_tokens(self, req_id: str) -> dict[int, list[int]]:
        """The Mamba groups' tokens of the hash each block of the request is cached under (vLLM's
        ``block_hash_num_tokens``; under the trailing-block drop a prefill checkpoint is keyed by the block below
        its entry until the entry is cached), by group."""
        core = self._core
        return {
            g: core.get_block_hash_num_tokens(req_id, g).tolist()
            for g, w in enumerate(self._group_windows)
            if w == MAMBA
            or (self._partial_keys and w is None)
            or (self._mixed_keys and w not in (CROSS_ATTENTION, RING) and g not in self._replay_groups)
        }

    def _key_tokens_after_update(
        self, req_id: str, before: tuple[dict[int, list[int]], int, dict[int, list[bytes | None]]]
    ) -> dict[int, list[int]]:
        """``_group_key_tokens`` after an update that cached the request's blocks: read from the core, or, when the
        update freed the request, from those read before it (``before``, with the cached blocks then): a block
        cached by the update is keyed at its entry if it still carries a hash (a prefill checkpoint keyed before
        it keeps its key when its hash is the one it had then, else it was re-keyed at its entry)."""
        if self._core.has_request(req_id):
            try:
                return self._group_key_tokens(req_id)
            except UnknownRequestError:
                pass  # finished, its blocks held for a KV connector's send: read from its tables below
        counts, num_cached, hashes = before
        tables = self._window_tables[req_id]
        get_hash = self._core.get_block_hash

        sizes = self.kv_config.kv_cache_group_block_sizes

        def key_tokens(g: int, i: int, c: int, b: int) -> int:
            h = get_hash(b) if b else None
            if sizes is not None:
                # (each group's blocks at its own size; the primary group's cached count says nothing of theirs)
                return 0 if h is None else c if h == hashes[g][i] else (i + 1) * sizes[g]
            if i < num_cached or (h is not None and h == hashes[g][i]):
                return c
            return 0 if h is None else (i + 1) * self.block_size

        return {
            g: [key_tokens(g, i, c, b) for i, (c, b) in enumerate(zip(row, tables[g], strict=True))]
            for g, row in counts.items()
        }

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        _, out, num_sched, step_reqs, num_forgotten, after = self._take_in_flight(scheduler_output)
        mro = model_runner_output
        kvo = mro.kv_connector_output if self._bridge is not None else None
        kv_failed: set[str] = set()
        # Running requests rolled back by invalid blocks (vLLM's synchronous loads): their output of this step is
        # dropped.
        kv_skip: set[str] = set()
        if kvo is not None and (kvo.failed_recving or kvo.invalid_block_ids):
            kv_failed, kv_skip = self._apply_kv_load_failures(kvo, scheduler_output.num_scheduled_tokens)
        elif self._bridge is None and mro.kv_connector_output is not None and mro.kv_connector_output.invalid_block_ids:
            # No KV connector: vLLM still rolls back the running requests holding invalid blocks (policy recompute).
            _, kv_skip = self._apply_kv_load_failures(mro.kv_connector_output, scheduler_output.num_scheduled_tokens)
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        req_ids: list[str] = out.req_ids
        rows: list[list[int]]
        if not sampled:
            rows = [[] for _ in req_ids]
        elif mro.req_ids == req_ids:
            rows = sampled  # the runner kept the scheduled order
        else:
            rows = [sampled[index[r]] for r in req_ids]
        # vLLM finalises a request's prefill stats at its first output with the tokens its cached blocks cover,
        # read before a stop frees them: read them now, for the requests that have not emitted yet.
        cached_tokens: dict[str, int] = {}
        self._window_tables.clear()
        self._key_tokens.clear()
        if self._awaiting_first_output and self.kv_config.enable_prefix_caching:
            in_batch = scheduler_output.num_scheduled_tokens
            for req_id in self._awaiting_first_output:
                if req_id in in_batch:
                    num_cached_blocks = self._core.get_num_cached_blocks(req_id)
                    if self._group_windows == (None,):
                        cached_tokens[req_id] = num_cached_blocks * self.block_size
                    else:
                        tables = self.group_block_ids(req_id)
                        self._window_tables[req_id] = tables
                        key_tokens = None
                        if self._checkpoints_keyed_below or self._mamba_past_cached or self._mixed_keys:
                            key_tokens = self._group_key_tokens(req_id)
                            get_hash = self._core.get_block_hash
                            hashes = {g: [get_hash(b) if b else None for b in tables[g]] for g in key_tokens}
                            self._key_tokens[req_id] = (key_tokens, num_cached_blocks, hashes)
                        cached_tokens[req_id] = self._hashed_tokens(tables, num_cached_blocks, key_tokens)
        if self._pins is None:
            res = self._core.update_from_output(out, rows)
        else:
            with self._pins.deferred():
                res = self._core.update_from_output(out, rows)
        finished_ids = res.finished_req_ids
        part_ids = res.part_finished_req_ids if self._parts else ()
        spec_sched = scheduler_output.scheduled_spec_decode_tokens
        batch_slow = bool(mro.logprobs or mro.prompt_logprobs_dict)
        nans = mro.num_nans_in_logits
        if (
            not finished_ids
            and not kv_skip
            and not part_ids
            and not spec_sched
            and not nans
            and not batch_slow
            and not self._held
            and not self._ec_from  # requests with images under an EC connector: _update_slow tells it of frees
            and self._aux.connector is None  # every output carries its routed experts
            and num_forgotten == self._num_forgotten  # no entry finished since the step was scheduled
            and (not self._slow_req_ids or self._slow_req_ids.isdisjoint(req_ids))
        ):
            outputs = self._update_plain(out, step_reqs, num_sched, rows, res, after)
        else:
            self._steady_streak = 0
            if self._cohort is not None:
                dissolve(self._cohort)  # the entries' counters are written one by one
                self._cohort = None
            outputs = self._update_entries(
                scheduler_output, mro, out, num_sched, rows, res, finished_ids, part_ids, cached_tokens, kv_skip
            )
        if self._bridge is not None:
            self._release_finished()
        ec = self.ec_connector
        if ec is not None:
            if self._ec_from:
                self._ec_forget_finished(step_reqs)
            # Encoder inputs the connector can no longer obtain: vLLM fails those requests.
            ec_failed = ec.take_unavailable_requests()
            if ec_failed:
                kv_failed = kv_failed | {r for r in ec_failed if r in self.requests}
        if self._grammar_errors or kv_failed:
            errors, self._grammar_errors = self._grammar_errors, {}
            # vLLM finishes grammar errors, (policy "fail") failed KV loads and unavailable encoder inputs
            # together.
            error_ids = set(errors)
            error_ids.update(kv_failed)
            for request in self.finish_requests(error_ids, RequestStatus.FINISHED_ERROR):
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.get_finished_reason(),
                        events=request.take_events(),
                        trace_headers=request.trace_headers,
                        **({"error": errors.get(request.request_id)} if RULES.output_error else {}),
                    )
                )

        kv_connector_stats = None
        if self._bridge is not None:
            kv_connector_stats = self._update_connector(kvo)
        ec_connector_stats = None
        if ec is not None:
            ec_out = getattr(mro, "ec_connector_output", None)
            if ec_out:
                ec.update_connector_output(ec_out)
            ec_connector_stats = ec_out.ec_connector_stats if ec_out else None
            own = ec.get_ec_connector_stats()
            if own is not None and not own.is_empty():
                ec_connector_stats = own if ec_connector_stats is None else ec_connector_stats.aggregate(own)
        self._ec_params.clear()
        self._kv_events.publish(self.kv_event_publisher, self._core, self.connector)
        engine_core_outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        finished_sets = self.finished_req_ids_dict
        if finished_sets:
            for client, finished_set in finished_sets.items():
                if (eco := engine_core_outputs.get(client)) is not None:
                    eco.finished_requests = finished_set
                else:
                    engine_core_outputs[client] = EngineCoreOutputs(finished_requests=finished_set)
            finished_sets.clear()
        stats = self.make_stats(
            self._spec_stats if spec_sched else None, kv_connector_stats, ec_connector_stats=ec_connector_stats
        )
        if stats is not None:
            if (eco := next(iter(engine_core_outputs.values()), None)) is None:
                engine_core_outputs[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return engine_core_outputs

    def _update_plain(
        self,
        out: Any,
        reqs: list[Request],
        num_sched: list[int],
        rows: list[list[int]],
        res: Any,
        after: npt.NDArray[np.int32] | None,
    ) -> dict[int, list[EngineCoreOutput]]:
        """``update_from_output`` for a step whose every entry is plain: still live, no stop, no drafts, nothing
        else to report (no events, prefill stats, stale output, structured output, logprobs, NaNs, transfers, and
        all for client 0). Each entry takes its tokens (none for a partial prefill); the outputs are built at
        once."""
        async_sched = self.async_scheduling
        drafts = self.num_spec_tokens or self._drafts_received
        # The entries are exactly a steady cohort's members (the same list), one token scheduled and one taken
        # each: the cohort applies the step to all of them (_cohort.py); any other step dissolves it first.
        cohort = self._cohort
        use_cohort = (
            cohort is not None
            and cohort.intact
            and reqs is cohort.reqs
            and not drafts
            and out.total_num_scheduled_tokens == len(reqs)
            and cohort.can_apply()
            and res.num_new_tokens.tobytes() == cohort.ones
        )
        every = use_cohort or all(rows)  # every entry took tokens (none is a prefill chunk)
        if cohort is not None and not use_cohort:
            dissolve(cohort)
            self._cohort = None
        if drafts:
            # Drafts rejected in an earlier step move where this step's token lands: find the requests whose
            # appended token filled a block from their token lists.
            block, hash_la = self.hash_block_size, self._hash_lookahead
            filled_reqs: list[Request] = []
            for request, n, generated in zip(reqs, num_sched, rows, strict=True):
                request.num_in_flight_tokens -= n
                if generated:
                    request._output_token_ids.extend(generated)
                    all_tokens = request._all_token_ids
                    all_tokens.extend(generated)
                    if (len(all_tokens) - hash_la) % block < len(generated):
                        filled_reqs.append(request)
                    if async_sched:
                        if request.num_output_placeholders > 0:
                            request.num_output_placeholders -= len(generated)
                    elif request.num_in_flight_tokens > 0:
                        self._mark_tokens_ahead(request.request_id)
            if filled_reqs:
                self._hash_filled_blocks(filled_reqs)
        else:
            if every and out.total_num_scheduled_tokens == len(reqs):
                # Steady decoding: one token scheduled and one sampled per entry.
                if use_cohort:
                    # The entries are the cohort's members: one in-flight token (and placeholder) fewer each.
                    assert cohort is not None
                    cohort.updated += 1
                    cohort.append_rows(rows)
                elif async_sched:
                    for request, generated in zip(reqs, rows, strict=True):
                        request.num_in_flight_tokens -= 1
                        request._output_token_ids.extend(generated)
                        request._all_token_ids.extend(generated)
                        if request.num_output_placeholders > 0:
                            request.num_output_placeholders -= 1
                else:
                    for request, generated in zip(reqs, rows, strict=True):
                        request.num_in_flight_tokens -= 1
                        request._output_token_ids.extend(generated)
                        request._all_token_ids.extend(generated)
            elif async_sched:
                for request, n, generated in zip(reqs, num_sched, rows, strict=True):
                    request.num_in_flight_tokens -= n
                    if generated:
                        request._output_token_ids.extend(generated)
                        request._all_token_ids.extend(generated)
                        if request.num_output_placeholders > 0:
                            request.num_output_placeholders -= len(generated)
            else:
                for request, n, generated in zip(reqs, num_sched, rows, strict=True):
                    request.num_in_flight_tokens -= n
                    if generated:
                        request._output_token_ids.extend(generated)
                        request._all_token_ids.extend(generated)
            num_new = res.num_new_tokens
            block = self.hash_block_size
            if use_cohort:
                # The members that filled a block at this step, from the cohort's table (one token each).
                assert cohort is not None
                self._hash_cohort_fills(cohort, out)
            elif not out.one_token_each or (len(num_new) and int(num_new.max()) > 1):
                # A step with prefill chunks (a runner may return tokens for one, which vLLM's scheduler appends),
                # or a runner that returned several tokens for an entry (taken too): the requests whose appended
                # tokens filled a block, from their token lists.
                la = self._hash_lookahead
                took = [(r, k) for r, k in zip(reqs, num_new.tolist(), strict=True) if k]
                filled_reqs = [r for r, k in took if (len(r._all_token_ids) - la) % block < k]
                if filled_reqs:
                    self._hash_filled_blocks(filled_reqs)
                if not async_sched and self._in_flight:
                    # A prefill chunk that took tokens while a later step of its request is in flight.
                    for r, _ in took:
                        if r.num_in_flight_tokens > 0:
                            self._mark_tokens_ahead(r.request_id)
            else:
                # Plain decodes that took one token each took the token right after the positions the step
                # computed (its earlier steps were all applied, in order): the request now holds `after` + 1
                # tokens. Those whose count reached a block boundary filled a block, to be hashed.
                if after is None:
                    after = out.num_computed_tokens + out.num_scheduled_tokens
                if block & (block - 1):
                    last = (after - self._hash_lookahead) % block == block - 1
                else:  # a power of two: the same test, cheaper
                    last = (after - self._hash_lookahead) & (block - 1) == block - 1
                filled = np.flatnonzero(last if every else last & (num_new > 0))
                if len(filled):
                    self._hash_filled_blocks([reqs[i] for i in filled.tolist()])
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        req_ids: list[str] = out.req_ids
        if every:
            if rows:
                outputs[0] = list(map(EngineCoreOutput, req_ids, rows))
        elif any(rows):
            outputs[0] = [EngineCoreOutput(r, g) for r, g in zip(req_ids, rows, strict=True) if g]
        return outputs

    def _update_entries(
        self,
        scheduler_output: SchedulerOutput,
        mro: ModelRunnerOutput,
        out: Any,
        num_sched: list[int],
        rows: list[list[int]],
        res: Any,
        finished_ids: list[str],
        part_ids: list[str] | tuple[()],
        cached_tokens: dict[str, int],
        kv_skip: set[str],
    ) -> dict[int, list[EngineCoreOutput]]:
        """``update_from_output`` entry by entry: the plain ones in bulk, the others through ``_update_slow``;
        the entries of ``kv_skip`` (rolled back by invalid blocks) only release their in-flight tokens."""
        req_ids: list[str] = out.req_ids
        requests = self.requests
        accepted: list[int] = res.num_new_tokens.tolist()
        # Stops: (finish reason, stop reason, whether only a streaming-input part ended).
        finished: dict[str, tuple[int, int, bool]] = {}
        if finished_ids:
            for req_id, reason, stop_reason in zip(
                finished_ids, res.finish_reasons.tolist(), res.stop_reasons.tolist(), strict=True
            ):
                finished[req_id] = (reason, stop_reason, False)
        if part_ids:
            for req_id, reason, stop_reason in zip(
                part_ids, res.part_finish_reasons.tolist(), res.part_stop_reasons.tolist(), strict=True
            ):
                finished[req_id] = (reason, stop_reason, True)
        # Per-entry work that the common decode entry never needs goes through _update_slow.
        spec_sched = scheduler_output.scheduled_spec_decode_tokens
        if spec_sched:
            self._spec_stats = None
            self._num_invalid_spec_tokens = scheduler_output.num_invalid_spec_tokens
        batch_slow = bool(mro.logprobs or mro.prompt_logprobs_dict)
        nans = mro.num_nans_in_logits
        slow = self._slow_req_ids
        if finished or spec_sched or nans:
            slow = slow.union(finished, spec_sched, nans or ())
        if self._held:
            slow = slow.union(self._held)  # finished, blocks held for a transfer: vLLM still counts in-flight tokens
        if self._ec_from:
            slow = slow.union(self._ec_from)  # the EC connector hears of consumed images before a stop
        if self._aux.connector is not None:
            slow = slow.union(req_ids)  # every output carries its routed experts
        hasher_block, hash_la = self.hash_block_size, self._hash_lookahead
        stopped_reqs: list[Request] = []
        async_sched = self.async_scheduling
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        # Requests whose appended tokens filled a block: they get its hash after the loop.
        filled: list[Request] = []
        reqs: list[Request | None] = list(map(requests.get, req_ids))

        # vLLM's outputs dict gets a client's key when that client's first output is produced: client 0's list
        # is created at that moment too (its plain entries are built in bulk, but its place in the dict is
        # kept), so the scheduler stats later go to the same (first) entry as vLLM's.
        client0: list[EngineCoreOutput] | None = None
        # A plain entry: tokens appended, no stop, nothing else to report; its output is built in bulk below.
        plain_ids: list[str] = []
        plain_toks: list[list[int]] = []
        # The common step: every entry is a plain one (or a prefill chunk), all for client 0.
        all_plain = not batch_slow and not kv_skip and all(reqs) and slow.isdisjoint(req_ids)
        for req_id, entry, n, generated, num_accepted in zip(req_ids, reqs, num_sched, rows, accepted, strict=True):
            if entry is None:
                continue  # finished (aborted) while the step was in flight
            request = entry
            request.num_in_flight_tokens -= n
            if kv_skip and req_id in kv_skip:
                if request.num_stale_output_tokens > 0:
                    request.num_stale_output_tokens -= n
                continue
            if not all_plain and (batch_slow or req_id in slow):
                eco = self._update_slow(
                    request,
                    n,
                    spec_sched.get(req_id),
                    generated,
                    num_accepted,
                    finished,
                    cached_tokens,
                    mro,
                    stopped_reqs,
                )
                # It stays slow while something outlives the step (e.g. a NaN count its outputs repeat).
                if generated and not async_sched and request.num_in_flight_tokens > 0:
                    self._mark_tokens_ahead(req_id)
                if (
                    self._needs_slow_update(request)
                    or (req_id in self._kv_offset and request.num_output_placeholders > 0)
                    or (req_id in self._tokens_ahead and request.num_in_flight_tokens > 0)
                ):
                    self._slow_req_ids.add(req_id)
                else:
                    self._slow_req_ids.discard(req_id)
                    self._kv_offset.discard(req_id)
                    self._tokens_ahead.discard(req_id)
                if eco is not None:
                    if request.client_index:
                        outputs[request.client_index].append(eco)
                    else:
                        if client0 is None:
                            client0 = outputs[0]
                        if plain_ids:
                            client0 += map(EngineCoreOutput, plain_ids, plain_toks)
                            plain_ids.clear()
                            plain_toks.clear()
                        client0.append(eco)
                continue
            if not generated:
                continue  # a prefill chunk: nothing sampled, nothing emitted
            request._output_token_ids.extend(generated)
            all_tokens = request._all_token_ids
            all_tokens.extend(generated)
            if (len(all_tokens) - hash_la) % hasher_block < len(generated):
                filled.append(request)
            if async_sched:
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= len(generated)
            elif request.num_in_flight_tokens > 0:
                self._mark_tokens_ahead(req_id)
            if all_plain:
                continue  # the step's outputs are built from req_ids and rows at once below
            if client0 is None:
                client0 = outputs[0]
            plain_ids.append(req_id)
            plain_toks.append(generated)
        if all_plain:
            if all(rows):
                if rows:
                    outputs[0] = list(map(EngineCoreOutput, req_ids, rows))
            elif any(rows):
                outputs[0] = [EngineCoreOutput(r, g) for r, g in zip(req_ids, rows, strict=True) if g]
        elif plain_ids:
            assert client0 is not None
            client0 += map(EngineCoreOutput, plain_ids, plain_toks)
        if filled:
            self._hash_filled_blocks(filled)
        if self._kv_events.enabled:
            self._kv_events.collect(self._core)  # with the blocks' vLLM hashes, before stopped requests go
        for request in stopped_reqs:
            self._forget(request)
        return outputs

    def _mark_tokens_ahead(self, req_id: str) -> None:
        """The request took tokens while a later step of it is in flight (synchronous scheduling): its entries
        go through ``_update_slow`` until none is (see ``_tokens_ahead``)."""
        self._tokens_ahead.add(req_id)
        self._slow_req_ids.add(req_id)

    def _hash_filled_blocks(self, filled: list[Request]) -> None:
        """Appends the hashes of the blocks the last tokens filled (a request's hashes always cover its full
        blocks). vLLM's default SHA-256 hash of a block without extra keys (no LoRA, no multimodal input reaching
        it; prompt embeddings are refused; a cache salt only keys block 0) comes from the core, every other one
        from the request's own (vLLM's) hasher."""
        block = self.hash_block_size
        in_core_by_hasher = self._hasher_in_core
        from_core: list[Request] | None = [] if self._core_keys_vllm else None
        for request in filled:
            hasher = request._block_hasher
            if hasher is None:
                continue
            hashes = request.block_hashes
            in_core = in_core_by_hasher.get(hasher)
            if in_core is None:
                in_core = in_core_by_hasher[hasher] = _is_vllm_sha256_hasher(hasher, block)
            if in_core and hashes and request.lora_request is None and not self._mm_in_tail(request, len(hashes)):
                if from_core is not None and request.cache_salt is None and not request.mm_features:
                    from_core.append(request)
                else:
                    hashes += vllm_sha256_block_hashes(hashes[-1], request._all_token_ids[len(hashes) * block :], block)
            else:
                hashes.extend(hasher(request))
        if from_core:
            self._hashes_from_core(from_core, [r.request_id for r in from_core])

    def _hashes_from_core(self, reqs: list[Request], req_ids: list[str]) -> None:
        """Appends to the requests' block hashes the core's hashes of their blocks past them: vLLM's own hashes,
        for requests without extra keys (no LoRA, cache salt or multimodal input) with vLLM's default SHA-256
        hasher and at least one hash. The core checks that each request's last hash is its own at that position;
        a request where it is not (or with nothing new) computes its hashes itself."""
        skipped = self._core._extend_block_hashes([r.block_hashes for r in reqs], req_ids)
        block = self.hash_block_size
        for i in skipped:
            request = reqs[i]
            hashes = request.block_hashes
            hashes += vllm_sha256_block_hashes(hashes[-1], request._all_token_ids[len(hashes) * block :], block)

    def _cohort_fills(self, cohort: Cohort, after: list[int]) -> None:
        """Which members fill a block at which step, for a cohort formed at a step whose computed counts after it
        are ``after`` (member order). While the cohort holds, every member takes one token per step, so a step
        whose first member's computed count after it is ``fill_base + k`` takes every member ``k`` tokens past
        that step: member ``i`` then holds ``after[i] + k + 1`` tokens and fills a block when that count less the
        hash lookahead is a multiple of the hash block size. ``fill_fast[k % block]`` lists the members whose
        blocks the core hashes (vLLM's default SHA-256 without extra keys: no LoRA, no multimodal input; where
        the core keys its blocks with vLLM's hash, also no cache salt, and their hashes are read from the core);
        ``fill_other[k % block]`` the rest with a block hasher (``_hash_filled_blocks``)."""
        block, la = self.hash_block_size, self._hash_lookahead
        fast: list[list[Request]] = [[] for _ in range(block)]
        other: list[list[Request]] = [[] for _ in range(block)]
        in_core_by_hasher = self._hasher_in_core
        core_keys = self._core_keys_vllm
        for request, a in zip(cohort.reqs, after, strict=True):
            hasher = request._block_hasher
            if hasher is None:
                continue
            in_core = in_core_by_hasher.get(hasher)
            if in_core is None:
                in_core = in_core_by_hasher[hasher] = _is_vllm_sha256_hasher(hasher, block)
            k = (block - 1 + la - a) % block
            if in_core and request.lora_request is None and not request.mm_features:
                if core_keys and request.cache_salt is not None:
                    other[k].append(request)
                else:
                    fast[k].append(request)
            else:
                other[k].append(request)
        cohort.fill_base = after[0] if after else 0
        cohort.fill_fast, cohort.fill_other = fast, other
        if core_keys:
            cohort.fill_fast_tokens = [[r.request_id for r in reqs] for reqs in fast]
        else:
            cohort.fill_fast_tokens = [[r._all_token_ids for r in reqs] for reqs in fast]

    def _hash_cohort_fills(self, cohort: Cohort, out: Any) -> None:
        """Appends the hashes of the blocks the cohort's members filled at this step (see ``_cohort_fills``)."""
        block = self.hash_block_size
        k = (int(out.num_computed_tokens[0]) + 1 - cohort.fill_base) % block
        fast = cohort.fill_fast[k]
        if fast:
            if self._core_keys_vllm:
                # One core call reads every member's new block hash (the core keyed the block with it).
                for i in self._core._extend_block_hashes([r.block_hashes for r in fast], cohort.fill_fast_tokens[k]):
                    request = fast[i]
                    request.block_hashes.extend(request._block_hasher(request))
            else:
                # One core call hashes every member's new block; a member without a first hash yet takes its own.
                hash_lists = [r.block_hashes for r in fast]
                for i in vllm_sha256_extend_block_hashes(hash_lists, cohort.fill_fast_tokens[k], block):
                    request = fast[i]
                    request.block_hashes.extend(request._block_hasher(request))
        other = cohort.fill_other[k]
        if other:
            self._hash_filled_blocks(other)

    def _mm_in_tail(self, request: Request, num_hashed_blocks: int) -> bool:
        """Whether a multimodal input reaches past the request's hashed blocks (its blocks have extra keys)."""
        features = request.mm_features
        if not features:
            return False
        last = features[-1].mm_position
        return bool(last.offset + last.length > num_hashed_blocks * self.hash_block_size)

    def _apply_kv_load_failures(self, kvo: Any, num_scheduled: dict[str, int]) -> tuple[set[str], set[str]]:
        """vLLM's ``_handle_failed_recving`` / ``_handle_invalid_blocks``: loads in progress and running requests
        (synchronous loads, and any running request holding an invalid block among its computed ones). The core
        cuts the computed counts (``update_kv_transfers``, policy "recompute" in the core). Returns the requests
        to finish with an error after this update's outputs (policy "fail"; vLLM's set order) and the running
        requests whose output of this step is dropped."""
        bridge = self._bridge
        waiting: list[str] = []
        if bridge is not None:
            # In vLLM's queue order: the requests invalid blocks cut go into a set in that order, and the set's
            # iteration order (that of their error outputs) can depend on it.
            waiting = bridge.loads_in_queue_order(self.requests, self._priority_policy)
        failed = [r for r in kvo.failed_recving or () if r in waiting]
        num_blocks = self.kv_config.num_blocks
        invalid = {b for b in kvo.invalid_block_ids or () if 0 < b < num_blocks}
        affected: set[str] = set()
        skip: set[str] = set()
        evict: set[int] = set()
        if invalid and self._num_groups == 1:  # with several groups the core refuses them (as vLLM does)
            skip = self._sync_load_failures(invalid, num_scheduled, evict)
        if self._kv_failure_fails:
            # Policy "fail": vLLM finishes them after this update's outputs; invalid blocks still cut the computed
            # tokens first (the blocks handed to the connector at the finish), a failed load changes nothing.
            # The sets are built in vLLM's order of operations: it finishes them in a set's iteration order,
            # which for colliding string hashes depends on the order of insertion.
            affected.update(set(failed))
            failed = []
            if invalid:
                bs = self.block_size
                cut: set[str] = set()
                for req_id in waiting:
                    # (vLLM counts the blocks of the computed tokens less the request's tokens in this step.)
                    done = self.requests[req_id].num_computed_tokens - num_scheduled.get(req_id, 0)
                    n = max(0, -(-done // bs))
                    if not invalid.isdisjoint(self._core.get_block_ids(req_id)[:n].tolist()):
                        cut.add(req_id)
                affected.update(cut | skip)  # vLLM: async | sync
        if failed or invalid:
            self._core.update_kv_transfers(failed_recving=failed, invalid_block_ids=sorted(invalid))
            for req_id in itertools.chain(waiting, skip):
                self.requests[req_id].num_computed_tokens = self._core.get_num_computed_tokens(req_id)
            for req_id in skip:
                if req_id in self._ec_from:
                    self._ec_rolled_back(self.requests[req_id])
                if self.requests[req_id].num_output_placeholders > 0:
                    self._kv_offset.add(req_id)
                    self._slow_req_ids.add(req_id)
        if evict:
            # Policy "fail" only: the invalid blocks and those after them leave the prefix cache.
            self._core.evict_cached_blocks(list(evict))
        return affected, skip

    def _sync_load_failures(self, invalid: set[int], num_scheduled: dict[str, int], evict: set[int]) -> set[str]:
        """The running requests invalid blocks roll back (vLLM's ``_update_requests_with_invalid_blocks`` over its
        running requests: the core applies the same rule); with policy "fail", the blocks to evict into
        ``evict``."""
        core = self._core
        bs = self.block_size
        tables = {r: core.get_block_ids(r).tolist() for r in core.running_req_ids()}
        rows = ((r, t, core.get_num_computed_tokens(r) - num_scheduled.get(r, 0)) for r, t in tables.items())
        skip: set[str] = set()
        for req_id, idx in claim_invalid_blocks(rows, invalid, bs):
            if idx is not None and self._kv_failure_fails:
                evict.update(tables[req_id][idx:])
            skip.add(req_id)
        return skip

    def _update_connector(self, kvo: Any) -> Any:
        """vLLM's ``_update_from_kv_xfer_finished``, connector stats and events, at the end of an update."""
        bridge = self._bridge
        assert bridge is not None
        connector = self.connector
        recving: list[str] = []
        sending: list[str] = []
        if kvo is not None:
            connector.update_connector_output(kvo)
            held = self._held
            for req_id in kvo.finished_recving or ():
                if req_id in bridge.loading:
                    recving.append(req_id)
                    bridge.load_reported(req_id)
                elif (h := held.pop(req_id, None)) is not None:
                    # Finished while loading: vLLM frees its blocks at the first transfer reported over.
                    self._report_held(req_id, h, recving, sending)
            for req_id in kvo.finished_sending or ():
                if (h := held.pop(req_id, None)) is not None:
                    self._report_held(req_id, h, recving, sending)
            if recving or sending:
                self._core.update_kv_transfers(finished_recving=recving, finished_sending=sending)
        stats = kvo.kv_connector_stats if kvo is not None else None
        own = connector.get_kv_connector_stats()
        if own is not None and not own.is_empty():
            stats = stats.aggregate(own) if stats is not None else own
        return stats

    def _report_held(self, req_id: str, h: list[bool], recving: list[str], sending: list[str]) -> None:
        if h[0]:
            recving.append(req_id)
        if h[1]:
            sending.append(req_id)
        request = self.requests.pop(req_id, None)
        if request is not None:
            self._slow_req_ids.discard(req_id)

    def _update_slow(
        self,
        request: Request,
        num_scheduled: int,
        spec: list[int] | None,
        generated: list[int],
        num_accepted: int,
        finished: dict[str, tuple[int, int, bool]],
        cached_tokens: dict[str, int],
        mro: ModelRunnerOutput,
        stopped_reqs: list[Request],
    ) -> EngineCoreOutput | None:
        """One entry of ``update_from_output`` with everything vLLM's loop body does (the fast path covers the
        plain decode entry). ``num_in_flight_tokens`` is already decremented."""
        req_id = request.request_id
        stale = False
        if request.num_stale_output_tokens > 0:
            stale = True
            request.num_stale_output_tokens -= num_scheduled
        if request.is_finished():
            return None
        if stale and request.drop_stale_output:
            return None
        if spec and generated:
            num_draft_tokens = len(spec)
            num_accepted_drafts = max(len(generated) - 1, 0)
            num_rejected = num_draft_tokens - num_accepted_drafts
            if not stale:
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= num_rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= num_rejected
            # vLLM's SpecDecodingStats and per-request records count the drafts the grammar did not invalidate.
            invalid = self._num_invalid_spec_tokens
            num_valid = num_draft_tokens - (invalid.get(req_id, 0) if invalid else 0)
            if self.log_stats:
                if self._spec_stats is None:
                    self._spec_stats = SpecDecodingStats.new(self.num_spec_tokens)
                self._spec_stats.observe_draft(num_draft_tokens=num_valid, num_accepted_tokens=num_accepted_drafts)
            if request.spec_decode_metrics is not None:
                request.spec_decode_metrics.observe(
                    num_draft_tokens=num_valid,
                    num_accepted=num_accepted_drafts,
                    detailed=self.spec_decode_metrics_level == "detailed",
                )
        if self._ec_from and req_id in self._ec_from:
            self._ec_free_one(request)
        new_token_ids = generated
        stopped = False
        # vLLM caches the blocks this step completed right after the tokens are appended (then reads a first
        # output's cached tokens): with placeholders or spec decoding, for a running, non-stale entry.
        caches_now = (
            not stale
            and request.status == _RUNNING
            and (request.num_output_placeholders > 0 or (self.num_spec_tokens > 0 and RULES.cache_drafts_at_update))
        )
        if generated:
            num_generated = len(generated)
            if num_accepted < num_generated:
                del generated[num_accepted:]  # vLLM trims the runner's list in place
            request.append_output_token_ids(new_token_ids)
            stop = finished.get(req_id)
            if stop is not None:
                stopped = True
                if not stale and RULES.trim_computed_on_stop:
                    request.num_computed_tokens -= num_generated - num_accepted
                request.status = _FINISHED_STATUS[stop[0]]
                if stop[1] >= 0:
                    request.stop_reason = stop[1]
            if not stale and request.num_output_placeholders > 0:
                # vLLM 0.32 resolves placeholders only for the tokens a stop kept.
                request.num_output_placeholders -= num_generated if RULES.trim_computed_on_stop else num_accepted
        if (
            new_token_ids
            and request.structured_output_request is not None
            and not self.structured_output_manager.accept_tokens(request, new_token_ids)
        ):
            # The grammar refused tokens it masked itself: vLLM ends the request with an error.
            request.status = RequestStatus.FINISHED_ERROR
            request.resumable = False  # vLLM: the error ends a streaming-input session too
            if not stopped or finished[req_id][2]:
                self._core.abort_requests([req_id])
            stopped = True
        if not (new_token_ids or stopped):
            return None
        aux = self._aux.connector
        routed_experts = None
        if aux is not None:
            routed_experts = aux.take_output(request, getattr(mro, "aux_output_connector_output", None))
        prefill_stats = request.take_prefill_stats()
        if prefill_stats is not None:
            self._awaiting_first_output.discard(req_id)
            num_cached = cached_tokens.get(req_id, 0)
            if caches_now and self.kv_config.enable_prefix_caching:
                # The blocks the core just cached (it may have freed the request since): full, hashed blocks up
                # to the tokens computed by the applied steps.
                upto = request.num_computed_tokens - request.num_in_flight_tokens - self._reprefillable
                # (in the core's blocks: the first group's, smaller than vLLM's scheduler block when the groups'
                # block sizes differ)
                num_blocks = min(upto, len(request.block_hashes) * self.hash_block_size) // self.kv_config.kv_block_size
                if self._group_windows == (None,):
                    num_cached = max(num_cached, num_blocks * self.block_size)
                else:
                    tables = self._window_tables.get(req_id) or ([],) * self._num_groups
                    before = self._key_tokens.get(req_id)
                    key_tokens = None if before is None else self._key_tokens_after_update(req_id, before)
                    num_cached = max(num_cached, self._hashed_tokens(tables, num_blocks, key_tokens))
            prefill_stats.finalize(num_cached)
        new_logprobs = None
        if mro.logprobs and request.sampling_params.num_logprobs is not None:
            new_logprobs = mro.logprobs.slice_request(mro.req_id_to_index[req_id], len(new_token_ids))
        finish_reason = None
        kv_transfer_params = None
        if stopped:
            finish_reason = request.get_finished_reason()
            stop = finished.get(req_id)
            if stop is None or req_id not in self._parts or request.status == RequestStatus.FINISHED_ERROR:
                stopped_reqs.append(request)
            elif self._stop_part(request):
                assert not stop[2], "the core ended the input of a streaming session whose mirror has more parts"
                stopped_reqs.append(request)
            else:
                assert stop[2], "the core finished a streaming session whose mirror has more parts"
            if aux is not None and stopped_reqs and stopped_reqs[-1] is request:
                self._aux.request_finished(request)
            if self._bridge is not None and req_id in self._bridge.finished:
                kv_transfer_params = self._connector_finished(request)
                if prefill_stats is not None and kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
                    # The prefill side's cache hits, for the decode side to report.
                    kv_transfer_params["remote_prefill_cached_tokens"] = prefill_stats.num_cached_tokens
            elif self.ec_connector is not None:
                self._ec_finished(request)
        nans = mro.num_nans_in_logits
        if nans is not None and req_id in nans:
            request.num_nans_in_logits = nans[req_id]
        return EngineCoreOutput(
            request_id=req_id,
            new_token_ids=new_token_ids,
            finish_reason=finish_reason,
            new_logprobs=new_logprobs,
            new_prompt_logprobs_tensors=mro.prompt_logprobs_dict.get(req_id),
            stop_reason=request.stop_reason,
            events=request.take_events(),
            prefill_stats=prefill_stats,
            spec_decode_metrics=request.spec_decode_metrics if finish_reason is not None else None,
            kv_transfer_params=kv_transfer_params,
            **({"ec_transfer_params": self._ec_params.get(req_id)} if self._ec_params else {}),
            trace_headers=request.trace_headers,
            num_nans_in_logits=request.num_nans_in_logits,
            **({"routed_experts": routed_experts} if routed_experts is not None else {}),
        )

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """The drafts the model runner proposed after the last step (vLLM's engine calls this after
        ``update_from_output`` in synchronous mode). The core keeps them for each request's next step."""
        ids: list[str] = []
        drafts: list[list[int]] = []
        requests = self.requests
        validate = self.structured_output_manager.validate_tokens
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=False):
            request = requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished since: vLLM skips it
            if request.is_prefill_chunk:
                # Drafts after a partial prefill are dropped.
                if request.spec_token_ids:
                    request.spec_token_ids = []
                spec_token_ids = []
            else:
                spec_token_ids = validate(request, spec_token_ids)
                request.spec_token_ids = spec_token_ids
                self._drafts_received = True
            ids.append(req_id)
            drafts.append(spec_token_ids)
        if ids:
            self._core.set_draft_token_ids(ids, drafts)

    def update_draft_token_ids_in_output(
        self, draft_token_ids: DraftTokenIds, scheduler_output: SchedulerOutput
    ) -> None:
        """Async scheduling with structured output: the runner's drafts replace the placeholders of a deferred
        step's output, cut to the grammar-valid prefix and padded back with -1 (vLLM's engine calls this before
        computing that step's bitmask). Only the output changes: the core scheduled placeholders of that count."""
        num_invalid: dict[str, int] = {}
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=False):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            placeholders = scheduled.get(req_id)
            if not placeholders:
                continue
            num_scheduled = len(placeholders)
            del spec_token_ids[num_scheduled:]  # vLLM trims the runner's list in place
            valid = self.structured_output_manager.validate_tokens(request, spec_token_ids)
            if len(valid) < num_scheduled:
                num_invalid[req_id] = num_scheduled - len(valid)
                valid.extend([-1] * (num_scheduled - len(valid)))
            scheduled[req_id] = valid
        scheduler_output.num_invalid_spec_tokens = num_invalid

    # ---- queries, pause, reset, stats -------------------------------------------------------------------

    def get_request_counts(self) -> tuple[int, int]:
        s = self._core.stats()
        # vLLM counts the requests admission skipped (deferred) as waiting too.
        return s.num_running_reqs, s.num_waiting_reqs + s.num_skipped_waiting_reqs

    def get_num_unfinished_requests(self) -> int:
        # The core counts as vLLM does: 0 under PAUSED_ALL, only running requests under PAUSED_NEW.
        return int(self._core.num_unfinished_requests) + len(self._refused)

    def has_finished_requests(self) -> bool:
        # With a connector, finished requests whose blocks a transfer holds count too (vLLM keeps them).
        return bool(self.finished_req_ids) or bool(self._held)

    def has_requests(self) -> bool:
        return bool(
            self.has_unfinished_requests()
            or self.has_finished_requests()
            or (self.connector is not None and self.connector.has_pending_push_work())
            or (self.ec_connector is not None and self.ec_connector.has_pending_push_work())
        )

    def get_ec_connector(self) -> Any:
        return self.ec_connector

    @property
    def ec_connector(self) -> Any:
        """vLLM's scheduler-role encoder-cache connector, or None."""
        return self._ec_connector

    @ec_connector.setter
    def ec_connector(self, connector: Any) -> None:
        """Set (or replace, as vLLM's tests do) the EC connector: from the next step the core asks it, through
        :class:`EcBridge`, which encoder outputs it can load and whether a request's are in transit."""
        self._core.set_ec_connector(EcBridge(self) if connector is not None else None)
        self._ec_connector = connector

    def get_kv_connector(self) -> Any:
        return self.connector

    def get_kv_event_publisher_config(self) -> Any:
        return self.kv_event_publisher.get_publisher_config()

    def get_kv_cache_usage(self) -> float:
        return float(self._core.stats().kv_cache_usage)

    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        self._core.set_pause_state(_PAUSE_NAMES[PauseState(pause_state)])
        self._pause_state = PauseState(pause_state)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        if reset_running_requests:
            # The core preempts every running request from the tail (so they come back in order), dropping
            # their in-flight output, then resets; mirror that onto the request objects in the same order.
            running = self._core.running_req_ids()
            if self._aux.connector is not None:
                # vLLM tells the connector of each preemption before the cache is reset (its blocks still cached).
                for req_id in reversed(running):
                    self._aux.request_finished(self.requests[req_id])
            ok = bool(self._core.reset_prefix_cache(reset_running_requests=True))
            now = time.monotonic() if self.log_stats else 0.0
            for req_id in reversed(running):
                request = self.requests[req_id]
                self._mirror_preempt(request, now, aux_told=True, drop_stale_output=True)
                self._reset_preempted_req_ids.add(req_id)
            self.prev_step_scheduled_req_ids.clear()
        else:
            ok = bool(self._core.reset_prefix_cache())
        if reset_running_requests and not ok:
            raise RuntimeError(
                "Failed to reset KV cache even when all the running requests are preempted: KV transfers in "
                "progress hold blocks"
            )
        if ok and self._prefix_cache_stats is not None:
            self._prefix_cache_stats.reset = True
        if reset_connector:
            ok = self.reset_connector_cache() and ok
        if ok and self._aux.connector is not None:
            self._aux.connector.reset()
        return ok

    def reset_connector_cache(self) -> bool:
        """vLLM's ``reset_connector_cache``: no connector counts as success."""
        if self.connector is None:
            return True
        if self.connector.reset_cache() is False:
            return False
        if self._connector_prefix_cache_stats is not None:
            self._connector_prefix_cache_stats.reset = True
        return True

    @property
    def max_num_encoder_input_tokens(self) -> int:
        """vLLM's encoder compute budget per step (encoder tokens)."""
        return int(self._core.config.max_num_encoder_input_tokens)

    @max_num_encoder_input_tokens.setter
    def max_num_encoder_input_tokens(self, value: int) -> None:
        # vLLM's scheduler reads it at the start of each step: the core's budget applies from the next step.
        self._set_encoder_sizes(value, int(self._core.config.encoder_cache_size))

    @property
    def num_prefill_lookahead(self) -> int:
        """vLLM's drafter prefill lookahead (``num_prefill_lookahead_tokens``: a multi-module MTP drafter's draft
        tokens, 1 for other EAGLE-style drafters, 0 without one)."""
        return int(self._core.config.prefill_lookahead_tokens)

    @num_prefill_lookahead.setter
    def num_prefill_lookahead(self, value: int) -> None:
        # vLLM's tests set it on a built scheduler: its chunk rules and encoder window follow from the next step,
        # its KV cache manager keeps the lookahead it was built with (so does the core's prefix cache).
        if value == self.num_prefill_lookahead:
            return
        if self.requests:
            raise UnsupportedFeatureError(
                "kvsched.vllm.Scheduler changes a drafter's prefill lookahead (num_prefill_lookahead) only while it "
                "holds no request"
            )
        self._core.set_prefill_lookahead(value)

    @property
    def encoder_cache_manager(self) -> Any:
        """A read-only view of the core's encoder cache (``cached``, ``cache_size``); assigning a new, empty vLLM
        ``EncoderCacheManager`` re-sizes the cache."""
        return EncoderCacheView(self)

    @encoder_cache_manager.setter
    def encoder_cache_manager(self, manager: Any) -> None:
        """A new, empty vLLM ``EncoderCacheManager`` in place of the scheduler's: the core's encoder cache takes its
        size (only while the core's cache holds no entry, as a new manager holds none)."""
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager, EncoderDecoderCacheManager

        if (
            self._enc_dec
            and type(manager) is EncoderDecoderCacheManager
            and manager.num_free_slots == manager.cache_size
            and not manager.allocated
            and not manager.to_free
        ):
            # Encoder-decoder: a new manager's slot count is its cache size; nothing encoded is left to release.
            self._core.set_encoder_sizes(int(self._core.config.max_num_encoder_input_tokens), int(manager.cache_size))
            self._core.reset_encoder_decoder_slots()
            self._enc_dec_allocated.clear()
            self._enc_dec_to_free.clear()
            return
        if type(manager) is not EncoderCacheManager or manager.cached or manager.num_free_slots != manager.cache_size:
            raise UnsupportedFeatureError(
                "kvsched.vllm.Scheduler does not support replacing its encoder cache manager with anything but a new, "
                f"empty vllm EncoderCacheManager (got {type(manager).__name__}); its core owns the encoder cache"
            )
        self._set_encoder_sizes(int(self._core.config.max_num_encoder_input_tokens), int(manager.cache_size))

    def _set_encoder_sizes(self, max_num_encoder_input_tokens: int, encoder_cache_size: int) -> None:
        """Re-sizes the core's encoder budget and cache (the core refuses a cache that holds entries, or sizes
        below a live request's encoder input). A model without multimodal inputs then schedules them too, as
        vLLM's scheduler does once both are set."""
        mm = encoder_cache_size and self._mm is None and not self._enc_dec
        if mm:
            check_multimodal(self.vllm_config)
        self._core.set_encoder_sizes(max_num_encoder_input_tokens, encoder_cache_size)
        if mm:
            self._mm = EncoderInputMap()

    def reset_encoder_cache(self) -> None:
        """Without an encoder cache (a model without multimodal inputs) there is nothing to reset; encoder-decoder
        scheduling forgets the identifiers still to release, as vLLM's EncoderDecoderCacheManager does; the core
        cannot drop a multimodal model's encoder outputs yet, so that is refused."""
        if self._enc_dec:
            self._enc_dec_allocated.clear()
            self._enc_dec_to_free.clear()
            self._core.reset_encoder_decoder_slots()
        if self._mm is not None:
            raise UnsupportedFeatureError("kvsched.vllm.Scheduler does not support reset_encoder_cache yet")

    def make_stats(
        self,
        spec_decoding_stats: SpecDecodingStats | None = None,
        kv_connector_stats: Any = None,
        *args: Any,
        ec_connector_stats: Any = None,
        **kwargs: Any,
    ) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        self._tenant_log.maybe_log(self)
        prefix = self._prefix_cache_stats
        self._prefix_cache_stats = PrefixCacheStats()
        connector_prefix = self._connector_prefix_cache_stats
        if connector_prefix is not None:
            self._connector_prefix_cache_stats = PrefixCacheStats()
        # The four counters vLLM takes from its scheduler (not the dict of every counter: every step).
        num_running, num_waiting, num_skipped, kv_cache_usage = self._core._vllm_stats()
        bridge = self._bridge
        return SchedulerStats(
            num_running_reqs=num_running,
            num_waiting_reqs=num_waiting,
            num_skipped_waiting_reqs=num_skipped,
            num_kv_fetch_reqs_by_stage=(
                bridge.stage_counts() if bridge is not None else dict.fromkeys(KV_FETCH_STAGES, 0)
            ),
            kv_cache_usage=kv_cache_usage,
            prefix_cache_stats=prefix if prefix is not None else PrefixCacheStats(),
            connector_prefix_cache_stats=connector_prefix,
            spec_decoding_stats=spec_decoding_stats,
            kv_connector_stats=kv_connector_stats.to_dict() if kv_connector_stats else None,
            ec_connector_stats=ec_connector_stats.data if ec_connector_stats else None,
        )

    def shutdown(self) -> None:
        """The core is freed with this object; the KV event publisher and a KV connector are shut down as vLLM's
        scheduler does."""
        self.kv_event_publisher.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        if self.ec_connector is not None:
            self.ec_connector.shutdown()

    # ---- helpers for tests and users --------------------------------------------------------------------

    @property
    def core(self) -> _CoreScheduler:
        """The kvsched core scheduler (read it; changing it behind this adapter's back breaks the mirror)."""
        return self._core

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether the KV connector hands a request's KV off when it completes (vLLM's flag, producer roles by
        default): a preempted request's in-flight output is then dropped, not delivered."""
        return self._requires_kv_delivery

    @property
    def defer_block_free(self) -> bool:
        """vLLM's gate for returning a request's blocks to the pool only after the steps in flight that may write
        them are applied (on with a KV consumer connector and several batches in flight)."""
        return bool(self._core.config.defer_block_free)

    @defer_block_free.setter
    def defer_block_free(self, on: bool) -> None:
        # vLLM's own tests set the flag on a built scheduler; the core takes it from now on.
        self._core.set_defer_block_free(bool(on))

    @property
    def defer_async_loads(self) -> bool:
        """vLLM 0.33's gate for registering an asynchronous KV load with the connector only once the steps in
        flight at its admission are applied (on with ``defer_block_free`` and HiSparse, which kvsched.vllm
        refuses; vLLM's tests set it on a built scheduler)."""
        return bool(self._core.config.defer_async_loads) or self._defer_async_loads_unused

    @defer_async_loads.setter
    def defer_async_loads(self, on: bool) -> None:
        if RULES.defer_async_loads:
            self._core.set_defer_async_loads(bool(on))
        else:
            # A release without the gate: the attribute is kept and changes nothing, as on its own scheduler.
            self._defer_async_loads_unused = bool(on)

    @property
    def connector_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The KV connector's prefix-cache stats being collected (vLLM's attribute; None without stats or a
        connector). Setting it starts collecting into the given object."""
        return self._connector_prefix_cache_stats

    @connector_prefix_cache_stats.setter
    def connector_prefix_cache_stats(self, stats: PrefixCacheStats | None) -> None:
        self._connector_prefix_cache_stats = stats

    @property
    def deferred_frees(self) -> list[tuple[int, list[int]]]:
        """The frees waiting for steps in flight (``defer_block_free``), oldest first: each fence (the non-empty
        steps scheduled at the free; the blocks go back once as many are processed) with its block ids in the
        order they go back (vLLM's list holds the block objects)."""
        return self._core.deferred_frees()

    @property
    def sched_step_seq(self) -> int:
        """Non-empty steps scheduled so far (vLLM's ``sched_step_seq``, the fences of deferred frees)."""
        return int(self._core.step_seqs[0])

    @property
    def processed_step_seq(self) -> int:
        """Non-empty steps whose output was processed so far (vLLM's ``processed_step_seq``)."""
        return int(self._core.step_seqs[1])

    @property
    def aux_output_connector(self) -> Any:
        """vLLM 0.33's auxiliary output connector (``AuxOutputSchedulerConnector``: routed experts), or None. vLLM
        builds it when ``aux_output_config`` is enabled; it may also be set on a built scheduler (vLLM's tests do).
        Setting it makes the core ask it how far each admission's prefix hit may reach (its cache-hit cap)."""
        return self._aux.connector

    @aux_output_connector.setter
    def aux_output_connector(self, connector: Any) -> None:
        if connector is not None and self.hash_block_size != self.block_size:
            # Its cache-hit questions go by vLLM's hash blocks, the core's answers by whole blocks.
            _refuse(
                "the auxiliary output connector with a hash block smaller than the block",
                f"aux_output_connector, hash_block_size={self.hash_block_size}, block_size={self.block_size}",
            )
        self._aux.connector = connector
        self._core.set_cache_hit_cap(self._aux if connector is not None else None)

    @property
    def kv_cache_manager(self) -> KVCacheManagerView:
        """A read-only view of the core's KV cache with the names of vLLM's ``KVCacheManager`` (a request's
        blocks, the block pool's free count and usage, prefix lookups, reference counts, the prefix-cache
        counters), for vLLM's engine core, tests and tools that read the scheduler's; see
        :mod:`kvsched.vllm._kv_view`."""
        view = self._kv_view
        if view is None:
            view = self._kv_view = KVCacheManagerView(self)
        return view

    @property
    def running(self) -> list[Request]:
        """Running requests in kvsched's running order (built on demand; for tests and introspection)."""
        return [self.requests[r] for r in self._core.running_req_ids()]

    @property
    def deferred_waiting(self) -> list[Request]:
        """Waiting requests blocked on their grammar (introspection). vLLM's set also holds requests skipped for
        in-flight output of a preemption; ``make_stats().num_skipped_waiting_reqs`` counts both exactly."""
        return list(self._blocked.values())

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests that hold no KV blocks, in admission order (built on demand; for tests and
        introspection). Without a KV connector or streaming-input sessions that is every waiting request."""
        reqs = [self.requests[r] for r in self._core.waiting_req_ids()]
        if self._bridge is None and not self._parts:
            return reqs
        return [r for r in reqs if not self._holds_kv_blocks(r)]

    @property
    def num_waiting_for_streaming_input(self) -> int:
        """Streaming-input sessions waiting for their next part (vLLM's counter of that name; introspection)."""
        return sum(1 for r in self.requests.values() if r.status == _WAITING_FOR_STREAMING_REQ)

    @property
    def finished_recving_kv_req_ids(self) -> set[str]:
        """Requests whose asynchronous KV load was reported over and that admission has not reached since
        (vLLM's set of that name; introspection)."""
        return set(self._bridge.loaded) if self._bridge is not None else set()

    @property
    def kv_holding_waiting(self) -> list[Request]:
        """Waiting requests that hold KV blocks (an asynchronous KV load in progress or over), in admission order
        (vLLM's ``kv_holding_waiting``; introspection); streaming-input sessions that kept their KV included."""
        if self._bridge is None and not self._parts:
            return []
        return [r for r in map(self.requests.__getitem__, self._core.waiting_req_ids()) if self._holds_kv_blocks(r)]

    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        return bool(request.num_computed_tokens > 0 or request.status == _WAITING_FOR_REMOTE_KVS)


_ = (itertools, np)
