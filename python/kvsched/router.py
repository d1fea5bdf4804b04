"""Route requests across engine replicas by what each one has in its prefix cache.

A :class:`Router` keeps, per replica, the prefix blocks it has cached (fed by its block events: stored, removed,
cleared, in the shape of vLLM's KV cache events) and its load (waiting and running requests, queued prefill
tokens, KV usage), and picks a replica for each request with one of five policies:

- ``round_robin``: in turn;
- ``least_loaded``: fewest waiting + running requests, then lowest KV usage;
- ``cache_aware``: vllm-router's and SGLang's rule: the longest cached prefix when it covers more than
  ``cache_threshold`` of the prompt, else the replica caching the least; least loaded whenever the busiest replica
  has more than ``balance_abs_threshold`` requests over the idlest and more than ``balance_rel_threshold`` times as
  many;
- ``kv_overlap``: the best weighted score of cached share of the prompt, waiting queue and free KV cache, as
  llm-d's scorers (weights 3 / 2 / 2);
- ``predictive``: the lowest estimated time to first token, from the replica's queue, its running requests and
  its cached prefix, priced by a step-time model (:mod:`kvsched.sim.steptime`).

The index is Rust (``rust/kvsched-router``); a decision at 16 replicas x 100k cached blocks takes microseconds
(``benches/test_bench_router.py``, docs/routing.md).

A prompt is looked up by the chain of its block hashes, computed one of two ways:

- from its token ids, with kvsched's chained block hash: give the router the replicas' ``block_size``,
  ``prefix_hash_algo`` and ``prefix_hash_seed`` so that its hashes are theirs;
- given by the caller (``block_hashes=``), e.g. computed with vLLM's own hash function for vLLM replicas.

A block hash is an int or bytes; bytes become an int as vLLM makes its int hashes
(``int.from_bytes(h, "big") & (2**64 - 1)``), so vLLM events with either form, and kvsched's
``Scheduler.get_block_hashes``, all name blocks the same way (:func:`block_key`).

>>> from kvsched.router import BlockStored, Router, RouterConfig
>>> router = Router(RouterConfig(policy="cache_aware", block_size=4), replicas=["a", "b"])
>>> router.apply_events("b", [BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[], block_size=4)])
>>> d = router.route("req-0", block_hashes=[11, 12, 13])
>>> d.replica, d.reason, d.num_overlap_blocks
('b', 'cache_hit', 2)
>>> router.finish("req-0")
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._errors import (
    DuplicateReplicaError,
    InvalidRequestError,
    NoReplicaAvailableError,
    SchedulerTypeError,
    UnknownReplicaError,
)
from .config import DEFAULT_BLOCK_SIZE
from .kv_events import STORED, AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, KVCacheEvents
from .sim.steptime import DEFAULT_PRESET, PRESETS, StepTimeModel

__all__ = [
    "POLICIES",
    "AllBlocksCleared",
    "BlockEvent",
    "BlockRemoved",
    "BlockStored",
    "DuplicateReplicaError",
    "NoReplicaAvailableError",
    "ReplicaLoad",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "UnknownReplicaError",
    "block_key",
]

Policy = Literal["round_robin", "least_loaded", "cache_aware", "kv_overlap", "predictive"]
POLICIES: tuple[Policy, ...] = ("round_robin", "least_loaded", "cache_aware", "kv_overlap", "predictive")

BlockHashLike = int | bytes
_MASK64 = (1 << 64) - 1


def _default_step_time() -> StepTimeModel:
    return PRESETS[DEFAULT_PRESET]


@dataclass(frozen=True)
class RouterConfig:
    """How a :class:`Router` hashes prompts and chooses replicas. Checked when the router is built
    (:class:`~kvsched.InvalidConfigError` for a bad value).

    ``block_size``, ``prefix_hash_algo`` and ``prefix_hash_seed`` must be the replicas' own (their
    ``SchedulerConfig`` fields) for token prompts to find the blocks the replicas report; with
    ``prefix_hash_seed=None`` the router draws a random seed, and token prompts only match what the router itself
    recorded (``record_routed_prefixes``). ``step_time`` prices the ``predictive`` policy: the default is
    :mod:`kvsched.sim.steptime`'s default preset (a roofline estimate for Llama-3.1-8B on an H100); give a
    calibrated model (``kvsched simulate --calibrate``) for your hardware. ``max_num_batched_tokens`` is the
    replicas' token budget per step, for the same estimate.

    ``sticky_sessions``: a request with a ``session_id`` goes to the replica that the previous request with that
    ``session_id`` went to, while that replica is healthy, among the candidates, and not overloaded by the balance
    rule (more than ``balance_abs_threshold`` requests over the idlest candidate and more than
    ``balance_rel_threshold`` times as many); at most ``max_sessions`` ids are remembered, least recently used
    forgotten first.

    ``record_routed_prefixes``: count a routed prompt's full blocks as cached on its replica at once, as routers
    that guess the cache from the requests they routed do; for replicas that publish no block events (evictions
    are then unknown to the router).
    """

    policy: Policy = "cache_aware"
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_hash_algo: Literal["xxh3_128", "sha256"] = "xxh3_128"
    prefix_hash_seed: int | str | bytes | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    overlap_weight: float = 3.0
    queue_weight: float = 2.0
    kv_usage_weight: float = 2.0
    step_time: StepTimeModel = field(default_factory=_default_step_time)
    max_num_batched_tokens: int = 8192
    sticky_sessions: bool = False
    max_sessions: int = 100_000
    record_routed_prefixes: bool = False


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's load as the policies see it: the last :meth:`Router.update_load` snapshot plus the requests
    routed to it since (waiting until :meth:`Router.prefill_done`, then running, gone at :meth:`Router.finish`)."""

    num_waiting: int
    num_running: int
    num_waiting_tokens: int
    num_running_tokens: int
    kv_usage: float


@dataclass(frozen=True)
class RouteDecision:
    """Where a request went and what the router knew: the replica's cached prefix of the prompt in blocks, the
    prompt's full blocks and tokens, the predictive estimate of its time to first token there (whatever the
    policy), and why (``reason``: ``round_robin``, ``least_loaded``, ``cache_hit``, ``smallest_cache``,
    ``imbalanced``, ``score``, ``ttft``, ``sticky`` or ``assigned``)."""

    replica: str
    reason: str
    num_overlap_blocks: int
    num_prompt_blocks: int
    num_prompt_tokens: int
    estimated_ttft_s: float


def block_key(block_hash: BlockHashLike) -> int:
    """The 64-bit key the router names a block by: an int as it is (negative ints, from a signed 64-bit hash,
    wrap to their two's complement), bytes as vLLM turns its hashes into ints: the last 8 bytes, big-endian."""
    if isinstance(block_hash, bool):
        raise SchedulerTypeError("a block hash must be an int or bytes, got bool")
    if isinstance(block_hash, int):
        if not -(1 << 63) <= block_hash <= _MASK64:
            raise InvalidRequestError(f"a block hash must fit in 64 bits, got {block_hash}")
        return block_hash & _MASK64
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(block_hash)[-8:], "big")
    if isinstance(block_hash, np.integer):
        return block_key(int(block_hash))
    raise SchedulerTypeError(f"a block hash must be an int or bytes, got {type(block_hash).__name__}")


def _keys(block_hashes: Any) -> npt.NDArray[np.uint64]:
    if isinstance(block_hashes, np.ndarray):
        if block_hashes.ndim != 1 or block_hashes.dtype.kind not in "iu":
            raise SchedulerTypeError(f"block_hashes must be a 1-D integer array, got {block_hashes.dtype}")
        if block_hashes.dtype == np.uint64:
            return np.ascontiguousarray(block_hashes)
        return np.ascontiguousarray(block_hashes.astype(np.int64).view(np.uint64))
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Iterable):
        raise SchedulerTypeError(f"block_hashes must be a sequence of ints or bytes, got {type(block_hashes).__name__}")
    return np.array([block_key(h) for h in block_hashes], dtype=np.uint64)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SchedulerTypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


_KINDS = {"BlockStored": 0, "BlockRemoved": 1, "AllBlocksCleared": 2}


def _decision(t: tuple[str, str, int, int, int, float]) -> RouteDecision:
    return RouteDecision(*t)


class Router:
    """The router: replicas, their cached blocks and load, the requests in flight, and the decisions.

    Every call that fails raises a :class:`~kvsched.SchedulerError` subclass and changes nothing:
    :class:`~kvsched.router.UnknownReplicaError` (a ``KeyError``) for a replica not registered,
    :class:`~kvsched.router.DuplicateReplicaError` for one registered twice,
    :class:`~kvsched.router.NoReplicaAvailableError` when no healthy replica can take a request,
    :class:`~kvsched.UnknownRequestError` / :class:`~kvsched.DuplicateRequestError` for request ids not in flight
    / already in flight, :class:`~kvsched.InvalidRequestError` for a bad prompt or event,
    :class:`~kvsched.SchedulerTypeError` for an argument of the wrong type. At most 128 replicas at a time.
    """

    def __init__(self, config: RouterConfig | None = None, replicas: Iterable[str] = ()) -> None:
        from . import _core

        self._config = RouterConfig() if config is None else config
        if not isinstance(self._config, RouterConfig):
            raise SchedulerTypeError(f"config must be a RouterConfig, got {type(self._config).__name__}")
        self._native = _core.Router(self._config)
        for r in replicas:
            self._native.add_replica(r)

    @property
    def config(self) -> RouterConfig:
        return self._config

    def __repr__(self) -> str:
        return repr(self._native)

    # -- replicas ----------------------------------------------------------------------------------------------

    def add_replica(self, replica: str) -> None:
        """A new healthy replica with an empty cache."""
        self._native.add_replica(replica)

    def remove_replica(self, replica: str) -> list[str]:
        """The replica is lost: its cached blocks, load and sessions are forgotten. Returns the ids of the requests
        routed to it and not finished, in routing order; they are no longer in flight, so route them again."""
        return self._native.remove_replica(replica)

    def set_healthy(self, replica: str, healthy: bool) -> None:
        """An unhealthy replica keeps its index and in-flight requests but gets no new requests."""
        self._native.set_healthy(replica, healthy)

    @property
    def replicas(self) -> list[str]:
        """Registered replicas, in the order ties between them are broken (lowest slot first)."""
        return [name for name, _ in self._native.replicas()]

    @property
    def healthy_replicas(self) -> list[str]:
        return [name for name, healthy in self._native.replicas() if healthy]

    # -- what the replicas report ------------------------------------------------------------------------------

    def apply_events(self, replica: str, events: Iterable[Any]) -> None:
        """Applies a replica's block events in order: :class:`BlockStored`, :class:`BlockRemoved`,
        :class:`AllBlocksCleared`, or vLLM's classes of the same names (``KVEventBatch.events``). Events for another
        medium than the GPU (``medium`` not None or ``"GPU"``: offloaded copies) are skipped. Duplicates, removals
        of blocks never stored and children before parents are all fine (events are set updates). An event that
        carries ``num_copies`` (kvsched's) changes the set only where the count says the hash entered (1 copy) or
        left (0 copies) the cache; one without (vLLM's) stores and removes every block it names. A batch with a
        bad event (a ``block_size`` that is not the router's, token ids that do not fill the blocks) applies
        none. For a whole :class:`~kvsched.kv_events.KVCacheEvents` batch use :meth:`apply_scheduler_events`."""
        kinds: list[int] = []
        hashes: list[npt.NDArray[np.uint64]] = []
        hashes_indptr = [0]
        parents: list[int] = []
        has_parent: list[bool] = []
        tokens: list[Any] = []
        tokens_indptr = [0]
        block_sizes: list[int] = []
        for ev in events:
            kind = _KINDS.get(type(ev).__name__)
            if kind is None:
                raise SchedulerTypeError(
                    f"an event must be a BlockStored, BlockRemoved or AllBlocksCleared, got {type(ev).__name__}"
                )
            if getattr(ev, "medium", None) not in (None, "GPU"):
                continue
            kinds.append(kind)
            parent = ev.parent_block_hash if kind == 0 else None
            has_parent.append(parent is not None)
            parents.append(0 if parent is None else block_key(parent))
            block_sizes.append(_int(ev.block_size, "block_size") if kind == 0 else 0)
            keys = _keys(ev.block_hashes) if kind != 2 else np.zeros(0, dtype=np.uint64)
            copies = getattr(ev, "num_copies", None) if kind != 2 else None
            whole = True  # every block of the event changes the set (its tokens still match its blocks)
            if copies is not None:
                n = np.asarray(copies)
                if n.shape != keys.shape or n.dtype.kind not in "iu":
                    raise InvalidRequestError("an event's num_copies must be one int per block")
                keep = n == 1 if kind == 0 else n == 0
                whole = bool(keep.all())
                keys = keys[keep]
            hashes.append(keys)
            hashes_indptr.append(hashes_indptr[-1] + len(keys))
            if kind == 0 and whole and len(ev.token_ids):
                t = np.asarray(ev.token_ids)
                if t.ndim != 1 or t.dtype.kind not in "iu":
                    raise SchedulerTypeError(f"an event's token_ids must be ints, got {t.dtype}")
                tokens.append(t.astype(np.int64, copy=False))
                tokens_indptr.append(tokens_indptr[-1] + len(t))
            else:
                tokens_indptr.append(tokens_indptr[-1])
        token_arr = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
        self._native.apply_events(
            replica,
            np.array(kinds, dtype=np.uint8),
            np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64),
            np.array(hashes_indptr, dtype=np.int64),
            np.array(parents, dtype=np.uint64),
            np.array(has_parent, dtype=np.bool_),
            token_arr,
            np.array(tokens_indptr, dtype=np.int64),
            np.array(block_sizes, dtype=np.int64),
        )

    def apply_scheduler_events(self, replica: str, events: KVCacheEvents) -> None:
        """Applies a batch a kvsched scheduler's ``take_kv_cache_events()`` returned: its stored blocks whose hash
        was not cached before (one copy after the store), its removed blocks whose hash left the cache (no copy
        after the removal), its clears, in order. The block keys are the scheduler's hashes as
        :func:`block_key` names them, the keys a token prompt finds when the router's ``block_size``,
        ``prefix_hash_algo`` and ``prefix_hash_seed`` are the scheduler's. The batch's ``block_size`` must be
        the router's (:class:`~kvsched.InvalidRequestError` otherwise, nothing applied)."""
        if not isinstance(events, KVCacheEvents):
            raise SchedulerTypeError(f"events must be a KVCacheEvents, got {type(events).__name__}")
        keep, indptr = events.set_updates()
        n = len(events)
        self._native.apply_events(
            replica,
            np.ascontiguousarray(events.kinds, dtype=np.uint8),
            np.ascontiguousarray(events.block_keys()[keep]),
            indptr,
            events.parent_keys(),
            np.ascontiguousarray(events.has_parent, dtype=np.bool_),
            np.zeros(0, dtype=np.int64),
            np.zeros(n + 1, dtype=np.int64),
            np.where(events.kinds == STORED, events.block_size, 0).astype(np.int64),
        )

    def update_load(
        self,
        replica: str,
        *,
        num_waiting: int = 0,
        num_running: int = 0,
        num_waiting_tokens: int = 0,
        num_running_tokens: int = 0,
        kv_usage: float = 0.0,
    ) -> None:
        """A snapshot of the replica's load (e.g. from its scheduler's stats): waiting and running requests, the
        prompt tokens the waiting ones still have to compute, the context tokens of the running ones, and the
        used share of its KV cache in [0, 1]. It supersedes the requests the router counted since the last one."""
        self._native.update_load(replica, num_waiting, num_running, num_waiting_tokens, num_running_tokens, kv_usage)

    # -- decisions ---------------------------------------------------------------------------------------------

    def route(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        *,
        block_hashes: Sequence[BlockHashLike] | npt.NDArray[np.integer[Any]] | None = None,
        num_prompt_tokens: int | None = None,
        session_id: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        candidates: Sequence[str] | None = None,
    ) -> RouteDecision:
        """Chooses a healthy replica (among ``candidates`` if given) and keeps the request in flight there until
        :meth:`finish`. The prompt is ``prompt_token_ids`` (hashed with ``lora_name`` / ``cache_salt`` as the
        replicas' scheduler would) or ``block_hashes`` (its full blocks; ``num_prompt_tokens`` defaults to their
        token count)."""
        hashes = None if block_hashes is None else _keys(block_hashes)
        cands = None if candidates is None else list(candidates)
        return _decision(
            self._native.route(
                req_id, prompt_token_ids, hashes, num_prompt_tokens, lora_name, cache_salt, session_id, cands
            )
        )

    def rank(
        self,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        *,
        block_hashes: Sequence[BlockHashLike] | npt.NDArray[np.integer[Any]] | None = None,
        num_prompt_tokens: int | None = None,
        session_id: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        candidates: Sequence[str] | None = None,
    ) -> list[str]:
        """The healthy candidates, most preferred first, without routing anything (for a caller that sends the
        request itself and then reports where with :meth:`assign`)."""
        hashes = None if block_hashes is None else _keys(block_hashes)
        cands = None if candidates is None else list(candidates)
        names, _ = self._native.rank(
            prompt_token_ids, hashes, num_prompt_tokens, lora_name, cache_salt, session_id, cands
        )
        return names

    def assign(
        self,
        req_id: str,
        replica: str,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        *,
        block_hashes: Sequence[BlockHashLike] | npt.NDArray[np.integer[Any]] | None = None,
        num_prompt_tokens: int | None = None,
        session_id: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> RouteDecision:
        """Records that the request was sent to ``replica`` (chosen from :meth:`rank` or otherwise): as
        :meth:`route` without the choice."""
        hashes = None if block_hashes is None else _keys(block_hashes)
        return _decision(
            self._native.assign(
                req_id, replica, prompt_token_ids, hashes, num_prompt_tokens, lora_name, cache_salt, session_id
            )
        )

    def prefill_done(self, req_id: str) -> None:
        """The request's prompt is computed (its first token came back): from now on it counts as running."""
        self._native.prefill_done(req_id)

    def finish(self, req_id: str) -> None:
        """The request is over (finished, aborted or failed): it leaves its replica's load."""
        self._native.finish(req_id)

    # -- introspection -----------------------------------------------------------------------------------------

    def load(self, replica: str) -> ReplicaLoad:
        return ReplicaLoad(*self._native.load(replica))

    def num_cached_blocks(self, replica: str) -> int:
        return self._native.num_cached_blocks(replica)

    def overlaps(
        self,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        *,
        block_hashes: Sequence[BlockHashLike] | npt.NDArray[np.integer[Any]] | None = None,
        num_prompt_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, int]:
        """The longest cached prefix of the prompt, in blocks, on every registered replica."""
        hashes = None if block_hashes is None else _keys(block_hashes)
        return dict(self._native.overlaps(prompt_token_ids, hashes, num_prompt_tokens, lora_name, cache_salt))

    def prompt_keys(
        self,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> npt.NDArray[np.uint64]:
        """The block keys of a token prompt's full blocks, as the router hashes them."""
        return self._native.prompt_keys(prompt_token_ids, lora_name, cache_salt)

    def in_flight(self, replica: str) -> list[str]:
        """The requests in flight on a replica, in routing order."""
        return self._native.in_flight(replica)

    @property
    def num_in_flight(self) -> int:
        return self._native.num_in_flight

    @property
    def num_sessions(self) -> int:
        return self._native.num_sessions

    def check_invariants(self) -> None:
        """Checks the index and the load bookkeeping; raises :class:`~kvsched.InternalError` on a bug."""
        self._native.check_invariants()
