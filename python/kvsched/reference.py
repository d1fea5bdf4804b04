"""A pure-Python reference scheduler: ``docs/semantics.md`` as executable documentation.

:class:`ReferenceScheduler` has the public API of :class:`kvsched.Scheduler` and the same semantics,
written for clarity rather than speed. The differential tests run both side by side and require identical
observable behaviour at every step, so every rule below has a line in ``docs/semantics.md``. Hash *values*
differ from the Rust core (only hash equality is part of the contract); everything else must match.

Data structures (mirroring the Rust core):

* blocks: ``_ref_cnt[b]`` and ``_block_hash[b]`` per block id; block 0 is the null block and never used;
* :class:`_FreeBlockQueue`: a doubly linked list in two index arrays (O(1) pop, remove, append, prepend);
* ``_cached``: ``block_hash -> {block_id: None}`` (an insertion-ordered set; lookups take the first block);
* ``_running``: an ordered list; ``_waiting``: a deque (fcfs), a heap with lazy deletion (priority) or one deque
  per tenant (fair);
* ``_tenants``: name -> :class:`_Tenant` (weight, virtual counter, service, waiting count), in registration order.

This module must not import ``kvsched._core``: it is the independent second implementation.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import (
    DuplicateRequestError,
    InternalError,
    InvalidOutputError,
    InvalidRequestError,
    KVConnectorError,
    SchedulerTypeError,
    UnknownRequestError,
)
from ._types import FinishReason, RequestStatus, SchedulerStats, TenantStats
from .config import SchedulerConfig, check_preemption_costs, check_tenant_weight

__all__ = ["ModelInputs", "ReferenceScheduler", "SchedulerOutput", "SchedulerStats", "UpdateResult"]

_TOKEN_LIMIT = 2**31  # token ids live in [0, 2**31)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


# ----------------------------------------------------------------------------------------------------------
# Public result types
# ----------------------------------------------------------------------------------------------------------


class SchedulerOutput:
    """What one ``schedule()`` call decided. Array fields are int32 arrays; CSR pairs end in ``_indptr``.

    ``_owner`` and ``_entries`` are private: they tie the output to its scheduler and to the exact request
    objects it scheduled (so an id reused after a request finished never receives a stale step's tokens).
    """

    __slots__ = (
        "_cached_blocks",
        "_encoder_hashes",
        "_entries",
        "_owner",
        "_swapped_out",
        "finished_req_ids",
        "free_encoder_hashes",
        "kv_connector_metadata",
        "new_block_ids",
        "new_block_ids_indptr",
        "new_req_ids",
        "num_computed_tokens",
        "num_scheduled_tokens",
        "preempted_req_ids",
        "req_ids",
        "resumed_req_ids",
        "scheduled_encoder_inputs",
        "scheduled_encoder_inputs_indptr",
        "spec_token_ids",
        "spec_token_ids_indptr",
        "step_id",
        "swap_in",
        "swap_out",
        "total_num_scheduled_tokens",
    )
    step_id: int
    req_ids: list[str]
    num_scheduled_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    new_req_ids: list[str]
    resumed_req_ids: list[str]
    new_block_ids: np.ndarray
    new_block_ids_indptr: np.ndarray
    spec_token_ids: np.ndarray
    spec_token_ids_indptr: np.ndarray
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    swap_out: np.ndarray  # (m, 2) int32: GPU block -> CPU block, copied before the forward pass
    swap_in: np.ndarray  # (m, 2) int32: CPU block -> GPU block, copied after swap_out
    kv_connector_metadata: Any  # the KV connector's build_connector_meta(out), None without a connector
    scheduled_encoder_inputs: np.ndarray  # int32 CSR: indices of the encoder inputs computed this step
    scheduled_encoder_inputs_indptr: np.ndarray
    free_encoder_hashes: np.ndarray  # uint64: encoder-cache entries evicted since the previous step
    _encoder_hashes: list[int]  # hashes this step computes (they leave the cache if it fails)
    _owner: object
    _entries: list[tuple[_Request, bool, int]]  # (request, was a prefill chunk, number of drafts scheduled)
    _cached_blocks: list[tuple[int, bytes]]  # (block, hash) this step entered into the prefix cache
    _swapped_out: list[_Request]  # victims this step swapped out

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def __len__(self) -> int:
        return len(self.req_ids)

    def num_scheduled_tokens_by_id(self) -> dict[str, int]:
        return dict(zip(self.req_ids, self.num_scheduled_tokens.tolist(), strict=True))

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(step_id={self.step_id}, req_ids={self.req_ids}, "
            f"num_scheduled_tokens={self.num_scheduled_tokens.tolist()}, "
            f"preempted={self.preempted_req_ids}, finished={self.finished_req_ids})"
        )


@dataclass(frozen=True)
class UpdateResult:
    """What ``update_from_output`` did: requests that stopped, why, and the tokens each entry added."""

    finished_req_ids: list[str]
    finish_reasons: np.ndarray  # int8 FinishReason values, aligned with finished_req_ids
    stop_reasons: np.ndarray  # int64: the stop token id, or -1
    num_new_tokens: np.ndarray  # int32, aligned with out.req_ids
    # the KV connector's request_finished params of the requests this call finished (those that gave some)
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInputs:
    """Flat int32 arrays for a paged-attention runner (see docs/api.md)."""

    input_token_ids: np.ndarray
    input_positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    logits_indices: np.ndarray
    num_reqs: int
    num_tokens: int
    max_seq_len: int
    max_query_len: int


# ----------------------------------------------------------------------------------------------------------
# Block pool pieces
# ----------------------------------------------------------------------------------------------------------


class _FreeBlockQueue:
    """The free list: a circular doubly linked list in two arrays, with one sentinel at index ``num_blocks``.

    Every operation is O(1). Membership is ``_linked[b]``; the null block 0 is never linked.
    """

    def __init__(self, num_blocks: int) -> None:
        self._sentinel = s = num_blocks
        self._next = [s] * (num_blocks + 1)
        self._prev = [s] * (num_blocks + 1)
        self._linked = [False] * num_blocks
        self._len = 0
        for b in range(1, num_blocks):
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, b: int) -> bool:
        return self._linked[b]

    def __iter__(self) -> Iterator[int]:
        b = self._next[self._sentinel]
        while b != self._sentinel:
            yield b
            b = self._next[b]

    def _link_after(self, after: int, b: int) -> None:
        nxt = self._next[after]
        self._prev[b], self._next[b] = after, nxt
        self._next[after] = b
        self._prev[nxt] = b
        self._linked[b] = True
        self._len += 1

    def append(self, b: int) -> None:
        self._link_after(self._prev[self._sentinel], b)

    def appendleft(self, b: int) -> None:
        self._link_after(self._sentinel, b)

    def remove(self, b: int) -> None:
        prv, nxt = self._prev[b], self._next[b]
        self._next[prv] = nxt
        self._prev[nxt] = prv
        self._linked[b] = False
        self._len -= 1

    def popleft(self) -> int:
        b = self._next[self._sentinel]
        self.remove(b)
        return b


class _Request:
    """One request's state. Plain attributes; the scheduler mutates them."""

    __slots__ = (
        "add_seq",
        "arrival_step",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "cpu_blocks",
        "deferred",
        "drafts",
        "drop_stale_output",
        "effective_priority",
        "encoder_held",
        "encoder_inputs",
        "eos_token_id",
        "grammar_ready",
        "ignore_eos",
        "inflight_prefill",
        "is_prefill_chunk",
        "kv_load_done",
        "kv_load_failed",
        "lora_name",
        "max_tokens",
        "min_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_charged_prompt_tokens",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_lost_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_stale_output_tokens",
        "num_swapped_tokens",
        "parked",
        "priority",
        "queue_seq",
        "req_id",
        "skip_reading_prefix_cache",
        "status",
        "stop_token_ids",
        "tenant",
        "token_ids",
    )
    # set from add_request's (validated) arguments:
    max_tokens: int  # effective: min(max_tokens, max_model_len - len(prompt))
    min_tokens: int
    eos_token_id: int | None
    ignore_eos: bool
    stop_token_ids: frozenset[int]
    priority: int
    arrival_time: float
    cache_salt: str | None
    lora_name: str | None
    tenant: str
    skip_reading_prefix_cache: bool  # no prefix-cache hits, not in the prefix-cache stats
    arrival_step: int  # schedule() calls before the request was added
    encoder_inputs: list[tuple[int, int, int]]  # (start, num_tokens, hash), sorted, inside the prompt
    effective_priority: int  # priority, or priority * priority_aging_steps + arrival_step (see _PriorityQueue)

    def __init__(self, req_id: str, prompt: list[int], **params: Any) -> None:
        self.req_id = req_id
        self.token_ids = prompt  # prompt then outputs
        self.num_prompt_tokens = len(prompt)
        for name, value in params.items():
            setattr(self, name, value)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.drafts: list[int] = []
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0  # leading blocks of block_ids already entered into the cache map
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-hit tokens at first admission
        self.queue_seq = -1  # identifies this request's live entry in the priority heap
        self.num_charged_prompt_tokens = 0  # prompt tokens charged to the tenant (recompute is free)
        # in-flight bookkeeping (vLLM's Request fields of the same names)
        self.num_output_placeholders = 0  # async: tokens in flight to be sampled
        self.num_in_flight_tokens = 0  # tokens of scheduled steps not yet applied
        self.num_stale_output_tokens = 0  # in-flight tokens from before a preemption
        self.drop_stale_output = False
        self.deferred = False  # skipped by an admission pass (or added blocked), not admitted since
        self.grammar_ready = False
        self.is_prefill_chunk = False  # its last scheduled step stopped short of its known tokens
        # preemption by swapping
        self.cpu_blocks: list[int] = []  # CPU blocks holding its KV while swapped out
        self.num_swapped_tokens = 0  # tokens whose KV they hold
        self.num_lost_tokens = 0  # computed at its last preemption and not yet recovered
        self.add_seq = 0  # order of add_request calls: blocked requests that become ready are queued in it
        self.parked = False  # in no queue, not running: blocked (grammar, KV load) or ready since the last step
        self.kv_load_done = False  # its asynchronous KV load was reported over
        self.kv_load_failed = False  # ... and failed: num_computed_tokens was cut back to the valid prefix
        self.encoder_held = [False] * len(self.encoder_inputs)  # holds a reference to input i's cache entry
        # vLLM 0.33's in-flight prefill set: an async load, or an admission with prompt left, until a step leaves
        # nothing left (or a preemption); read with reserve_inflight_prefills
        self.inflight_prefill = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def priority_key(self) -> tuple[int, float, str]:
        return (self.effective_priority, self.arrival_time, self.req_id)


class _FcfsQueue:
    """fcfs waiting queue: new requests at the back, preempted ones at the front."""

    def __init__(self) -> None:
        self._q: deque[_Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[_Request]:
        return iter(self._q)

    def add(self, r: _Request) -> None:
        self._q.append(r)

    def add_preempted(self, r: _Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> _Request:
        return self._q[0]

    def pop(self) -> _Request:
        return self._q.popleft()

    def remove(self, r: _Request) -> None:
        self._q.remove(r)  # O(n), but only on abort / stop-while-preempted

    def replace_front(self, reqs: list[_Request]) -> None:
        """Overwrite the first ``len(reqs)`` entries (the admission window's reordering)."""
        for k, r in enumerate(reqs):
            self._q[k] = r


class _PriorityQueue:
    """priority waiting queue: a heap on ``(effective priority, arrival_time, req_id)``; removal is lazy.

    With ``priority_aging_steps = A > 0`` the effective priority is ``priority * A + arrival_step``: ordering by it
    is ordering by ``priority - age / A`` at any common step (one level per ``A`` steps of age), a static key.

    Live requests have distinct ids, so the key orders them totally; the sequence number only keeps heapq from
    comparing request objects when a stale entry shares a key with a live one.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], int, _Request]] = []
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Request]:
        return (r for _, seq, r in self._heap if r.queue_seq == seq)

    def add(self, r: _Request) -> None:
        r.queue_seq = next(self._seq)
        heapq.heappush(self._heap, (r.priority_key(), r.queue_seq, r))
        self._len += 1

    add_preempted = add

    def _drop_stale(self) -> None:
        while self._heap and self._heap[0][2].queue_seq != self._heap[0][1]:
            heapq.heappop(self._heap)

    def peek(self) -> _Request:
        self._drop_stale()
        return self._heap[0][2]

    def pop(self) -> _Request:
        self._drop_stale()
        r = heapq.heappop(self._heap)[2]
        r.queue_seq = -1
        self._len -= 1
        return r

    def remove(self, r: _Request) -> None:
        r.queue_seq = -1
        self._len -= 1


class _Tenant:
    """A tenant's weight, virtual counter (VTC), service received and number of waiting requests."""

    __slots__ = (
        "counter",
        "decode_rate",
        "name",
        "num_decode_tokens",
        "num_prefill_tokens",
        "num_waiting",
        "prefill_rate",
        "weight",
    )

    def __init__(self, name: str, weight: float, config: SchedulerConfig) -> None:
        self.name = name
        self.counter = 0.0
        self.num_prefill_tokens = self.num_decode_tokens = self.num_waiting = 0
        self.set_weight(weight, config)

    def set_weight(self, weight: float, config: SchedulerConfig) -> None:
        """The charge per token is ``rate * tokens`` with ``rate = w / weight`` (the Rust core's expression)."""
        self.weight = weight
        self.prefill_rate = config.fair_prefill_weight / weight
        self.decode_rate = config.fair_decode_weight / weight


class _FairQueue:
    """fair waiting queue: one FIFO per tenant; the next request is the head of the tenant with the smallest
    ``(counter, head arrival_time, name)``. Preempted requests return to the front of their tenant's FIFO."""

    def __init__(self, tenants: dict[str, _Tenant]) -> None:
        self._tenants = tenants
        self._queues: dict[str, deque[_Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Request]:
        return itertools.chain.from_iterable(self._queues.values())

    def add(self, r: _Request) -> None:
        self._queues.setdefault(r.tenant, deque()).append(r)
        self._len += 1

    def add_preempted(self, r: _Request) -> None:
        self._queues.setdefault(r.tenant, deque()).appendleft(r)
        self._len += 1

    def _pick(self) -> deque[_Request]:
        keys = [(self._tenants[t].counter, q[0].arrival_time, t) for t, q in self._queues.items() if q]
        return self._queues[min(keys)[2]]

    def peek(self) -> _Request:
        return self._pick()[0]

    def pop(self) -> _Request:
        self._len -= 1
        return self._pick().popleft()

    def remove(self, r: _Request) -> None:
        self._queues[r.tenant].remove(r)
        self._len -= 1

    def in_order(self) -> list[_Request]:
        """The order of repeated pops if the counters stayed as they are."""
        copy = _FairQueue(self._tenants)
        copy._queues = {t: deque(q) for t, q in self._queues.items()}
        copy._len = self._len
        return [copy.pop() for _ in range(len(copy))]


# ----------------------------------------------------------------------------------------------------------
# Input conversion (validate everything before touching state)
# ----------------------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_array(value: object, what: str, range_error: type[Exception] = InvalidRequestError) -> np.ndarray:
    """A 1-D int64 array from a list/tuple of ints or a 1-D integer numpy array; SchedulerTypeError else."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise SchedulerTypeError(f"{what} must be a 1-D integer array, got {value.dtype}[{value.shape}]")
        return value.astype(np.int64)
    if isinstance(value, (list, tuple)):
        if not all(_is_int(t) for t in value):
            raise SchedulerTypeError(f"{what} must hold ints")
        try:
            return np.array([int(t) for t in value], dtype=np.int64)
        except OverflowError:  # beyond int64: certainly out of range
            raise range_error(f"{what} holds an out-of-range token id") from None
    raise SchedulerTypeError(f"{what} must be a list of ints or a 1-D integer numpy array, got {type(value)}")


def _check_tokens(arr: np.ndarray, what: str, error: type[Exception]) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= _TOKEN_LIMIT):
        raise error(f"{what}: token ids must be in [0, 2**31)")


def _ragged(value: object, n: int, what: str) -> list[list[int]]:
    """Parse a ``(values, indptr)`` pair of 1-D integer arrays, or a list of ``n`` lists of ints."""
    if isinstance(value, tuple):
        if len(value) != 2 or not all(isinstance(v, np.ndarray) for v in value):
            raise SchedulerTypeError(f"{what}: a tuple must be (values, indptr), two 1-D integer arrays")
        values, indptr = (_int_array(v, what, InvalidOutputError) for v in value)
        if len(indptr) != n + 1 or indptr[0] != 0 or indptr[-1] != len(values) or np.any(np.diff(indptr) < 0):
            raise InvalidOutputError(f"{what}: indptr must have {n + 1} non-decreasing offsets from 0 to len")
        return [values[indptr[i] : indptr[i + 1]].tolist() for i in range(n)]
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidOutputError(f"{what} has {len(value)} entries, the step scheduled {n} requests")
        return [_int_array(entry, what, InvalidOutputError).tolist() for entry in value]
    raise SchedulerTypeError(f"{what} must be a (values, indptr) pair of arrays or a list of lists")


def _opt_str(value: object, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise SchedulerTypeError(f"{what} must be None or a str, got {type(value).__name__}")
    if value is not None and not _is_utf8(value):
        raise InvalidRequestError(f"{what} is not valid unicode (a lone surrogate)")
    return value


def _is_utf8(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# The scheduler
# ----------------------------------------------------------------------------------------------------------


PAD_SLOT_ID = -1  # vLLM's padding slot: this token's K/V is stored on another DCP rank


class _EncoderCache:
    """Encoder outputs by content hash, sized in encoder tokens (vLLM's EncoderCacheManager rules).

    ``entries``: hash -> [size, references]; a reference is ``(request, input index)``. An entry without
    references is *freeable*: still cached (a later input with its hash reuses it), evicted oldest-freeable
    first (``freeable`` keeps the order) only when an allocation needs the space."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[int, list[Any]] = {}
        self.freeable: OrderedDict[int, None] = OrderedDict()
        self.freed: list[int] = []  # evicted since the last step's output

    @property
    def num_free(self) -> int:
        return self.capacity - sum(int(e[0]) for e in self.entries.values())

    @property
    def num_freeable(self) -> int:
        return self.num_free + sum(int(self.entries[h][0]) for h in self.freeable)

    def reference(self, h: int, ref: tuple[_Request, int]) -> bool:
        """If ``h`` is cached, reference it (it stops being freeable) and return True."""
        e = self.entries.get(h)
        if e is None:
            return False
        self.freeable.pop(h, None)
        if not any(x is ref[0] and i == ref[1] for x, i in e[1]):
            e[1].append(ref)
        return True

    def fits(self, size: int, budget: int) -> bool:
        """Whether ``size`` fits the budget and the cache; evicts freeable entries, oldest first, if needed."""
        if size > budget or size > self.num_freeable:
            return False
        while size > self.num_free:
            h, _ = self.freeable.popitem(last=False)
            del self.entries[h]
            self.freed.append(h)
        return True

    def release(self, h: int, ref: tuple[_Request, int]) -> None:
        e = self.entries.get(h)
        if e is None:
            return
        e[1] = [(x, i) for x, i in e[1] if not (x is ref[0] and i == ref[1])]
        if not e[1]:
            self.freeable[h] = None

    def drop(self, h: int, report: bool) -> None:
        """An unreferenced entry whose output was never computed (or whose step failed) leaves at once."""
        e = self.entries.get(h)
        if e is not None and not e[1]:
            del self.entries[h]
            self.freeable.pop(h, None)
            if report:
                self.freed.append(h)

    def take_freed(self) -> list[int]:
        freed = [h for h in self.freed if h not in self.entries]  # evicted and cached again: kept
        self.freed = []
        return freed


class _EncoderStep:
    """One step's encoder bookkeeping: the budget left, the (request, input) pairs computed by requests already
    scheduled, and the plan of the request being scheduled (inputs it computes, inputs it newly references)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.work: list[tuple[_Request, int]] = []
        self.pending: list[tuple[_Request, int]] = []
        self.newly: list[int] = []


class ReferenceScheduler:
    """Pure-Python twin of :class:`kvsched.Scheduler` (same constructor, methods, results and errors)."""

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
        self._ref_cnt = [0] * c.num_blocks
        self._block_hash: list[bytes | None] = [None] * c.num_blocks
        self._free = _FreeBlockQueue(c.num_blocks)
        self._cached: dict[bytes, dict[int, None]] = {}
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._tenants: dict[str, _Tenant] = {t: _Tenant(t, w, c) for t, w in c.tenant_weights.items()}
        self._waiting: _FcfsQueue | _PriorityQueue | _FairQueue = self._new_queue()
        # requests whose asynchronous KV load is over, holding blocks (vLLM's kv_holding_waiting): admitted first
        self._kv_waiting: _FcfsQueue | _PriorityQueue | _FairQueue = self._new_queue()
        self._newly_ready: list[_Request] = []  # parked requests that became ready, queued at the next step
        self._held: dict[str, list[Any]] = {}  # finished request -> [blocks, awaiting_recv, awaiting_send]
        self._next_add_seq = 0
        if kv_connector is not None:
            for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"):
                if not hasattr(kv_connector, hook):
                    raise SchedulerTypeError(f"kv_connector must have a {hook}() method")
        self._connector = kv_connector
        self._hook_error: BaseException | None = None  # the first exception a hook raised in the current call
        self._transfer_params: dict[str, Any] = {}
        self._finished_since_schedule: list[str] = []
        self._preempted_since_schedule: list[str] = []  # by reset_prefix_cache(reset_running_requests=True)
        self._pause_state = "unpaused"
        self._owner = object()  # outputs carry it: an output of another scheduler is refused
        self._next_step_id = 0  # steps are numbered from 0; stats().step_id counts the steps scheduled
        self._next_update_step = 0
        # the prefill cadence (vLLM's num_executed_steps, last_prefill_step, prefill_capacity_bound)
        self._num_executed_steps = 0
        self._last_prefill_step = -c.prefill_schedule_interval  # a full interval back: the first step is free
        self._prefill_capacity_bound = False
        self._newly_cached: list[tuple[int, bytes]] = []  # (block, hash) cached since schedule() began
        self._last_out: SchedulerOutput | None = None
        self._last_out_fresh = False  # prepare_model_inputs is allowed until the state changes
        self._stats = dict.fromkeys(
            ("queries", "hits", "preempted_queries", "preempted_hits", "preemptions", "finished", "swapped_out_reqs",
             "swapped_out_blocks", "swapped_in_reqs", "swapped_in_blocks", "swap_fallbacks", "recomputed_tokens",
             "connector_queries", "connector_hits", "encoder_hits", "encoder_inputs", "encoder_tokens"), 0
        )  # fmt: skip
        self._encoder = _EncoderCache(c.encoder_cache_size)
        self._cpu_free: deque[int] = deque(range(c.num_cpu_blocks))  # the CPU swap pool: pop left, append right
        self._recompute_cost_per_token = c.recompute_cost_per_token
        self._swap_cost_per_block = c.swap_cost_per_block
        self._hash_fn = hashlib.sha256 if c.prefix_hash_algo == "sha256" else _blake2b_128
        seed = c.prefix_hash_seed
        seed_bytes = os.urandom(32) if seed is None else _seed_bytes(seed)
        self._seed_hash = self._hash_fn(b"kvsched-seed\0" + seed_bytes).digest()

    def _new_queue(self) -> _FcfsQueue | _PriorityQueue | _FairQueue:
        p = self._config.policy
        return _FcfsQueue() if p == "fcfs" else _PriorityQueue() if p == "priority" else _FairQueue(self._tenants)

    @property
    def kv_connector(self) -> Any:
        return self._connector

    # -- KV connector hooks (an exception is kept and raised once the call is over; the hook then answers
    # "nothing external, no delayed free", as the Rust binding does) ---------------------------------------

    def _keep(self, e: BaseException) -> None:
        if self._hook_error is None:
            self._hook_error = e

    def _after_hooks(self) -> None:
        e, self._hook_error = self._hook_error, None
        if e is not None:
            raise e

    def _hook_matched(self, r: _Request, num_computed: int) -> tuple[int, bool] | None:
        try:
            res = self._connector.get_num_new_matched_tokens(r.req_id, num_computed)
            what = "kv_connector.get_num_new_matched_tokens"
            if not isinstance(res, tuple) or len(res) != 2:
                raise KVConnectorError(f"{what}: must return a pair (int | None, bool), got {res!r}")
            n, load_async = res
            if not isinstance(load_async, bool):
                raise KVConnectorError(f"{what}: async flag must be a bool, got {type(load_async).__name__}")
            if n is None:
                return None
            if not _is_int(n):
                raise KVConnectorError(f"{what}: token count must be an int or None, got {type(n).__name__}")
            if not 0 <= n < 2**32:
                raise KVConnectorError(f"{what}: token count must be >= 0, got {n}")
            return int(n), load_async
        except Exception as e:
            self._keep(e)
            return None

    def _hook_after_alloc(self, r: _Request, num_external: int) -> None:
        try:
            self._connector.update_state_after_alloc(r.req_id, list(r.block_ids), num_external)
        except Exception as e:
            self._keep(e)

    def _hook_finished(self, r: _Request, block_ids: list[int]) -> bool:
        try:
            res = self._connector.request_finished(r.req_id, list(block_ids))
            delay, params = res if isinstance(res, tuple) and len(res) == 2 else (res, None)
            if not isinstance(delay, bool):
                raise KVConnectorError(
                    f"kv_connector.request_finished: must return bool or (bool, params), got {res!r}"
                )
            if params is not None:
                self._transfer_params[r.req_id] = params
            return delay
        except Exception as e:
            self._keep(e)
            return False

    # -- block pool --------------------------------------------------------------------------------------

    def _hash_block(
        self, parent: bytes, tokens: list[int], lora: str | None, salt: str | None, mm: Sequence[tuple[int, int]] = ()
    ) -> bytes:
        """``H(parent, tokens, extra keys)``, unambiguously encoded (fixed-width tokens, tagged keys). ``mm``: the
        encoder inputs overlapping the block, as (hash, start relative to the block)."""
        data = [parent, len(tokens).to_bytes(4, "little")]
        data += [t.to_bytes(4, "little") for t in tokens]
        for key in (lora, salt):
            raw = None if key is None else key.encode()
            data.append(b"\0" if raw is None else b"\1" + len(raw).to_bytes(8, "little") + raw)
        for h, offset in mm:
            data.append(b"\2" + h.to_bytes(8, "little") + offset.to_bytes(8, "little", signed=True))
        return self._hash_fn(b"".join(data)).digest()

    def _block_hashes_of(self, tokens: list[int], salt: str | None, lora: str | None, start: int = 0,
                         prev: list[bytes] | None = None,
                         encoder_inputs: Sequence[tuple[int, int, int]] = ()) -> list[bytes]:  # fmt: skip
        """Hashes of the full blocks of ``tokens`` from block ``start`` on, chained on ``prev``. A block that
        overlaps encoder inputs also hashes their content hashes and offsets (vLLM's multimodal extra keys), so
        equal placeholder tokens with different encoder content never share KV."""
        hashes = list(prev or [])
        bs = self._bs
        for i in range(start, len(tokens) // bs):
            parent = hashes[i - 1] if i else self._seed_hash
            block = tokens[i * bs : (i + 1) * bs]
            lo = i * bs
            mm = [(h, st - lo) for st, n, h in encoder_inputs if st < lo + bs and st + n > lo]
            hashes.append(self._hash_block(parent, block, lora, salt if i == 0 else None, mm))
        return hashes

    def _update_block_hashes(self, r: _Request) -> None:
        if self._config.enable_prefix_caching:
            r.block_hashes = self._block_hashes_of(
                r.token_ids, r.cache_salt, r.lora_name, len(r.block_hashes), r.block_hashes, r.encoder_inputs
            )

    def _lookup(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """Longest prefix hit: the first cached block per hash, stopping at the first miss, capped so the last
        token is always computed."""
        hits: list[int] = []
        if not self._config.enable_prefix_caching:
            return hits
        for i in range((num_tokens - 1) // self._bs):
            blocks = self._cached.get(block_hashes[i])
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def _pop_free_block(self) -> int:
        b = self._free.popleft()
        h = self._block_hash[b]
        if h is not None:  # evict: the block is reused, its cached contents are gone
            del self._cached[h][b]
            if not self._cached[h]:
                del self._cached[h]
            self._block_hash[b] = None
        self._ref_cnt[b] = 1
        return b

    def _free_blocks(self, r: _Request) -> None:
        """Release ``r``'s blocks in reverse; cached ones go to the tail (LRU), uncached ones as one group to the
        head, deepest first (so the head is the deepest freed block)."""
        self._free_block_list(r.block_ids)
        r.block_ids = []
        r.num_cached_blocks = 0

    def _free_block_list(self, block_ids: list[int]) -> None:
        to_head: list[int] = []
        for b in reversed(block_ids):
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                if self._block_hash[b] is not None:
                    self._free.append(b)
                else:
                    to_head.append(b)
        for b in reversed(to_head):
            self._free.appendleft(b)

    def _full_sequence_fits(self, r: _Request, hits: list[int], reserved: int) -> bool:
        """Could the free blocks hold all of ``r``'s tokens (capped at max_slots_per_request) beyond its hits, and still
        leave ``reserved`` (the watermark) free?"""
        full = min(r.num_tokens, self._config.max_slots_per_request)
        need = max(0, math.ceil(full / self._bs) - len(r.block_ids) - len(hits))
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        return need + evictable_hits + reserved <= len(self._free)

    def _cache_blocks(self, r: _Request, num_tokens: int) -> None:
        """Enter ``r``'s full blocks among its first ``num_tokens`` tokens into the cache map (if caching)."""
        if not self._config.enable_prefix_caching:
            return
        num_full = min(num_tokens // self._bs, len(r.block_hashes), len(r.block_ids))
        for i in range(r.num_cached_blocks, num_full):
            b, h = r.block_ids[i], r.block_hashes[i]
            self._block_hash[b] = h
            self._cached.setdefault(h, {})[b] = None
            self._newly_cached.append((b, h))
        r.num_cached_blocks = max(r.num_cached_blocks, num_full)

    def _allocate_slots(
        self, r: _Request, n: int, hits: list[int], lookahead: int, reserved: int = 0, ext: int = 0, cache: bool = True
    ) -> list[int] | None:
        """Reserve KV slots for ``n`` more tokens (+ lookahead), leaving ``reserved`` blocks free: the new
        blocks, or None (nothing changed). ``ext`` tokens after the hits come from the KV connector (they take
        slots like computed tokens); with ``cache`` False (an asynchronous load) no block enters the cache now."""
        c, bs = self._config, self._bs
        total_computed = r.num_computed_tokens + len(hits) * bs + ext
        num_slots = min(total_computed + n + lookahead, c.max_slots_per_request)
        need = max(0, math.ceil(num_slots / bs) - len(r.block_ids) - len(hits))
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        if need + evictable_hits + reserved > len(self._free):
            return None
        for b in hits:  # touch
            if self._ref_cnt[b] == 0:
                self._free.remove(b)
            self._ref_cnt[b] += 1
        r.block_ids += hits
        r.num_cached_blocks += len(hits)
        new_blocks = [self._pop_free_block() for _ in range(need)]
        r.block_ids += new_blocks
        if cache:
            self._cache_blocks(r, min(total_computed + n, r.num_tokens))  # now, before the model writes them
        return new_blocks

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Any,
        max_tokens: int | None = None,
        min_tokens: int | None = 0,
        eos_token_id: int | None = None,
        ignore_eos: bool | None = False,
        stop_token_ids: Iterable[int] | None = (),
        priority: int | None = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        tenant: str | None = None,
        ready: bool | None = True,
        skip_reading_prefix_cache: bool | None = False,
        encoder_inputs: Any = None,
    ) -> None:
        """Queue a new request (status WAITING, or WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR with ``ready=False``
        until :meth:`set_ready`). Validates every argument first; on error nothing changes."""
        c = self._config
        if not isinstance(req_id, str):
            raise SchedulerTypeError(f"req_id must be a str, got {type(req_id).__name__}")
        if not req_id or not _is_utf8(req_id):
            raise InvalidRequestError("req_id must be a non-empty, valid unicode str")
        if req_id in self._requests or req_id in self._held:
            raise DuplicateRequestError(f"request {req_id!r} already exists")
        prompt = _int_array(prompt_token_ids, "prompt_token_ids")
        if len(prompt) == 0:
            raise InvalidRequestError("prompt_token_ids must not be empty")
        _check_tokens(prompt, "prompt_token_ids", InvalidRequestError)
        if len(prompt) >= c.max_model_len:
            raise InvalidRequestError(f"prompt of {len(prompt)} tokens leaves no room in {c.max_model_len}")
        min_tokens = 0 if min_tokens is None else min_tokens
        for name, value, lo in (("max_tokens", max_tokens, 1), ("min_tokens", min_tokens, 0)):
            if value is not None and not _is_int(value):
                raise SchedulerTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value is not None and value < lo:
                raise InvalidRequestError(f"{name} must be >= {lo}, got {value}")
        room = c.max_model_len - len(prompt)
        effective_max = room if max_tokens is None else min(int(max_tokens), room)
        if int(min_tokens) > effective_max:
            raise InvalidRequestError(f"min_tokens ({min_tokens}) > effective max_tokens ({effective_max})")
        if eos_token_id is not None:
            if not _is_int(eos_token_id):
                raise SchedulerTypeError("eos_token_id must be None or an int")
            if not 0 <= eos_token_id < _TOKEN_LIMIT:
                raise InvalidRequestError(f"eos_token_id {eos_token_id} out of [0, 2**31)")
        ignore_eos = False if ignore_eos is None else ignore_eos  # None means the default, as in Scheduler
        priority = 0 if priority is None else priority
        if not isinstance(ignore_eos, bool):
            raise SchedulerTypeError("ignore_eos must be a bool")
        stops = _int_array([] if stop_token_ids is None else stop_token_ids, "stop_token_ids")
        _check_tokens(stops, "stop_token_ids", InvalidRequestError)
        if not _is_int(priority):
            raise SchedulerTypeError(f"priority must be an int, got {type(priority).__name__}")
        if not _I64_MIN <= priority <= _I64_MAX:
            raise InvalidRequestError(f"priority {priority} is outside the int64 range")
        if arrival_time is None:
            arrival_time = time.monotonic()
        elif not isinstance(arrival_time, (int, float, np.integer, np.floating)) or isinstance(
            arrival_time, (bool, np.bool_)
        ):
            raise SchedulerTypeError(f"arrival_time must be a float, got {type(arrival_time).__name__}")
        elif not math.isfinite(_to_float(arrival_time)):
            raise InvalidRequestError(f"arrival_time must be finite, got {arrival_time}")
        cache_salt = _opt_str(cache_salt, "cache_salt")
        lora_name = _opt_str(lora_name, "lora_name")
        tenant = "default" if tenant is None else tenant
        check_tenant_weight(tenant, 1.0, InvalidRequestError)
        ready = True if ready is None else ready
        if not isinstance(ready, bool):
            raise SchedulerTypeError(f"ready must be a bool, got {type(ready).__name__}")
        skip = False if skip_reading_prefix_cache is None else skip_reading_prefix_cache
        if not isinstance(skip, bool):
            raise SchedulerTypeError(f"skip_reading_prefix_cache must be a bool, got {type(skip).__name__}")
        inputs = _encoder_inputs(encoder_inputs)
        self._check_encoder_inputs(req_id, len(prompt), inputs)
        # The most KV slots it ever holds (all its tokens but the last sampled one) must fit the whole cache, and,
        # without chunked prefill, one step's budget (a preempted request recomputes them in one step).
        longest = len(prompt) + effective_max - 1
        if longest > c.kv_capacity_tokens:
            raise InvalidRequestError(
                f"prompt ({len(prompt)}) + max_tokens ({effective_max}) - 1 = {longest} tokens do not fit the KV "
                f"cache ({c.num_usable_blocks} usable blocks of {c.kv_block_size} tokens = {c.kv_capacity_tokens})"
            )
        if not c.enable_chunked_prefill and longest > c.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt ({len(prompt)}) + max_tokens ({effective_max}) - 1 = {longest} tokens exceed "
                f"max_num_batched_tokens={c.max_num_batched_tokens} without chunked prefill"
            )

        r = _Request(
            req_id,
            prompt.tolist(),
            max_tokens=effective_max,
            min_tokens=int(min_tokens),
            eos_token_id=None if eos_token_id is None else int(eos_token_id),
            ignore_eos=bool(ignore_eos),
            stop_token_ids=frozenset(stops.tolist()),
            priority=int(priority),
            arrival_time=_to_float(arrival_time),
            cache_salt=cache_salt,
            lora_name=lora_name,
            tenant=tenant,
            skip_reading_prefix_cache=skip,
            arrival_step=self._next_step_id,
            encoder_inputs=inputs,
        )
        aging = c.priority_aging_steps
        r.effective_priority = r.priority * aging + r.arrival_step if aging else r.priority
        r.add_seq = self._next_add_seq
        self._next_add_seq += 1
        if not ready:  # vLLM enqueues a request in a blocked status straight into deferred_waiting
            r.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            r.deferred = True
            # In no queue until set_ready, or (vLLM 0.33) in `waiting`, skipped by admission passes that reach it.
            r.parked = c.park_grammar_waits
        self._update_block_hashes(r)
        self._requests[req_id] = r
        if not r.parked:
            self._waiting.add(r)
        self._on_arrival(self._tenant(tenant))
        self._last_out_fresh = False

    def _get(self, req_id: object) -> _Request:
        if not isinstance(req_id, str):
            raise SchedulerTypeError(f"req_id must be a str, got {type(req_id).__name__}")
        # (an id that is not valid unicode cannot have been added: it is simply unknown)
        r = self._requests.get(req_id)
        if r is None:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        return r

    def _finish(self, r: _Request, status: RequestStatus) -> None:
        """Free ``r`` (or keep its blocks for a KV transfer in progress), take it out of its queue, remember it
        for the next output, and forget it."""
        was_loading = r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not r.kv_load_done
        if r.status == RequestStatus.RUNNING:
            self._running.remove(r)
        else:
            if r.parked:
                if r in self._newly_ready:
                    self._newly_ready.remove(r)
            elif any(x is r for x in self._kv_waiting):
                self._kv_waiting.remove(r)
            else:
                self._waiting.remove(r)
            self._tenants[r.tenant].num_waiting -= 1
        r.parked = False
        r.status = status
        delay = False
        if self._connector is not None:
            delay = self._hook_finished(r, r.block_ids[: math.ceil(r.num_computed_tokens / self._bs)])
        if delay or was_loading:
            self._held[r.req_id] = [r.block_ids, was_loading, delay]
            r.block_ids = []
            r.num_cached_blocks = 0
        else:
            self._free_blocks(r)
        self._release_all_encoder(r)
        self._cpu_free.extend(r.cpu_blocks)  # a swapped-out request aborted while waiting
        r.cpu_blocks, r.num_swapped_tokens = [], 0
        r.drafts = []
        r.deferred = False
        del self._requests[r.req_id]
        self._finished_since_schedule.append(r.req_id)
        self._stats["finished"] += 1

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort requests in any state, in the given order. Every id must be known; duplicates count once.

        A bare ``str`` is refused (it would otherwise be taken as an iterable of one-character ids)."""
        ids = _as_sequence(req_ids, "req_ids")
        reqs = {id(r): r for r in (self._get(i) for i in ids)}  # validates all before aborting any
        for r in reqs.values():
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        if reqs:
            self._last_out_fresh = False
        self._transfer_params = {}  # vLLM returns no transfer parameters for aborted requests either
        self._after_hooks()

    def fail_step(self, out: SchedulerOutput) -> list[str]:
        """The runner could not execute step ``out``, which must be the only step in flight. The blocks it entered
        into the prefix cache leave it (their KV was never computed), its live requests are aborted in step order,
        the victims it swapped out give their CPU blocks back (they recompute), and the step counts as applied.
        Returns the aborted ids."""
        out = self._check_output(out)
        if out.step_id < self._next_update_step:
            raise InvalidOutputError(f"step {out.step_id} was already applied")
        if out.step_id > self._next_update_step:
            raise InvalidOutputError(
                f"step {self._next_update_step} is in flight before step {out.step_id}: apply or fail it first"
            )
        if self._next_step_id != out.step_id + 1:
            raise InvalidOutputError(
                f"step {out.step_id} can only fail while it is the only step in flight "
                f"({self._next_step_id - out.step_id} are): the later steps were scheduled on its results"
            )
        # A live request outside the step holds blocks this step cached only when schedule() promoted its
        # finished KV load without scheduling it: their KV arrived from the connector, they stay cached.
        in_step = {id(r) for r, _, _ in out._entries}
        kept = {b for r in self._requests.values() if id(r) not in in_step for b in r.block_ids}
        for b, h in out._cached_blocks:
            if self._block_hash[b] == h and b not in kept:
                del self._cached[h][b]
                if not self._cached[h]:
                    del self._cached[h]
                self._block_hash[b] = None
        failed = [r for r, _, _ in out._entries if not r.status.is_finished]
        for r in failed:
            self._finish(r, RequestStatus.FINISHED_ABORTED)
        for mm_hash in out._encoder_hashes:  # the encoder outputs it was to compute may not exist
            self._encoder.drop(mm_hash, True)
        for r in out._swapped_out:  # their swap_out copy may never have run: they recompute when resumed
            if not r.status.is_finished and r.cpu_blocks:
                self._cpu_free.extend(r.cpu_blocks)
                r.cpu_blocks, r.num_swapped_tokens = [], 0
        self._next_update_step += 1
        self._last_out_fresh = False
        self._transfer_params = {}  # aborted, as by abort_requests: no transfer parameters for them
        self._after_hooks()
        return [r.req_id for r in failed]

    # -- encoder inputs (docs/semantics.md, "Encoder inputs") ---------------------------------------------

    def _check_encoder_inputs(self, req_id: str, prompt_len: int, inputs: list[tuple[int, int, int]]) -> None:
        if not inputs:
            return
        c = self._config
        limit = min(c.max_num_encoder_input_tokens, c.encoder_cache_size)
        if limit == 0:
            raise InvalidRequestError(
                f"request {req_id!r} has encoder inputs, but max_num_encoder_input_tokens and encoder_cache_size "
                "must both be > 0"
            )
        known: dict[int, int] = {h: e[0] for h, e in self._encoder.entries.items()}
        for other in self._requests.values():
            for _, size, h in other.encoder_inputs:
                known[h] = size
        prev_end = 0
        for i, (start, size, h) in enumerate(inputs):
            if size < 1:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i} has no tokens")
            if start + size > prompt_len:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i} reaches beyond the prompt")
            if i > 0 and start < prev_end:
                raise InvalidRequestError(f"request {req_id!r}: encoder inputs must be sorted and not overlap")
            prev_end = start + size
            if size > limit:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i} exceeds the encoder budget/cache")
            if c.disable_chunked_mm_input:
                th = c.long_prefill_token_threshold
                chunk = min(th, c.max_num_batched_tokens) if th > 0 else c.max_num_batched_tokens
                if size > chunk:
                    raise InvalidRequestError(f"request {req_id!r}: encoder input {i} exceeds a chunk")
            if known.setdefault(h, size) != size:
                raise InvalidRequestError(f"request {req_id!r}: encoder input {i}: hash {h} known with another size")

    def _release_all_encoder(self, r: _Request) -> None:
        for i, (_, _, h) in enumerate(r.encoder_inputs):
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(h, (r, i))

    def _plan_encoder(self, st: _EncoderStep, r: _Request, computed: int, n: int) -> int:
        """vLLM's _try_schedule_encoder_inputs: the chunk [computed, computed + n) reuses cached inputs and
        computes the others that fit the step's budget and the cache; it is cut before the first that does not
        (to 0 when it starts inside it). With disable_chunked_mm_input it stops before an input it would cover
        only in part. Entries are allocated (and budget charged) now; the plan is committed or rolled back."""
        if n == 0 or not r.encoder_inputs:
            return n
        end = computed + n
        for i, (start, size, h) in enumerate(r.encoder_inputs):
            if start + size <= computed:
                continue
            if start >= end:
                break
            if self._config.disable_chunked_mm_input and computed <= start and end < start + size:
                return start - computed
            if self._encoder.reference(h, (r, i)):
                if not r.encoder_held[i]:
                    r.encoder_held[i] = True
                    st.newly.append(i)
                continue
            if not self._encoder.fits(size, st.budget):
                return min(n, start - computed) if computed < start else 0
            self._encoder.entries[h] = [size, [(r, i)]]
            st.budget -= size
            r.encoder_held[i] = True
            st.newly.append(i)
            st.pending.append((r, i))
        return n

    def _commit_encoder(self, st: _EncoderStep) -> None:
        self._stats["encoder_hits"] += max(0, len(st.newly) - len(st.pending))
        st.work += st.pending
        st.pending, st.newly = [], []

    def _rollback_encoder(self, st: _EncoderStep, r: _Request) -> None:
        """``r`` is not scheduled: the references its plan took go, its computes are refunded and dropped."""
        if not st.newly:
            return
        for i in st.newly:
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(r.encoder_inputs[i][2], (r, i))
        st.newly = []
        pending, st.pending = st.pending, []
        self._settle_uncomputed(st, pending, r, r)

    def _abandon_encoder(self, st: _EncoderStep, victim: _Request, current: _Request) -> None:
        """``victim`` is preempted in the step: its references go, its budget comes back, and the inputs it was
        to compute go to the first request still referencing them, or leave the cache."""
        if victim is current:
            st.newly = []
            removed, st.pending = st.pending, []
        else:
            removed = [w for w in st.work if w[0] is victim]
            st.work = [w for w in st.work if w[0] is not victim]
        self._release_all_encoder(victim)
        self._settle_uncomputed(st, removed, victim, current)

    def _settle_uncomputed(
        self, st: _EncoderStep, items: list[tuple[_Request, int]], owner: _Request, current: _Request
    ) -> None:
        inputs = [owner.encoder_inputs[i] for _, i in items]
        st.budget += sum(size for _, size, _ in inputs)
        for _, size, h in inputs:
            e = self._encoder.entries.get(h)
            if e is not None and e[1]:
                ref = e[1][0]
                st.budget -= size
                if ref[0] is current and owner is not current:
                    st.pending.append(ref)
                else:
                    st.work.append(ref)
            else:
                self._encoder.drop(h, False)

    def _release_consumed(self, r: _Request) -> None:
        """vLLM's _free_encoder_inputs: after a step, inputs ending at or before the computed tokens (less
        output placeholders) are released."""
        upto = max(0, r.num_computed_tokens - r.num_output_placeholders)
        for i, (start, size, h) in enumerate(r.encoder_inputs):
            if start + size > upto:
                break
            if r.encoder_held[i]:
                r.encoder_held[i] = False
                self._encoder.release(h, (r, i))

    # -- schedule ----------------------------------------------------------------------------------------

    def _preempt(self, r: _Request, drop_stale_output: bool = False) -> None:
        """Free ``r``'s KV and send it back to waiting. Output of steps still in flight becomes stale: applied
        when it arrives (dropped with ``drop_stale_output``), rolling nothing back; ``r`` is not resumed before."""
        self._free_blocks(r)
        self._release_all_encoder(r)
        r.num_lost_tokens = r.num_computed_tokens
        r.num_computed_tokens = 0
        r.drafts = []
        r.inflight_prefill = False
        r.status = RequestStatus.PREEMPTED
        r.num_preemptions += 1
        r.drop_stale_output = drop_stale_output or (r.drop_stale_output and r.num_stale_output_tokens > 0)
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        self._stats["preemptions"] += 1
        self._waiting.add_preempted(r)
        self._tenants[r.tenant].num_waiting += 1  # back in waiting; no lift (the tenant did not arrive)

    def _preempt_victim(self, r: _Request, computed_before: int | None, swap_out: list[int]) -> None:
        """Phase A's preemption: swap ``r``'s KV out (pairs appended to ``swap_out``) when the mode says so and
        the CPU pool can hold it, else recompute. ``computed_before``: its computed tokens before this step when
        it had been scheduled earlier in the step."""
        c, bs = self._config, self._bs
        computed = r.num_computed_tokens if computed_before is None else computed_before
        saved = min(computed, r.num_tokens - 1)  # never the last known token: it is computed next
        k = -(-saved // bs)
        wants = saved > 0 and r.num_in_flight_tokens == 0 and c.preemption_mode != "recompute"
        if wants and c.preemption_mode == "auto":
            # swap when copying out and back costs strictly less than recomputing the uncached context
            shared = sum(1 for b in r.block_ids[:k] if self._ref_cnt[b] > 1)  # stay resident: come back as hits
            uncached = max(0, saved - shared * bs)
            wants = self._swap_cost_per_block * (2 * k) < self._recompute_cost_per_token * uncached
        cpu: list[int] | None = None
        if wants:
            if k <= len(self._cpu_free):
                cpu = [self._cpu_free.popleft() for _ in range(k)]
                for g, cb in zip(r.block_ids[:k], cpu, strict=True):
                    swap_out += [g, cb]
            else:
                self._stats["swap_fallbacks"] += 1
        self._preempt(r)
        r.num_lost_tokens = computed
        if cpu is not None:
            r.cpu_blocks, r.num_swapped_tokens = cpu, saved
            self._stats["swapped_out_reqs"] += 1
            self._stats["swapped_out_blocks"] += k

    def _complete_resume(self, r: _Request, num_hits: int, restored: int, swap_in: list[int]) -> None:
        """After ``r``'s admission: swap-in pairs for its swapped blocks past the prefix hits (when the swapped
        tokens reach further), CPU blocks released, lost tokens not recovered counted as recomputed."""
        self._stats["recomputed_tokens"] += max(0, r.num_lost_tokens - restored)
        r.num_lost_tokens = 0
        if not r.cpu_blocks:
            return
        if r.num_swapped_tokens == restored:
            for i in range(num_hits, len(r.cpu_blocks)):
                swap_in += [r.cpu_blocks[i], r.block_ids[i]]
                self._stats["swapped_in_blocks"] += 1
        self._stats["swapped_in_reqs"] += 1
        self._cpu_free.extend(r.cpu_blocks)
        r.cpu_blocks, r.num_swapped_tokens = [], 0

    def set_preemption_costs(self, recompute_cost_per_token: float, swap_cost_per_block: float) -> None:
        """The auto mode's cost constants from now on (finite, >= 0). On error nothing changes."""
        costs = check_preemption_costs(
            recompute_cost_per_token, swap_cost_per_block, InvalidRequestError, SchedulerTypeError
        )
        self._recompute_cost_per_token, self._swap_cost_per_block = costs

    @property
    def preemption_costs(self) -> tuple[float, float]:
        return (self._recompute_cost_per_token, self._swap_cost_per_block)

    def get_cpu_block_ids(self, req_id: str) -> np.ndarray:
        return np.array(self._get(req_id).cpu_blocks, dtype=np.int32)

    def _pick_victim(self) -> int:
        """Index in running of the request to preempt: the tail (fcfs), the lowest-priority one (priority), or
        the last one whose tenant has the largest virtual counter (fair)."""
        if self._config.policy == "fcfs":
            return len(self._running) - 1
        if self._config.policy == "fair":
            counters = [self._tenants[r.tenant].counter for r in self._running]
            top = max(counters)
            return max(j for j, x in enumerate(counters) if x == top)
        keys = [(r.effective_priority, r.arrival_time) for r in self._running]
        return keys.index(max(keys))  # first in running order on ties

    # -- tenants (virtual token counters) ----------------------------------------------------------------

    def _tenant(self, name: str) -> _Tenant:
        """The tenant ``name``, registered (weight 1.0, counter 0) on first sight."""
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant(name, 1.0, self._config)
        return t

    def _on_arrival(self, t: _Tenant) -> None:
        """A new request of ``t`` is waiting: lift an idle tenant to the smallest counter of the others waiting."""
        if t.num_waiting == 0:
            others = [u.counter for u in self._tenants.values() if u is not t and u.num_waiting > 0]
            if others:
                t.counter = max(t.counter, min(others))
        t.num_waiting += 1

    def _charge(self, t: _Tenant, tokens: int, decode: bool) -> None:
        if tokens > 0:
            t.counter += (t.decode_rate if decode else t.prefill_rate) * tokens  # as the Rust core computes it
            if decode:
                t.num_decode_tokens += tokens
            else:
                t.num_prefill_tokens += tokens

    def _charge_prompt(self, r: _Request, start: int, n: int) -> None:
        """Charge the prompt positions in ``start..start + n`` not charged before (recompute is free)."""
        end = min(start + n, r.num_prompt_tokens)
        self._charge(self._tenants[r.tenant], max(0, end - max(start, r.num_charged_prompt_tokens)), False)
        r.num_charged_prompt_tokens = max(r.num_charged_prompt_tokens, end)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Change ``tenant``'s weight from now on (registering it if new); earlier charges stand."""
        check_tenant_weight(tenant, weight, InvalidRequestError)
        self._tenant(tenant).set_weight(float(weight), self._config)

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Every tenant seen so far, in registration order: weight, virtual counter, service received."""
        return {
            t.name: TenantStats(t.weight, t.counter, t.num_prefill_tokens, t.num_decode_tokens, t.num_waiting)
            for t in self._tenants.values()
        }

    # -- cache-aware admission (fcfs) --------------------------------------------------------------------

    def _begin_admission(self) -> list[_Request] | None:
        """Reorder the first ``window`` waiting requests for this step: warm peers, then cold peers, in the
        positions peers hold. Returns the original front, or None when nothing moved."""
        c = self._config
        usage = 1.0 - len(self._free) / c.num_usable_blocks
        if not c.cache_aware_admission_window or usage < c.cache_aware_admission_threshold:
            return None
        q = self._waiting
        assert isinstance(q, _FcfsQueue)  # the config allows a window with fcfs only
        original = list(itertools.islice(q, c.cache_aware_admission_window))
        peers = [k for k, r in enumerate(original) if r.status == RequestStatus.WAITING]
        warm = [k for k in peers if self._has_cached_prefix(original[k])]
        cold = [k for k in peers if k not in warm]
        source = list(range(len(original)))
        for slot, k in zip(peers, warm + cold, strict=True):
            source[slot] = k
        if source == sorted(source):
            return None
        q.replace_front([original[k] for k in source])
        return original

    def _has_cached_prefix(self, r: _Request) -> bool:
        """The admission probe: would at least one block hit? Reads the cache map only."""
        return not r.skip_reading_prefix_cache and bool(self._lookup(r.block_hashes, r.num_tokens)[:1])

    def _end_admission(self, original: list[_Request] | None) -> None:
        """Put the window's requests that are still in the waiting queue back in their original order (at its
        front: phase B puts the ones it skipped back there). Those it admitted left the queue, and so did those
        it admitted with an asynchronous KV load (to the KV-waiting queue, under ``park_kv_loads=False``)."""
        if original is None:
            return
        q = self._waiting
        assert isinstance(q, _FcfsQueue)
        in_queue = {id(r) for r in q}
        left = [r for r in original if id(r) in in_queue]
        if {id(r) for r in itertools.islice(q, len(left))} != {id(r) for r in left}:
            raise InternalError("the admission window's requests are not at the front of the queue")
        q.replace_front(left)

    @property
    def prefill_cadence(self) -> tuple[int, int, bool]:
        """``(num_executed_steps, last_prefill_step, prefill_capacity_bound)``."""
        return self._num_executed_steps, self._last_prefill_step, self._prefill_capacity_bound

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """One step: continue running requests (phase A, may preempt), then admit waiting ones (phase B).
        ``throttle_prefills`` (vLLM's data-parallel prefill balancing) and ``prefill_schedule_interval`` defer
        prefill compute while something decodes."""
        if not isinstance(throttle_prefills, bool):
            raise SchedulerTypeError(f"throttle_prefills must be a bool, got {type(throttle_prefills).__name__}")
        c = self._config
        if self._newly_ready:
            self._queue_newly_ready()
        look, num_spec = c.num_lookahead_tokens, c.num_spec_tokens
        budget = 0 if self._pause_state == "paused_all" else c.max_num_batched_tokens
        # the per-request cap applies only when more than one request is running or waiting (blocked ones too)
        num_eligible = len(self._requests)
        threshold = c.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and c.long_prefill_token_threshold_adaptive:  # floored at a fair share of the budget
            threshold = max(threshold, c.max_num_batched_tokens // num_eligible)
        # per scheduled request: [request, num_new_tokens, computed_before, new_blocks, drafts, kind, is_chunk]
        scheduled: list[list[Any]] = []
        preempted: list[_Request] = []
        swap_out: list[int] = []  # flattened (GPU block, CPU block) pairs
        swap_in: list[int] = []  # flattened (CPU block, GPU block) pairs
        prefill_scheduled = False  # a request scheduled in phase A is still prefilling
        interval = c.prefill_schedule_interval
        decoding = any(not r.is_prefill_chunk for r in self._running)
        defer = throttle_prefills and not self._prefill_capacity_bound and decoding
        if (
            not defer
            and interval > 1
            and not self._prefill_capacity_bound
            and (self._num_executed_steps + 1) - self._last_prefill_step < interval
            and decoding
        ):
            defer = True  # the local cadence: the interval since the last prefill-carrying step has not passed
        prefill_admitted = False
        self._newly_cached = []  # what updates cached since the previous step is not this step's
        enc = _EncoderStep(c.max_num_encoder_input_tokens)

        i = 0
        while i < len(self._running) and budget > 0:
            r = self._running[i]
            ph = r.num_output_placeholders
            if ph > 0 and r.num_computed_tokens + 2 - ph >= r.num_prompt_tokens + r.max_tokens:
                i += 1  # async: the steps in flight already produce its last token
                continue
            if defer and r.is_prefill_chunk:
                i += 1  # deferred prefill: its next chunk waits for a cadence-aligned step
                continue
            n = r.num_tokens + len(r.drafts) + ph - r.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, c.max_model_len - 1 - r.num_computed_tokens)
            n = min(n, c.max_slots_per_request - r.num_computed_tokens)  # a KV cache below max_model_len
            if n <= 0:
                i += 1
                continue
            if r.encoder_inputs:
                n = self._plan_encoder(enc, r, r.num_computed_tokens, n)
                if n == 0:
                    self._rollback_encoder(enc, r)
                    i += 1
                    continue
            while (new_blocks := self._allocate_slots(r, n, [], look)) is None:
                j = self._pick_victim()
                victim = self._running.pop(j)
                computed_before = None
                for k, entry in enumerate(scheduled):
                    if entry[0] is victim:  # refund the victim's share of this step
                        budget += entry[1]
                        computed_before = entry[2]
                        del scheduled[k]
                        break
                if j < i:
                    i -= 1
                self._abandon_encoder(enc, victim, r)
                self._preempt_victim(victim, computed_before, swap_out)
                preempted.append(victim)
                if victim is r:
                    break
            if new_blocks is None:
                # r preempted itself; the requests after it rank higher and may still fit
                if c.policy == "fair" or (c.policy == "priority" and c.continue_after_self_preemption):
                    continue
                break
            prefill_scheduled |= r.is_prefill_chunk
            if r.encoder_inputs:
                self._commit_encoder(enc)
            computed = r.num_computed_tokens
            num_drafts = min(len(r.drafts), max(0, computed + n - r.num_tokens - ph))
            is_chunk = computed + n < r.num_tokens + ph
            scheduled.append([r, n, computed, new_blocks, r.drafts[:num_drafts], "running", is_chunk])
            r.num_computed_tokens += n
            r.is_prefill_chunk = is_chunk
            r.drafts = []
            budget -= n
            i += 1

        for r, n, computed, *_ in scheduled:  # phase A is final: charge its prompt chunks, in order
            if computed < r.num_prompt_tokens:
                self._charge_prompt(r, computed, n)

        if not preempted and self._pause_state != "paused_all":
            # No probing when nobody can be admitted (a full batch or no budget): nothing would move.
            can_admit = budget > 0 and len(self._running) < (c.max_num_active_seqs or c.max_num_seqs)
            plan = self._begin_admission() if can_admit else None
            prefill_admitted = self._admit_waiting(scheduled, budget, threshold, prefill_scheduled, swap_in, defer, enc)
            self._end_admission(plan)
            if not defer:  # a released step: did it drain the waiting queue (skipped requests aside)?
                waiting = [r for r in self._requests.values() if r.status != RequestStatus.RUNNING]
                self._prefill_capacity_bound = len(waiting) > sum(1 for r in waiting if r.deferred)
        if any(e[1] for e in scheduled):
            self._num_executed_steps += 1
        if interval > 1 and (prefill_scheduled or prefill_admitted):
            self._last_prefill_step = self._num_executed_steps

        work = sorted(enc.work, key=lambda w: w[1])
        enc_ids: list[list[int]] = [[i for x, i in work if x is e[0]] for e in scheduled]
        enc_hashes = [e[0].encoder_inputs[i][2] for e, ids in zip(scheduled, enc_ids, strict=True) for i in ids]
        if sum(map(len, enc_ids)) != len(work):
            raise InternalError("an encoder input is computed by a request not in the step")
        self._stats["encoder_inputs"] += len(work)
        self._stats["encoder_tokens"] += sum(x.encoder_inputs[i][1] for x, i in work)
        entries = []
        for r, n, _, _, drafts, _, is_chunk in scheduled:
            r.num_in_flight_tokens += n
            if not is_chunk:
                r.inflight_prefill = False
            if c.async_scheduling and not is_chunk:  # placeholders for the token(s) this step samples
                r.num_output_placeholders += 1 + len(drafts)
                r.drafts = [-1] * num_spec
            entries.append((r, is_chunk, len(drafts)))
        out = SchedulerOutput(
            step_id=self._next_step_id,
            req_ids=[e[0].req_id for e in scheduled],
            num_scheduled_tokens=np.array([e[1] for e in scheduled], dtype=np.int32),
            num_computed_tokens=np.array([e[2] for e in scheduled], dtype=np.int32),
            new_req_ids=[e[0].req_id for e in scheduled if e[5] == "new"],
            resumed_req_ids=[e[0].req_id for e in scheduled if e[5] == "resumed"],
            new_block_ids=np.array([b for e in scheduled for b in e[3]], dtype=np.int32),
            new_block_ids_indptr=_indptr([len(e[3]) for e in scheduled]),
            spec_token_ids=np.array([t for e in scheduled for t in e[4]], dtype=np.int32),
            spec_token_ids_indptr=_indptr([len(e[4]) for e in scheduled]),
            total_num_scheduled_tokens=sum(e[1] for e in scheduled),
            preempted_req_ids=self._preempted_since_schedule + [r.req_id for r in preempted],
            finished_req_ids=self._finished_since_schedule,
            swap_out=np.array(swap_out, dtype=np.int32).reshape(-1, 2),
            swap_in=np.array(swap_in, dtype=np.int32).reshape(-1, 2),
            kv_connector_metadata=None,
            scheduled_encoder_inputs=np.array([i for ids in enc_ids for i in ids], dtype=np.int32),
            scheduled_encoder_inputs_indptr=_indptr([len(ids) for ids in enc_ids]),
            free_encoder_hashes=np.array(self._encoder.take_freed(), dtype=np.uint64),
            _encoder_hashes=enc_hashes,
            _owner=self._owner,
            _entries=entries,
            _cached_blocks=self._newly_cached,
            _swapped_out=[r for r in preempted if r.cpu_blocks],
        )
        self._newly_cached = []
        self._next_step_id += 1
        self._finished_since_schedule = []
        self._preempted_since_schedule = []
        self._last_out, self._last_out_fresh = out, True
        if self._connector is not None:
            self._after_hooks()
            if hasattr(self._connector, "build_connector_meta"):
                out.kv_connector_metadata = self._connector.build_connector_meta(out)
        return out

    def _admit_waiting(
        self,
        scheduled: list[list[Any]],
        budget: int,
        threshold: int,
        prefill_scheduled: bool,
        swap_in: list[int],
        defer: bool,
        enc: _EncoderStep,
    ) -> bool:
        """Phase B: admit waiting requests in policy order; never preempts. Requests whose KV load is over
        (``_kv_waiting``) go first, and are the only ones admitted when paused for new requests. Requests that
        cannot run yet are skipped and keep their place. With ``defer`` it stops at a request with prompt to
        compute. Returns whether it admitted one that has (vLLM's ``prefill_admitted``)."""
        prefill_admitted = False
        c, bs, look = self._config, self._bs, self._config.num_lookahead_tokens
        k = c.num_spec_tokens  # drafts per step: the padding of a new decode
        watermark = int(c.watermark * c.num_blocks)
        any_running_scheduled = bool(scheduled)
        counted = self._running if c.max_loras_counts_unscheduled else [e[0] for e in scheduled]
        loras = {r.lora_name for r in counted if r.lora_name is not None}
        skipped: list[_Request] = []
        skipped_kv: list[_Request] = []
        max_active = c.max_num_active_seqs or c.max_num_seqs
        while budget > 0 and len(self._running) < max_active:
            from_kv = len(self._kv_waiting) > 0
            if not from_kv and self._pause_state != "unpaused":
                break
            queue = self._kv_waiting if from_kv else self._waiting
            if not len(queue):
                break
            r = queue.peek()
            if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and r.grammar_ready:
                r.status = RequestStatus.WAITING
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.kv_load_done:
                self._promote_loaded(r)
            lora_blocked = (
                c.max_loras > 0 and len(loras) >= c.max_loras and r.lora_name is not None and r.lora_name not in loras
            )
            blocked = (
                r.status in (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS)
                or (r.num_stale_output_tokens > 0 and not r.drop_stale_output)
                or lora_blocked
            )
            ext, load_async = 0, False
            computed_before = r.num_computed_tokens
            hits: list[int] = []
            if not blocked and computed_before == 0:
                hits = [] if r.skip_reading_prefix_cache else self._lookup(r.block_hashes, r.num_tokens)
                if self._connector is not None and not r.cpu_blocks:  # a swapped-out request resumes from its copy
                    matched = self._hook_matched(r, len(hits) * bs)
                    if r.skip_reading_prefix_cache:
                        pass  # asked, but nothing is loaded for a request that skips reading the cache
                    elif matched is None:
                        blocked = True
                    else:
                        room = r.num_tokens - len(hits) * bs
                        ext = min(matched[0], room)
                        load_async = matched[1] and ext > 0
                        if not load_async and ext == room:
                            ext = room - 1  # a synchronous load leaves at least one token to compute
            if blocked:
                r.deferred = True
                queue.pop()
                # Back among the requests holding KV blocks if it holds some (vLLM's _holds_kv_blocks); a request
                # whose failed load left nothing goes back to `waiting`.
                holds_kv = (
                    r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.num_computed_tokens > 0 or bool(r.block_ids)
                )
                (skipped_kv if holds_kv else skipped).append(r)
                continue
            hit_tokens = len(hits) * bs
            restored = max(hit_tokens, r.num_swapped_tokens)  # swapped tokens come back by swap_in
            computed = computed_before if computed_before > 0 else restored + ext
            has_prefill = computed + 1 < r.num_tokens
            if defer and not load_async and has_prefill:
                break  # deferred prefill (an asynchronous load computes nothing this step)
            n = 0 if load_async else r.num_tokens - computed
            pad = False
            if not load_async:
                # spec decoding: one token left, admitted into a batch of decodes: pad with placeholder drafts
                pad = (
                    k > 0
                    and n == 1
                    and not prefill_scheduled
                    and (any_running_scheduled or computed > 0)
                    and computed + 1 + k + 1 <= c.max_model_len
                    and computed + 1 + k <= c.max_slots_per_request
                    and (threshold == 0 or threshold >= 1 + k)
                )
                if pad:
                    if 1 + k > budget:
                        break
                    n = 1 + k
                if 0 < threshold < n:
                    n = threshold
                if not c.enable_chunked_prefill and n > budget:
                    break
                n = min(n, budget)
            planned = not load_async and bool(r.encoder_inputs)
            if planned:
                n = self._plan_encoder(enc, r, computed, n)
                if n == 0:  # vLLM 0.33: its first encoder input does not fit: skipped, it keeps its place
                    self._rollback_encoder(enc, r)
                    r.deferred = True
                    (skipped_kv if from_kv else skipped).append(queue.pop())
                    continue
            reserved = watermark if self._running else 0
            if c.scheduler_reserve_full_isl and not self._full_sequence_fits(r, hits, reserved):
                if planned:
                    self._rollback_encoder(enc, r)
                break  # vLLM's full-prompt admission gate: the whole sequence must fit, not just this chunk
            # vLLM 0.33: an asynchronous load leaves free what the in-flight prefills still need.
            extra = self._inflight_reserved_blocks() if load_async and c.reserve_inflight_prefills else 0
            if computed_before == 0:
                r.num_computed_tokens = restored - hit_tokens  # _allocate_slots counts from computed + hits
            alloc_reserved = reserved + extra
            if self._allocate_slots(r, n, hits, 0 if load_async else look, alloc_reserved, ext, not load_async) is None:
                if computed_before == 0:
                    r.num_computed_tokens = 0
                if planned:
                    self._rollback_encoder(enc, r)
                break
            if planned:
                self._commit_encoder(enc)
            self._complete_resume(r, len(hits), computed, swap_in)
            if self._connector is not None:
                self._hook_after_alloc(r, ext)
                if computed_before == 0:
                    self._stats["connector_queries"] += r.num_tokens - hit_tokens
                    self._stats["connector_hits"] += ext
            if computed_before == 0 and not r.skip_reading_prefix_cache:  # no lookup, no query
                prefix = "preempted_" if r.num_preemptions > 0 else ""
                self._stats[prefix + "queries"] += r.num_tokens
                self._stats[prefix + "hits"] += hit_tokens
            queue.pop()
            if load_async:  # holds its blocks until the engine reports the load over
                r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                r.num_computed_tokens = computed
                r.kv_load_done = False
                r.inflight_prefill = True
                r.deferred = True
                # Parked, or (vLLM 0.33's rule) back with the skipped requests that hold KV blocks, at its place.
                r.parked = c.park_kv_loads
                if not c.park_kv_loads:
                    skipped_kv.append(r)
                continue
            self._tenants[r.tenant].num_waiting -= 1
            self._charge_prompt(r, computed, n)
            self._running.append(r)
            kind = "new" if r.status == RequestStatus.WAITING else "resumed"
            r.status = RequestStatus.RUNNING
            r.deferred = False
            if r.lora_name is not None:
                loras.add(r.lora_name)
            if r.num_cached_tokens < 0:
                r.num_cached_tokens = computed
            is_chunk = computed + n < r.num_tokens
            scheduled.append([r, n, computed, list(r.block_ids), [-1] * k if pad else [], kind, is_chunk])
            r.num_computed_tokens = computed + n
            r.is_prefill_chunk = is_chunk
            r.inflight_prefill |= is_chunk  # leaves the set after the step (vLLM's _update_after_schedule)
            budget -= n
            prefill_admitted |= has_prefill
        for r in reversed(skipped):  # back to the front in their order (fcfs), or by their key (priority)
            self._waiting.add_preempted(r)
        for r in reversed(skipped_kv):
            self._kv_waiting.add_preempted(r)
        return prefill_admitted

    def _inflight_reserved_blocks(self) -> int:
        """vLLM 0.33's _inflight_prefill_reserved_blocks + _spec_decode_step_blocks: what the in-flight prefills
        still need for their whole sequence (with spec decoding, plus a decode step's 1 + k + lookahead slots),
        plus one decode step's blocks."""
        c, bs = self._config, self._bs
        k = c.num_spec_tokens
        step = 1 + k + c.num_lookahead_tokens if k else 0
        total = -(-step // bs)
        for r in self._requests.values():
            if r.inflight_prefill:
                total += max(0, -(-(min(r.num_tokens, c.max_model_len) + step) // bs) - len(r.block_ids))
        return total

    def _promote_loaded(self, r: _Request) -> None:
        """A request whose asynchronous load is over becomes WAITING (PREEMPTED if it was preempted before): its
        loaded blocks enter the cache (after a failure only the valid prefix; with nothing valid its blocks are
        freed and it is admitted afresh), and a fully loaded prompt recomputes its last token."""
        if r.kv_load_failed and r.num_computed_tokens == 0:
            self._free_blocks(r)
        else:
            self._cache_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens -= 1
            if r.num_computed_tokens == 0 and r.block_ids:  # a one-token prompt: nothing left, admitted afresh
                self._free_blocks(r)
        r.kv_load_done = r.kv_load_failed = False
        r.status = RequestStatus.PREEMPTED if r.num_preemptions > 0 else RequestStatus.WAITING

    def _queue_newly_ready(self) -> None:
        """Queue the parked requests that became ready since the last step, in the order they were added:
        grammar-ready ones at the front of waiting, loaded ones into the loaded queue."""
        ready = sorted(self._newly_ready, key=lambda r: r.add_seq)
        self._newly_ready = []
        for r in reversed(ready):
            if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and r.parked:
                r.parked = False
                self._waiting.add_preempted(r)
        for r in ready:
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.parked:
                r.parked = False
                self._kv_waiting.add(r)

    # -- KV transfers ------------------------------------------------------------------------------------

    def update_kv_transfers(
        self,
        finished_recving: Iterable[str] | None = None,
        finished_sending: Iterable[str] | None = None,
        failed_recving: Iterable[str] | None = None,
        invalid_block_ids: Iterable[int] | None = None,
    ) -> list[str]:
        """Apply what the engine reports about KV transfers (vLLM's ``KVConnectorOutput``), in vLLM 0.33's
        order: failed loads, invalid blocks, then finished loads and sends. Validates everything first (nothing
        changes on error). Returns the requests finished because their load failed (policy ``fail``)."""
        recv = self._id_list(finished_recving, "finished_recving")
        send = self._id_list(finished_sending, "finished_sending")
        failed_ids = self._id_list(failed_recving, "failed_recving")
        invalid: list[int] = []
        if invalid_block_ids is not None:
            for b in _as_sequence(invalid_block_ids, "invalid_block_ids"):
                if not _is_int(b):
                    raise SchedulerTypeError(f"invalid_block_ids must hold ints, got {type(b).__name__}")
                if not 1 <= b < self._config.num_blocks:
                    raise InvalidRequestError(
                        f"invalid_block_ids: block ids must be in [1, {self._config.num_blocks}), got {b}"
                    )
                invalid.append(int(b))

        def loading(req_id: str, what: str) -> None:
            r = self._requests.get(req_id)
            if r is not None:
                if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or (what == "finished_recving" and r.kv_load_done):
                    raise InvalidRequestError(f"{what}: request {req_id!r} has no KV load in progress")
                return
            h = self._held.get(req_id)
            if h is None:
                raise UnknownRequestError(f"{what}: unknown request id {req_id!r}")
            if not h[1]:
                raise InvalidRequestError(f"{what}: finished request {req_id!r} has no such transfer in progress")

        for i in recv:
            loading(i, "finished_recving")
        for i in failed_ids:
            loading(i, "failed_recving")
        for i in send:
            h = self._held.get(i)
            if h is None:
                if i in self._requests:
                    raise InvalidRequestError(f"finished_sending: request {i!r} has not finished")
                raise UnknownRequestError(f"finished_sending: unknown request id {i!r}")
            if not h[2]:
                raise InvalidRequestError(f"finished_sending: request {i!r} is not being sent")

        self._last_out_fresh = False
        fail = self._config.kv_load_failure_policy == "fail"
        failed: list[_Request] = []
        for i in failed_ids:
            r = self._requests.get(i)
            if r is None:
                continue
            if fail:
                if r not in failed:
                    failed.append(r)
            else:
                r.num_computed_tokens = 0
                r.kv_load_failed = True
        if invalid:
            bad = set(invalid)
            loading_reqs = [r for r in self._requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
            for r in loading_reqs:
                n = math.ceil(r.num_computed_tokens / self._bs)
                idx = next((k for k, b in enumerate(r.block_ids[:n]) if b in bad), None)
                if idx is None:
                    continue
                if fail:
                    if r not in failed:
                        failed.append(r)
                else:
                    r.num_computed_tokens = idx * self._bs
                    r.kv_load_failed = True
        for r in failed:
            self._finish(r, RequestStatus.FINISHED_ERROR)
        for i in recv:
            r = self._requests.get(i)
            if r is not None:
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not r.kv_load_done:
                    r.kv_load_done = True
                    if r.parked:  # in kv_waiting already (park_kv_loads=False): it keeps its place
                        self._newly_ready.append(r)
            else:
                self._release_held(i, recv=True)
        for i in send:
            self._release_held(i, recv=False)
        self._transfer_params = {}
        self._after_hooks()
        return [r.req_id for r in failed]

    def _id_list(self, ids: Iterable[str] | None, what: str) -> list[str]:
        if ids is None:
            return []
        out = _as_sequence(ids, what)
        for i in out:
            if not isinstance(i, str):
                raise SchedulerTypeError(f"{what} must hold str ids, got {type(i).__name__}")
        return out

    def _release_held(self, req_id: str, recv: bool) -> None:
        h = self._held.get(req_id)
        if h is None:
            return
        h[1 if recv else 2] = False
        if not h[1] and not h[2]:
            del self._held[req_id]
            self._free_block_list(h[0])

    @property
    def num_held_kv_requests(self) -> int:
        """Finished requests whose blocks are still held for a KV transfer."""
        return len(self._held)

    # -- update ------------------------------------------------------------------------------------------

    def _check_output(self, out: object) -> SchedulerOutput:
        if not isinstance(out, SchedulerOutput):
            raise SchedulerTypeError(f"expected a SchedulerOutput, got {type(out).__name__}")
        if out._owner is not self._owner:
            raise InvalidOutputError("this output was produced by another scheduler")
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: Any, draft_token_ids: Any = None
    ) -> UpdateResult:
        """Apply the sampled tokens (and next drafts) of step ``out``; steps apply in order, once each."""
        out = self._check_output(out)
        if out.step_id != self._next_update_step:
            raise InvalidOutputError(
                f"step {out.step_id} cannot be applied now (expected step {self._next_update_step})"
            )
        n = len(out._entries)
        sampled = _ragged(sampled_token_ids, n, "sampled_token_ids")
        drafts = None if draft_token_ids is None else _ragged(draft_token_ids, n, "draft_token_ids")
        for k, (r, was_prefill_chunk, num_drafts) in enumerate(out._entries):
            if r.status.is_finished:
                continue  # gone since it was scheduled: whatever the entry holds is ignored
            entry, entry_drafts = sampled[k], drafts[k] if drafts is not None else []
            if was_prefill_chunk:
                if entry or entry_drafts:
                    raise InvalidOutputError(f"{r.req_id!r} was a prefill chunk: its entries must be empty")
            elif not 1 <= len(entry) <= 1 + num_drafts:
                raise InvalidOutputError(f"{r.req_id!r} needs 1..{1 + num_drafts} tokens, got {len(entry)}")
            if len(entry_drafts) > self._config.num_spec_tokens:
                raise InvalidOutputError(f"{r.req_id!r}: more drafts than num_spec_tokens")
            for t in itertools.chain(entry, entry_drafts):
                if not 0 <= t < _TOKEN_LIMIT:
                    raise InvalidOutputError(f"{r.req_id!r}: token id {t} out of [0, 2**31)")

        if drafts is not None and self._config.async_scheduling:
            raise InvalidOutputError("with async_scheduling the drafts stay with the runner: pass None")

        self._next_update_step += 1
        self._last_out_fresh = False
        spec_decoding = self._config.num_spec_tokens > 0
        finished: list[str] = []
        reasons: list[int] = []
        stop_reasons: list[int] = []
        num_new = np.zeros(n, dtype=np.int32)
        decode_tokens: dict[str, int] = {}  # per tenant, charged once at the end
        for k, (r, was_prefill_chunk, num_drafts) in enumerate(out._entries):
            if r.status.is_finished:
                continue
            num_scheduled = int(out.num_scheduled_tokens[k])
            r.num_in_flight_tokens -= num_scheduled
            stale = r.num_stale_output_tokens > 0  # scheduled before r was preempted
            if stale:
                r.num_stale_output_tokens = max(0, r.num_stale_output_tokens - num_scheduled)
                if r.drop_stale_output:
                    continue
            if was_prefill_chunk:
                self._release_consumed(r)  # vLLM frees consumed encoder inputs once the step has run
                continue
            entry = sampled[k]
            if num_drafts and not stale:  # roll back rejected drafts (placeholders too)
                rejected = num_drafts - (len(entry) - 1)
                if r.num_computed_tokens > 0:
                    r.num_computed_tokens = max(0, r.num_computed_tokens - rejected)
                if r.num_output_placeholders > 0:
                    r.num_output_placeholders = max(0, r.num_output_placeholders - rejected)
            self._release_consumed(r)
            was_running = r.status == RequestStatus.RUNNING
            had_placeholders = r.num_output_placeholders > 0
            stop: tuple[RequestStatus, FinishReason, int] | None = None
            for t in entry:
                r.token_ids.append(t)
                num_new[k] += 1
                stop = self._check_stop(r, t)
                if stop is not None:
                    break
            decode_tokens[r.tenant] = decode_tokens.get(r.tenant, 0) + int(num_new[k])
            self._update_block_hashes(r)
            if not stale:
                # A stop cuts the rest of the entry: computed covers only what was kept (with trim_computed_on_stop;
                # the blocks cached now never cover the cut tokens).
                cut = len(entry) - int(num_new[k]) if stop is not None else 0
                if self._config.trim_computed_on_stop:
                    r.num_computed_tokens = max(0, r.num_computed_tokens - cut)
                    cut = 0
                r.num_output_placeholders = max(0, r.num_output_placeholders - len(entry))
                if was_running and (had_placeholders or (spec_decoding and self._config.cache_drafts_at_update)):
                    self._cache_blocks(r, max(0, r.num_computed_tokens - cut - r.num_in_flight_tokens))
            if stop is not None:
                status, reason, stop_reason = stop
                self._finish(r, status)
                finished.append(r.req_id)
                reasons.append(reason)
                stop_reasons.append(stop_reason)
            elif drafts is not None and not stale:
                r.drafts = list(drafts[k])
        for name, tokens in decode_tokens.items():
            self._charge(self._tenants[name], tokens, True)
        params, self._transfer_params = self._transfer_params, {}
        self._after_hooks()
        return UpdateResult(
            finished_req_ids=finished,
            finish_reasons=np.array(reasons, dtype=np.int8),
            stop_reasons=np.array(stop_reasons, dtype=np.int64),
            num_new_tokens=num_new,
            kv_transfer_params=params,
        )

    def set_draft_token_ids(self, req_ids: Iterable[str], draft_token_ids: Any) -> None:
        """The drafts each request proposes for its next step (vLLM's ``update_draft_token_ids``): a request whose
        last step was a partial prefill gets none; -1 is an empty draft position (n-gram padding)."""
        if isinstance(req_ids, str):
            raise SchedulerTypeError("req_ids must be an iterable of str, not a single str")
        ids = _as_sequence(req_ids, "req_ids")
        drafts = _ragged(draft_token_ids, len(ids), "draft_token_ids")
        reqs: list[_Request] = []
        k = self._config.num_spec_tokens
        for req_id, entry in zip(ids, drafts, strict=True):  # in order: the first bad entry is reported
            r = self._get(req_id)
            reqs.append(r)
            if len(entry) > k:
                raise InvalidOutputError(f"request {r.req_id!r} may hold at most num_spec_tokens={k} draft tokens")
            for t in entry:
                if not -1 <= t < _TOKEN_LIMIT:
                    raise InvalidOutputError(f"draft token ids must be in [-1, 2**31), got {t}")
        for r, entry in zip(reqs, drafts, strict=True):
            r.drafts = [] if r.is_prefill_chunk else list(entry)

    def _check_stop(self, r: _Request, t: int) -> tuple[RequestStatus, FinishReason, int] | None:
        """The stop check after appending token ``t``, in vLLM 0.33's order: EOS, stop ids, length. min_tokens
        does not hold EOS or stop ids back here (the sampler masks them until then)."""
        if not r.ignore_eos and t == r.eos_token_id:
            return RequestStatus.FINISHED_STOPPED, FinishReason.STOP, -1
        if t in r.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, FinishReason.STOP, t
        if r.num_tokens >= self._config.max_model_len or r.num_output_tokens >= r.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH, -1
        return None

    # -- model inputs ------------------------------------------------------------------------------------

    def prepare_model_inputs(self, out: SchedulerOutput, *, dcp_rank: int | None = None) -> ModelInputs:
        """Flat runner inputs for the most recent step, valid until the scheduler next changes, as DCP rank
        ``dcp_rank`` (None: 0) sees them (only ``slot_mapping`` differs between ranks)."""
        c = self._config
        dcp_rank = 0 if dcp_rank is None else dcp_rank
        if isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int):
            raise SchedulerTypeError(f"dcp_rank must be an int, got {type(dcp_rank).__name__}")
        if not 0 <= dcp_rank < c.dcp_world_size:
            raise InvalidRequestError(f"dcp_rank must be in [0, dcp_world_size={c.dcp_world_size}), got {dcp_rank}")
        out = self._check_output(out)
        if out is not self._last_out or not self._last_out_fresh:
            raise InvalidOutputError("prepare_model_inputs needs the latest output, before other changes")
        bs, rank_bs, dcp, inter = self._bs, c.block_size, c.dcp_world_size, c.cp_kv_cache_interleave_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for k, (r, _, _) in enumerate(out._entries):
            start = int(out.num_computed_tokens[k])
            end = start + int(out.num_scheduled_tokens[k])
            drafts = out.spec_token_ids[out.spec_token_ids_indptr[k] : out.spec_token_ids_indptr[k + 1]]
            seq = r.token_ids + drafts.tolist()
            for pos in range(start, end):
                if pos < r.num_tokens:
                    tokens.append(r.token_ids[pos])
                elif self._config.async_scheduling:
                    tokens.append(-1)  # sampled by a step still in flight, or a draft placeholder: the runner's
                elif pos < len(seq):
                    tokens.append(seq[pos])
                else:
                    raise InvalidOutputError(f"{r.req_id!r}: token at position {pos} is not known yet")
                positions.append(pos)
                # vLLM's worker slot mapping: a block's tokens are dealt to the DCP ranks in runs of `inter`.
                off = pos % bs
                if (off // inter) % dcp == dcp_rank:
                    slots.append(r.block_ids[pos // bs] * rank_bs + off // (dcp * inter) * inter + off % inter)
                else:
                    slots.append(PAD_SLOT_ID)
            seq_lens.append(end)
            tables.append(r.block_ids)
        num_reqs = len(tables)
        width = max((len(t) for t in tables), default=0)
        block_table = np.zeros((num_reqs, width), dtype=np.int32)
        for k, t in enumerate(tables):
            block_table[k, : len(t)] = t
        query_start_loc = _indptr(out.num_scheduled_tokens.tolist())
        return ModelInputs(
            input_token_ids=np.array(tokens, dtype=np.int32),
            input_positions=np.array(positions, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int32),
            query_start_loc=query_start_loc,
            seq_lens=np.array(seq_lens, dtype=np.int32),
            block_table=block_table,
            logits_indices=(query_start_loc[1:] - 1).astype(np.int32),
            num_reqs=num_reqs,
            num_tokens=len(tokens),
            max_seq_len=max(seq_lens, default=0),
            max_query_len=int(out.num_scheduled_tokens.max(initial=0)),
        )

    # -- queries -----------------------------------------------------------------------------------------

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def num_unfinished_requests(self) -> int:
        """vLLM's get_num_unfinished_requests: 0 when paused for all, the running requests when paused for new."""
        if self._pause_state == "paused_all":
            return 0
        if self._pause_state == "paused_new":  # requests holding KV blocks (loading or loaded) still drain
            loading = sum(1 for r in self._requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
            loaded = sum(1 for r in self._kv_waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS)
            return len(self._running) + loading + loaded
        return len(self._requests)

    @property
    def pause_state(self) -> str:
        return self._pause_state

    def set_pause_state(self, state: str) -> None:
        """ "unpaused", "paused_new" (no admissions) or "paused_all" (nothing scheduled), from the next step."""
        if not isinstance(state, str):
            raise SchedulerTypeError(f"pause state must be a str, got {type(state).__name__}")
        if state not in ("unpaused", "paused_new", "paused_all"):
            raise InvalidRequestError(
                f"pause state must be one of ('unpaused', 'paused_new', 'paused_all'), got {state!r}"
            )
        if state != self._pause_state:
            self._pause_state = state
            self._last_out_fresh = False

    def set_ready(self, req_id: str) -> None:
        """The grammar of a request added with ``ready=False`` is ready; it stays WAITING_FOR_STRUCTURED_OUTPUT_
        GRAMMAR until an admission pass reaches it. No effect on a request that does not wait for a grammar."""
        r = self._get(req_id)
        if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and not r.grammar_ready:
            r.grammar_ready = True
            if r.parked:
                self._newly_ready.append(r)
            self._last_out_fresh = False

    def get_num_output_placeholders(self, req_id: str) -> int:
        return self._get(req_id).num_output_placeholders

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def get_block_ids(self, req_id: str) -> np.ndarray:
        return np.array(self._get(req_id).block_ids, dtype=np.int32)

    def get_block_hashes(self, req_id: str) -> list[bytes]:
        return list(self._get(req_id).block_hashes)

    def get_request_status(self, req_id: str) -> RequestStatus:
        return self._get(req_id).status

    def get_num_computed_tokens(self, req_id: str) -> int:
        return self._get(req_id).num_computed_tokens

    def get_output_token_ids(self, req_id: str) -> list[int]:
        r = self._get(req_id)
        return r.token_ids[r.num_prompt_tokens :]

    def running_req_ids(self) -> list[str]:
        return [r.req_id for r in self._running]

    def waiting_req_ids(self) -> list[str]:
        """Requests not running in the order admission would consider them (fair: at the current counters, as
        if admitting charged nothing; fcfs: before the admission window's one-step reordering): loaded requests
        first, then waiting, then the parked ones (blocked, or ready since the last step) in the order added."""
        ids: list[str] = []
        for q in (self._kv_waiting, self._waiting):
            waiting = list(q)
            if isinstance(q, _PriorityQueue):
                waiting.sort(key=lambda r: r.priority_key())
            elif isinstance(q, _FairQueue):
                waiting = q.in_order()
            ids += [r.req_id for r in waiting]
        parked = sorted((r for r in self._requests.values() if r.parked), key=lambda r: r.add_seq)
        return ids + [r.req_id for r in parked]

    def get_num_cached_blocks(self, req_id: str) -> int:
        return self._get(req_id).num_cached_blocks

    def get_num_cached_tokens(
        self, prompt_token_ids: Any, cache_salt: str | None = None, lora_name: str | None = None
    ) -> int:
        """Tokens a new request with this prompt would hit now; changes nothing (ref counts, LRU, stats)."""
        prompt = _int_array(prompt_token_ids, "prompt_token_ids")
        _check_tokens(prompt, "prompt_token_ids", InvalidRequestError)
        salt, lora = _opt_str(cache_salt, "cache_salt"), _opt_str(lora_name, "lora_name")
        if not self._config.enable_prefix_caching:
            return 0
        tokens = prompt.tolist()
        return len(self._lookup(self._block_hashes_of(tokens, salt, lora), len(tokens))) * self._bs

    def reset_prefix_cache(self, reset_running_requests: bool | None = False) -> bool:
        """Forget every cached block, but only when no usable block is in use. With ``reset_running_requests``
        every running request is first preempted from the tail (they resume in running order) and its in-flight
        output is dropped, so the reset succeeds."""
        reset_running_requests = (
            bool(reset_running_requests) if reset_running_requests is None else reset_running_requests
        )
        if not isinstance(reset_running_requests, bool):
            raise SchedulerTypeError("reset_running_requests must be a bool")
        if reset_running_requests and self._running:
            while self._running:
                r = self._running.pop()
                self._preempt(r, drop_stale_output=True)
                self._preempted_since_schedule.append(r.req_id)
            self._last_out_fresh = False
        if len(self._free) != self._config.num_usable_blocks:
            if reset_running_requests:
                if self._held or any(r.block_ids for r in self._requests.values()):
                    return False  # KV transfers hold blocks (vLLM raises: not supported yet)
                raise InternalError("the prefix cache is in use with no request running")
            return False
        self._cached.clear()
        self._block_hash = [None] * self._config.num_blocks
        self._last_out_fresh = False
        return True

    def stats(self) -> SchedulerStats:
        s, usable, c = self._stats, self._config.num_usable_blocks, self._config
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=sum(
                1 for r in self._requests.values() if r.status != RequestStatus.RUNNING and not r.deferred
            ),
            num_skipped_waiting_reqs=sum(1 for r in self._requests.values() if r.deferred),
            kv_cache_usage=1.0 - len(self._free) / usable,
            num_free_blocks=len(self._free),
            prefix_cache_queries=s["queries"],
            prefix_cache_hits=s["hits"],
            prefix_cache_preempted_queries=s["preempted_queries"],
            prefix_cache_preempted_hits=s["preempted_hits"],
            num_preemptions=s["preemptions"],
            num_finished_reqs=s["finished"],
            step_id=self._next_step_id,
            num_swapped_out_reqs=s["swapped_out_reqs"],
            num_swapped_out_blocks=s["swapped_out_blocks"],
            num_swapped_in_reqs=s["swapped_in_reqs"],
            num_swapped_in_blocks=s["swapped_in_blocks"],
            num_swap_fallbacks=s["swap_fallbacks"],
            num_recomputed_tokens=s["recomputed_tokens"],
            num_free_cpu_blocks=len(self._cpu_free),
            cpu_kv_cache_usage=1.0 - len(self._cpu_free) / c.num_cpu_blocks if c.num_cpu_blocks else 0.0,
            connector_prefix_cache_queries=s["connector_queries"],
            connector_prefix_cache_hits=s["connector_hits"],
            encoder_cache_usage=(
                (c.encoder_cache_size - self._encoder.num_free) / c.encoder_cache_size if c.encoder_cache_size else 0.0
            ),
            num_encoder_cache_entries=len(self._encoder.entries),
            num_encoder_inputs_computed=s["encoder_inputs"],
            num_encoder_tokens_computed=s["encoder_tokens"],
            encoder_cache_hits=s["encoder_hits"],
        )

    # -- invariants --------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise :class:`InternalError` if any internal invariant is broken. O(state); for tests."""

        def require(cond: bool, what: str) -> None:
            if not cond:
                raise InternalError(f"invariant broken: {what}")

        c, bs = self._config, self._bs
        free = list(self._free)
        require(len(free) == len(self._free) == len(set(free)), "free queue length / duplicates")
        require(all(1 <= b < c.num_blocks and b in self._free for b in free), "free queue ids")
        holders = [0] * c.num_blocks
        for r in self._requests.values():
            require(len(set(r.block_ids)) == len(r.block_ids), f"{r.req_id}: a block twice in one table")
            for b in r.block_ids:
                holders[b] += 1
        for req_id, (blocks, awaiting_recv, awaiting_send) in self._held.items():
            require(awaiting_recv or awaiting_send, f"{req_id}: held blocks for no transfer")
            require(req_id not in self._requests, f"{req_id}: live and held")
            for b in blocks:
                holders[b] += 1
        require(self._ref_cnt == holders, "ref_cnt == number of block tables holding the block")
        require(holders[0] == 0 and 0 not in self._free and self._block_hash[0] is None, "null block")
        for b in range(1, c.num_blocks):
            require((b in self._free) == (self._ref_cnt[b] == 0), f"block {b}: free xor referenced")
        require(len(free) + sum(1 for h in holders if h) == c.num_usable_blocks, "blocks conserved")
        hashed = {b for b in range(c.num_blocks) if self._block_hash[b] is not None}
        in_map = [(h, b) for h, blocks in self._cached.items() for b in blocks]
        require(all(blocks for blocks in self._cached.values()), "no empty cache-map entries")
        require(all(self._block_hash[b] == h for h, b in in_map), "cache map entry matches the block's hash")
        require(len(in_map) == len(hashed) == len({b for _, b in in_map}), "every hashed block is in the map")

        waiting = list(self._waiting)
        require(len(waiting) == len(self._waiting), "waiting count")
        kv_waiting = list(self._kv_waiting)
        require(len(kv_waiting) == len(self._kv_waiting), "kv_waiting count")
        parked = [r for r in self._requests.values() if r.parked]
        not_running = [r for r in self._requests.values() if r.status != RequestStatus.RUNNING]
        for t in self._tenants.values():
            n = sum(r.tenant == t.name for r in not_running)
            require(t.num_waiting == n, f"tenant {t.name}: waiting count")
            require(t.counter >= 0, f"tenant {t.name}: counter")
        require(all(r.parked for r in self._newly_ready), "newly ready requests are parked")
        for r in parked:
            blocked = (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS)
            require(r.status in blocked, f"{r.req_id}: parked with status {r.status!r}")
        for r in kv_waiting:
            require(r.status != RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, f"{r.req_id}: kv_waiting")
            require(
                r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or r.kv_load_done or not self._config.park_kv_loads,
                f"{r.req_id}: loading",
            )
            require(r.num_computed_tokens <= len(r.block_ids) * bs, f"{r.req_id}: computed tokens without KV")
        placed = [id(r) for r in self._running + waiting + kv_waiting + parked]
        require(len(placed) == len(set(placed)), "a request in two places")
        require(set(placed) == {id(r) for r in self._requests.values()}, "every request in exactly one place")
        require(len(self._running) <= c.max_num_seqs, "len(running) <= max_num_seqs")
        for r in self._running:
            require(r.status == RequestStatus.RUNNING, f"{r.req_id} in running with status {r.status!r}")
            require(r.num_computed_tokens <= len(r.block_ids) * bs, f"{r.req_id}: computed tokens without KV")
            for i in range(r.num_cached_blocks):
                require(self._block_hash[r.block_ids[i]] == r.block_hashes[i], f"{r.req_id}: block {i} hash")
        waiting_statuses = (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
        )
        for r in waiting:
            require(r.status in waiting_statuses, f"{r.req_id}: status")
            require(not r.block_ids and r.num_computed_tokens == 0, f"{r.req_id} waiting with KV")
            require(r.num_output_placeholders == 0, f"{r.req_id} waiting with output placeholders")
        for r in self._running:
            require(not r.deferred, f"{r.req_id} running but deferred")
        cpu_held = [b for r in self._requests.values() for b in r.cpu_blocks]
        require(sorted(cpu_held + list(self._cpu_free)) == list(range(c.num_cpu_blocks)), "CPU blocks: each once")
        for r in self._requests.values():
            require(bool(r.cpu_blocks) == (r.num_swapped_tokens > 0), f"{r.req_id}: CPU blocks vs swapped tokens")
            if r.cpu_blocks:
                require(r.status == RequestStatus.PREEMPTED and not r.block_ids, f"{r.req_id}: swapped but not waiting")
                require(len(r.cpu_blocks) == -(-r.num_swapped_tokens // bs), f"{r.req_id}: CPU blocks cover its KV")
                require(r.num_swapped_tokens < r.num_tokens, f"{r.req_id}: swapped more than it has")
        for r in self._requests.values():
            require(0 <= r.num_stale_output_tokens <= r.num_in_flight_tokens, f"{r.req_id}: stale tokens")
        for r in self._requests.values():
            expect = r.num_tokens // bs if c.enable_prefix_caching else 0
            require(len(r.block_hashes) == expect, f"{r.req_id}: one hash per full block")
        enc = self._encoder
        require(0 <= enc.num_free <= enc.capacity, "encoder cache: occupied within the capacity")
        unreferenced = {h for h, e in enc.entries.items() if not e[1]}
        require(set(enc.freeable) == unreferenced, "encoder: freeable = unreferenced")
        refs = sorted((h, x.req_id, i) for h, e in enc.entries.items() for x, i in e[1])
        held = sorted(
            (r.encoder_inputs[i][2], r.req_id, i)
            for r in self._requests.values()
            for i, f in enumerate(r.encoder_held)
            if f
        )
        require(refs == held, "encoder cache references = the inputs requests hold")
        for r in self._requests.values():
            require(r.status == RequestStatus.RUNNING or not any(r.encoder_held), f"{r.req_id}: holds encoder entries")
        out = self._last_out
        if out is not None:
            require(out.total_num_scheduled_tokens <= c.max_num_batched_tokens, "token budget respected")
            require(len(out.req_ids) <= c.max_num_seqs, "max_num_seqs respected")
            require(bool(np.all(out.num_scheduled_tokens > 0)), "every scheduled request computes >= 1 token")


def _encoder_inputs(x: object) -> list[tuple[int, int, int]]:
    """``encoder_inputs``: None, or a list/tuple of (start, num_tokens, hash) lists/tuples, or an (m, 3) int array."""
    if x is None:
        return []
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise SchedulerTypeError(f"encoder_inputs must be a list of (start, num_tokens, hash), got {type(x).__name__}")
    out = []
    for i, item in enumerate(x):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise SchedulerTypeError(f"encoder_inputs[{i}] must be a (start, num_tokens, hash) triple")
        if not all(_is_int(v) for v in item):
            raise SchedulerTypeError(f"encoder_inputs[{i}] must hold ints")
        start, size, h = (int(v) for v in item)
        if not (0 <= start < 2**31 and 0 <= size < 2**31):
            raise InvalidRequestError(f"encoder_inputs[{i}]: start and num_tokens must be in [0, 2**31)")
        if not 0 <= h < 2**64:
            raise InvalidRequestError(f"encoder_inputs[{i}]: hash must be in [0, 2**64)")
        out.append((start, size, h))
    return out


def _as_sequence(x: object, what: str) -> list[Any]:
    """An iterable argument as a list; a str, bytes or non-iterable is a SchedulerTypeError."""
    if isinstance(x, (str, bytes)):
        raise SchedulerTypeError(f"{what} must be an iterable of ids, not a single {type(x).__name__}")
    try:
        return list(x)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise SchedulerTypeError(f"{what} must be iterable, got {type(x).__name__}") from None


def _to_float(x: Any) -> float:
    try:
        return float(x)
    except OverflowError:  # an int beyond the float range
        return math.inf


def _indptr(counts: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int32)


def _blake2b_128(data: bytes) -> Any:
    """Stand-in for xxh3-128 (not in the stdlib): a 16-byte BLAKE2b digest."""
    return hashlib.blake2b(data, digest_size=16)


def _seed_bytes(seed: int | str | bytes) -> bytes:
    """Type-tagged bytes of a fixed ``prefix_hash_seed``."""
    if isinstance(seed, bytes):
        return b"b" + seed
    if isinstance(seed, str):
        return b"s" + seed.encode()
    return b"i" + str(seed).encode()
