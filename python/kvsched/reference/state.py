"""The reference scheduler's state: its fields, their construction, and the helpers every part uses.

Mirrors the ``Scheduler`` struct and ``Scheduler::new`` in ``rust/kvsched-core/src/scheduler.rs``. Every module
that adds behaviour (``block_pool.py`` ... ``step.py``) defines a mixin on top of :class:`_SchedulerState`;
``scheduler.py`` composes them into :class:`ReferenceScheduler`. No module here imports one above it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .._errors import InvalidConfigError, InvalidOutputError, SchedulerTypeError, UnknownRequestError
from .._types import RequestStatus
from ..config import MAMBA, RING, SchedulerConfig
from .encoder import _EncoderCache
from .events import _KvCacheEvents
from .fair import _Tenants
from .free_queue import _FreeBlockQueue
from .hashing import _BlockHasher
from .output import SchedulerOutput
from .queue import _new_waiting_queue, _WaitingQueue
from .request import _Request


class _SchedulerState:
    """The fields of :class:`ReferenceScheduler` (built from a ``SchedulerConfig`` or its keyword fields)."""

    def __init__(self, config: SchedulerConfig | None = None, *, kv_connector: Any = None, **fields: Any) -> None:
        if config is None:
            try:
                config = SchedulerConfig(**fields)
            except TypeError as e:  # an unknown field name
                raise SchedulerTypeError(str(e)) from None
        elif fields or not isinstance(config, SchedulerConfig):
            raise SchedulerTypeError("pass either a SchedulerConfig or keyword fields, not both")
        self._config = c = config
        # Tokens per block id: under DCP a block holds block_size slots on each rank (docs/semantics.md).
        self._bs = c.kv_block_size
        # The computed tokens not final yet (prefill_lookahead_tokens - 1): kept as built when set_prefill_lookahead
        # changes the lookahead (vLLM's KV cache manager keeps its own).
        self._reprefillable = max(0, c.prefill_lookahead_tokens - 1)
        self._ref_cnt = [0] * c.num_blocks
        self._block_hash: list[bytes | None] = [None] * c.num_blocks
        self._free = _FreeBlockQueue(c.num_blocks)
        self._cached: dict[bytes, dict[int, None]] = {}
        # A prefix match unit finer than the block: per block, the keys it is filed under besides its hash (in
        # ``_cached`` too), and the tokens its hash stands for when the hash is a partial entry.
        self._extra_keys: dict[int, list[bytes]] = {}
        self._partial_tokens: dict[int, int] = {}
        self._events = _KvCacheEvents() if c.enable_kv_cache_events else None  # KV cache events not taken yet
        # with events: the second keys (a prompt's tail entry, groups of different block sizes) each block carries
        self._second_keys: dict[int, list[bytes]] = {}
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._tenants = _Tenants(c)
        self._waiting: _WaitingQueue = _new_waiting_queue(c.policy, self._tenants)
        # requests whose asynchronous KV load is over, holding blocks (vLLM's kv_holding_waiting): admitted first
        self._kv_waiting: _WaitingQueue = _new_waiting_queue(c.policy, self._tenants)
        self._newly_ready: list[_Request] = []  # parked requests that became ready, queued at the next step
        # finished request -> [tables (one per group, group order), awaiting_recv, awaiting_send, last_sched_seq,
        # the blocks that left a window at the finish, per group]
        self._held: dict[str, list[Any]] = {}
        # defer_block_free (vLLM's names): non-empty steps scheduled / applied, and the frees waiting for them as
        # (fence, blocks), oldest first
        self._sched_step_seq = 0
        self._processed_step_seq = 0
        self._deferred_frees: deque[tuple[int, list[int]]] = deque()
        # defer_async_loads (vLLM's deferred_loads): asynchronous loads admitted while a step was in flight, not
        # yet registered with the connector, in admission order: req_id -> (fence, external tokens, connector
        # prefix-cache (queries, hits) or None)
        self._deferred_loads: dict[str, tuple[int, int, tuple[int, int] | None]] = {}
        # block id -> pins taken by pin_blocks and not given back (pins.py)
        self._pins: dict[int, int] = {}
        self._next_add_seq = 0
        if kv_connector is not None:
            for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"):
                if not hasattr(kv_connector, hook):
                    raise SchedulerTypeError(f"kv_connector must have a {hook}() method")
            if c.kv_cache_groups is not None:
                if not c.kv_connector_groups:
                    raise InvalidConfigError(
                        "kv_cache_groups is not supported with a KV connector unless kv_connector_groups is set (its "
                        "hooks then get one block table per group)"
                    )
                if any(w is not None and not isinstance(w, int) and w not in (MAMBA, RING) for w in c.kv_cache_groups):
                    raise InvalidConfigError(
                        "kv_cache_groups with a KV connector must be full-attention, sliding-window, Mamba and ring "
                        "groups (no cross-attention or chunked-local group)"
                    )
        self._connector = kv_connector
        # Opt-in (kvsched.vllm's bridge): update_state_after_alloc also gets which blocks are in the prefix cache.
        self._pass_cached_blocks = bool(getattr(kv_connector, "wants_num_cached_blocks", False))
        self._ec_connector: Any = None  # the encoder-cache connector (encoder_sched.py)
        self._ec_error: BaseException | None = None
        self._hit_cap: Any = None  # the cache-hit cap (connector_sched.py)
        self._hit_cap_error: BaseException | None = None
        self._hook_error: BaseException | None = None  # the first exception a hook raised in the current call
        self._transfer_params: dict[str, Any] = {}
        self._finished_since_schedule: list[str] = []
        self._preempted_since_schedule: list[str] = []  # by reset_prefix_cache(reset_running_requests=True)
        self._pause_state = "unpaused"
        self._num_waiting_for_input = 0  # sessions in WAITING_FOR_STREAMING_REQ
        self._continuing: list[_Request] = []  # sessions whose part stopped in the update being applied
        self._owner = object()  # outputs carry it: an output of another scheduler is refused
        self._next_step_id = 0  # steps are numbered from 0; stats().step_id counts the steps scheduled
        self._next_update_step = 0
        self._outs_in_flight: deque[SchedulerOutput] = deque()  # scheduled, not yet applied or failed
        # the prefill cadence (vLLM's num_executed_steps, last_prefill_step, prefill_capacity_bound)
        self._num_executed_steps = 0
        self._last_prefill_step = -c.prefill_schedule_interval  # a full interval back: the first step is free
        self._prefill_capacity_bound = False
        self._newly_cached: list[tuple[int, bytes]] = []  # (block, hash) cached since schedule() began
        self._group_hits: list[list[int]] = []  # with several KV cache groups: every group's hits of the last lookup
        self._group_longest = 0  # the longest hit one lookup set found in the last lookup (blocks)
        self._group_per_set = False  # the last lookup was the per-group one: each group's hits of its own length
        # divergent_local_hits: the diverged hits admissions kept (the connector found tokens) and replaced (tests)
        self.diverged_hits = [0, 0]
        # Align-mode Mamba groups with prefix caching: the keys Mamba blocks were cached under in this schedule()
        # call (vLLM's cached_blocks_this_step).
        self._mamba_cached_step: set[bytes] = set()
        # Align-mode Mamba groups with prefix caching and a KV connector: the boundary states offered to the
        # connector since take_mamba_boundary_offers, as (req_id, group, block, tokens); None: not recorded.
        offers = kv_connector is not None and c.enable_prefix_caching and c.mamba_align
        self._boundary_offers: list[tuple[str, int, int, int]] | None = (
            [] if offers and MAMBA in (c.kv_cache_groups or ()) else None
        )
        # With a Mamba group or zero_new_blocks: each group's attention blocks allocated since the last schedule()
        # returned.
        groups = c.kv_cache_groups or ()
        self._zero_ids: list[list[int]] = [[] for _ in groups] if MAMBA in groups or c.zero_new_blocks else []
        # The groups an asynchronous load being allocated writes: its loaded tokens' blocks there are not zeroed.
        self._skip_zero: set[int] = set()
        self._last_out: SchedulerOutput | None = None
        self._last_out_fresh = False  # prepare_model_inputs is allowed until the state changes
        self._stats = dict.fromkeys(
            ("queries", "hits", "preempted_queries", "preempted_hits", "preemptions", "finished", "swapped_out_reqs",
             "swapped_out_blocks", "swapped_in_reqs", "swapped_in_blocks", "swap_fallbacks", "recomputed_tokens",
             "connector_queries", "connector_hits", "encoder_hits", "encoder_inputs", "encoder_tokens"), 0
        )  # fmt: skip
        self._encoder = _EncoderCache(c.encoder_cache_size)
        # Encoder-decoder scheduling: vLLM's EncoderDecoderCacheManager slot count (encoder_sched.py).
        self._enc_dec_free_slots = c.encoder_cache_size
        self._cpu_free: deque[int] = deque(range(c.num_cpu_blocks))  # the CPU swap pool: pop left, append right
        self._recompute_cost_per_token = c.recompute_cost_per_token
        self._swap_cost_per_block = c.swap_cost_per_block
        # Tokens per prefix-match unit when prefix hits can end inside a block (0: whole blocks).
        self._partial_unit = c.partial_hit_unit() or 0
        # ... the last lookup's hit and its longest set's hit, in tokens
        self._partial_hit_tokens = 0
        self._partial_longest = 0
        # ... the copies this schedule() call queued, group by group, as (source, destination) blocks: a hit ending
        # inside a block gets a private copy of that block, and a request that cached its prompt's last unit boundary
        # inside a Mamba state block moves the cache entry to a copy (vLLM's kv_cache_block_copies)
        self._cow_copies: list[list[tuple[int, int]]] = [[] for _ in (c.kv_cache_groups or ())]
        self._hasher = _BlockHasher(
            c.prefix_hash_algo, c.prefix_hash_seed, self._bs, c.hash_lookahead_tokens, c.hash_block_size
        )
        # session affinity: session id -> [requests of it running, schedule() calls made when its last running
        # request left running (None: never)]
        self._sessions: dict[str, list[Any]] = {}
        # aging (max_wait_steps): (first step waited in, wait_seq, request) in the order requests entered waiting
        self._aging: deque[tuple[int, int, _Request]] = deque()
        self._next_wait_seq = 0
        self._in_schedule = False  # past the start of schedule(): a request entering waiting waits from the next

    def _get(self, req_id: object) -> _Request:
        if not isinstance(req_id, str):
            raise SchedulerTypeError(f"req_id must be a str, got {type(req_id).__name__}")
        # (an id that is not valid unicode cannot have been added: it is simply unknown)
        r = self._requests.get(req_id)
        if r is None:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        return r

    def _check_output(self, out: object) -> SchedulerOutput:
        if not isinstance(out, SchedulerOutput):
            raise SchedulerTypeError(f"expected a SchedulerOutput, got {type(out).__name__}")
        if out._owner is not self._owner:
            raise InvalidOutputError("this output was produced by another scheduler")
        return out

    def _enter_waiting(self, r: _Request) -> None:
        """``r`` entered ``waiting`` (added, preempted, made ready, or back from ``kv_waiting``): with aging, it
        joins the aging FIFO, waiting from the first step it waits in."""
        if self._config.max_wait_steps is None:
            return
        self._next_wait_seq += 1
        r.wait_seq = self._next_wait_seq
        r.wait_since = self._next_step_id + self._in_schedule
        self._aging.append((r.wait_since, r.wait_seq, r))

    def _session_leaves_running(self, r: _Request) -> None:
        if r.session_id is not None:
            s = self._sessions[r.session_id]
            s[0] -= 1
            s[1] = self._next_step_id

    # Defined in ``scheduler.py`` and ``step.py`` (where the core has them too) and declared here, so that the
    # modules in between can finish and preempt requests without importing a module above them.

    def _finish(self, r: _Request, status: RequestStatus) -> None:
        raise NotImplementedError

    def _preempt(self, r: _Request, drop_stale_output: bool = False) -> None:
        raise NotImplementedError
