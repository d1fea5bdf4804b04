"""KV cache events across Ray: each replica publishes its scheduler's events, request routers pull them.

Every :class:`~kvsched.ray.LLMServer` replica runs its scheduler with ``enable_kv_cache_events`` and, after each
engine step that changed its prefix cache, sends the step's :class:`~kvsched.kv_events.KVCacheEvents` to a small
Ray actor of its own, a :class:`KvEventLog` named after the replica (:func:`log_name`) and owned by it, so the log
dies with its replica. The log keeps the last ``max_batches`` batches, numbered, and the set of hashes the replica
caches (as :meth:`~kvsched.kv_events.KVCacheEvents.set_updates` says it changes). A router reads a log from where
it stopped (:meth:`KvEventLog.pull`): the batches since, or, when it fell behind the log's window (or it is
new), the whole set once and the batches from there. Any number of routers (one per ``DeploymentHandle``
process) read the same log, each at its own place.

:class:`KvEventSubscriber` is the router's side: it finds the logs of the replicas it routes to, pulls them all at
once, and applies what it gets to a :class:`kvsched.router.Router`; :class:`~kvsched.ray.KvschedRequestRouter`
pulls before ranking each request (concurrent requests share one pull).

The router finds a replica's blocks by hashing prompts as the replica does: the same ``block_size``,
``prefix_hash_algo`` and ``prefix_hash_seed``. :func:`default_hash_seed` is the seed both sides use when neither
is given one: derived from the application and deployment names, so it is predictable; give both the same secret
``prefix_hash_seed`` (or use ``sha256``) where tenants may attack the cache. A subscriber checks the first stored
run of each replica that starts a prompt against its own hash of the run's tokens and warns once if they differ.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import SchedulerError
from ..kv_events import REMOVED, STORED, AllBlocksCleared, BlockStored, KVCacheEvents
from ..router import Router

__all__ = ["SERVE_NAMESPACE", "KvEventLog", "KvEventSubscriber", "default_hash_seed", "log_name"]

logger = logging.getLogger("kvsched")

#: Ray Serve's namespace: where the logs live, so routers in the driver and in replicas find them alike.
SERVE_NAMESPACE = "serve"


def log_name(replica_full_id: str) -> str:
    """The name of the :class:`KvEventLog` of a replica (``ReplicaID.to_full_id_str()``)."""
    return f"kvsched-kv-events:{replica_full_id}"


def default_hash_seed(app_name: str, deployment_name: str) -> str:
    """The ``prefix_hash_seed`` a deployment's replicas and its request routers share when none is given."""
    return f"kvsched-ray:{app_name}:{deployment_name}"


@dataclass
class Pulled:
    """What :meth:`KvEventLog.pull` returns: the cached keys to start from (None when the reader is within the
    log's window), the batches after them, and the number of the last batch (the reader's next ``after``)."""

    snapshot: npt.NDArray[np.uint64] | None
    batches: list[KVCacheEvents]
    last_seq: int
    block_size: int


class KvEventLog:
    """One replica's published KV cache events (run as a Ray actor; see the module docstring). Batches are
    numbered from 0 in the order the replica sends them."""

    def __init__(self, block_size: int, max_batches: int = 1024) -> None:
        self._block_size = block_size
        self._batches: deque[KVCacheEvents] = deque(maxlen=max_batches)
        self._last_seq = -1
        self._keys: set[int] = set()

    def publish(self, seq: int, events: KVCacheEvents) -> None:
        """Appends the replica's batch number ``seq`` (the next one: batches come in order from one sender)."""
        if seq != self._last_seq + 1:
            logger.warning("KV event batch %d arrived after %d: batches were lost", seq, self._last_seq)
        keep, _ = events.set_updates()
        keys, bi = events.block_keys(), events.block_hashes_indptr
        for e, kind in enumerate(events.kinds.tolist()):
            changed = keys[bi[e] : bi[e + 1]][keep[bi[e] : bi[e + 1]]].tolist()
            if kind == STORED:
                self._keys.update(changed)
            elif kind == REMOVED:
                self._keys.difference_update(changed)
            else:
                self._keys.clear()
        self._batches.append(events)
        self._last_seq = seq

    def pull(self, after: int) -> Pulled:
        """What a reader that has applied every batch up to number ``after`` (-1: none) needs next."""
        first = self._last_seq - len(self._batches) + 1  # the oldest batch still held
        if after + 1 >= first:
            start = after + 1 - first
            return Pulled(None, list(self._batches)[start:], self._last_seq, self._block_size)
        snapshot = np.array(sorted(self._keys), dtype=np.uint64)
        return Pulled(snapshot, [], self._last_seq, self._block_size)

    def num_cached_keys(self) -> int:
        return len(self._keys)


@dataclass
class _Source:
    log: str  # the name of the replica's log
    handle: Any = None  # its actor handle, once found
    cursor: int = -1  # the last batch applied
    checked: bool = False  # whether its first prompt-starting run was checked against the router's own hash
    next_lookup: float = 0.0


@dataclass
class KvEventSubscriber:
    """Pulls the logs of a router's replicas into its index (see the module docstring): :meth:`add` a replica
    under the router's name for it with the name of its log, :meth:`pull` from the router's event loop."""

    router: Router
    lookup_interval_s: float = 1.0
    _sources: dict[str, _Source] = field(default_factory=dict)
    _pulling: asyncio.Future[None] | None = None

    def add(self, replica: str, log: str) -> None:
        self._sources[replica] = _Source(log)

    def remove(self, replica: str) -> None:
        self._sources.pop(replica, None)

    def cursor(self, replica: str) -> int:
        """The number of the last batch of ``replica`` applied (-1: none)."""
        src = self._sources.get(replica)
        return -1 if src is None else src.cursor

    def _handle(self, src: _Source) -> Any:
        """The log's actor handle, looked up by name at most once per ``lookup_interval_s`` until found (a
        replica that publishes nothing has no log)."""
        if src.handle is not None:
            return src.handle
        now = time.monotonic()
        if now < src.next_lookup:
            return None
        import ray

        try:
            src.handle = ray.get_actor(src.log, namespace=SERVE_NAMESPACE)
        except ValueError:
            src.next_lookup = now + self.lookup_interval_s
        return src.handle

    async def pull(self) -> None:
        """Applies every replica's new events; concurrent calls share one pull."""
        if self._pulling is not None:
            await asyncio.shield(self._pulling)
            return
        self._pulling = asyncio.ensure_future(self._pull_all())
        try:
            await asyncio.shield(self._pulling)
        finally:
            self._pulling = None

    async def _pull_all(self) -> None:
        calls: dict[str, Any] = {}
        for replica, src in list(self._sources.items()):
            handle = self._handle(src)
            if handle is not None:
                calls[replica] = handle.pull.remote(src.cursor)
        if not calls:
            return
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        for replica, res in zip(calls, results, strict=True):
            source = self._sources.get(replica)
            if source is None:  # the replica left while we waited
                continue
            if isinstance(res, BaseException):
                logger.warning("could not read the KV events of replica %s: %s", replica, res)
                source.handle, source.next_lookup = None, time.monotonic() + self.lookup_interval_s
                continue
            self.apply(replica, res)

    def apply(self, replica: str, pulled: Pulled) -> None:
        """Applies what a log returned for ``replica`` to the router: only what is newer than what was applied
        (two pulls may overlap when a caller gave up waiting for one)."""
        src = self._sources.get(replica)
        if src is None or pulled.last_seq <= src.cursor:
            return
        first_seq = pulled.last_seq - len(pulled.batches) + 1
        try:
            if pulled.snapshot is not None:
                stored = BlockStored(pulled.snapshot, None, [], pulled.block_size)
                self.router.apply_events(replica, [AllBlocksCleared(), stored])
            for seq, batch in enumerate(pulled.batches, start=first_seq):
                if seq <= src.cursor:
                    continue
                if not src.checked:
                    src.checked = self._check_hashes(replica, batch)
                self.router.apply_scheduler_events(replica, batch)
        except SchedulerError as exc:
            logger.warning("could not apply the KV events of replica %s: %s", replica, exc)
        src.cursor = pulled.last_seq

    def _check_hashes(self, replica: str, batch: KVCacheEvents) -> bool:
        """Compares the first stored run that starts a prompt with the router's hash of its tokens; True once
        compared."""
        starts = np.flatnonzero((batch.kinds == STORED) & ~batch.has_parent)
        if not len(starts):
            return False
        e = int(starts[0])
        bs = batch.block_size
        tokens = batch.token_ids[batch.token_ids_indptr[e] : batch.token_ids_indptr[e] + bs]
        theirs = int(batch.block_keys()[batch.block_hashes_indptr[e]])
        try:
            ours = self.router.prompt_keys(tokens, lora_name=batch.lora_names[e], cache_salt=batch.cache_salts[e])
        except SchedulerError:
            ours = np.zeros(0, dtype=np.uint64)
        if not len(ours) or int(ours[0]) != theirs:
            logger.warning(
                "replica %s hashes its blocks differently from the router (block_size, prefix_hash_algo and "
                "prefix_hash_seed must be the same on both): token prompts will not find its cached blocks",
                replica,
            )
        return True
