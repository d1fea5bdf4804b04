"""Block pins for KV connectors that bind vLLM's block pool (``bind_gpu_block_pool``), on
:class:`kvsched.vllm.Scheduler`.

A connector such as vLLM's ``SimpleCPUOffloadConnector`` keeps the GPU blocks it copies from being reused by
``block_pool.touch(blocks)`` (a reference each) and gives them back with ``block_pool.free_blocks(blocks)``, and
reads each block's ``block_hash`` (vLLM's ``BlockHashWithGroupId``, the key it files the copy under) and
``get_cached_block(block_hash, group_ids)``. :class:`BlockPins` answers those from the core: ``touch`` and
``free_blocks`` are the core's ``pin_blocks`` / ``unpin_blocks`` (same reference counts, same free order as vLLM's
pool), and the hashes are vLLM's own hashes of the requests that cached the blocks, matched to the core's.

A connector hook the core calls from inside ``schedule()`` or ``update_from_output()`` (``update_state_after_alloc``)
cannot call the core back: its pins are queued and taken as soon as that core call returns, before anything else
reads or changes the pool. The blocks such a hook pins are those of the request being admitted, which holds them
until then, so the counts and the free order are those of vLLM's pool at every later point.

vLLM's hash of a cached block is the hash of the request block at that position, tagged with its KV cache group
(``BlockHashWithGroupId``): the core's hash of each request block (``get_block_hashes``) is matched to the
request's ``block_hashes`` at the same index, from the live requests when a hash is asked for, and from each
finishing request's blocks before the connector hears of the finish; the core names the group a block is cached
in (``get_block_hash_group``) and looks a hash up in a group (``get_cached_block_id(hash, group)``).

A connector's prefix lookup (``get_num_new_matched_tokens``) runs inside the core's ``schedule()``, which it
cannot ask. vLLM's ``UMBPStoreConnector`` asks there whether each block of the request's local hit is cached in
each group, to merge the hit with the store's (``coordinator.single_type_managers[g].block_pool
.get_cached_block``). With full-attention and sliding-window groups the answer it needs is "cached" for every one
of them: a full-attention group's hit is every block of it, and a window's merged hit never reaches further back
than the window's blocks of the local hit, which are cached (vLLM's lookup scans a window from the right and
stops at the first end whose window is cached: the local hit's end at the latest). :meth:`BlockPins.looking_up`
gives those answers while the lookup runs (the pool's ``null_block`` stands for the blocks); any other question
then reaches the core, which refuses it as busy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["BlockPins"]


class BlockPins:
    """Pins by block id on the core, deferred while the core is inside a call, and vLLM's block hashes of the
    core's cached blocks, in every KV cache group (the groups' blocks are all of one size)."""

    def __init__(self, sched: Any) -> None:
        self._sched = sched
        self._deferring = False
        # Pin and unpin calls made while the core was inside a call, in order: (pin?, block ids).
        self._pending: list[tuple[bool, list[int]]] = []
        # The core's hash of a request block -> (vLLM's hash of it, the tokens it covers), and vLLM's -> the core's
        # (without group ids: a group's key of either is the hash and the group).
        self._by_core: dict[bytes, tuple[Any, int]] = {}
        self._by_vllm: dict[Any, bytes] = {}
        # Live requests: how many of their block hashes are matched already.
        self._learned: dict[str, int] = {}
        # While a connector's lookup runs inside the core's call: vLLM's hashes of the request's local hit.
        self._local_hit: frozenset[Any] | None = None

    # ---- pins ----------------------------------------------------------------------------------------------

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A core call that may call connector hooks: pins they make are taken when it returns."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            self.flush()

    def flush(self) -> None:
        """Takes the queued pins (not while the core is inside a call: they wait for it to return)."""
        if self._deferring or not self._pending:
            return
        pending, self._pending = self._pending, []
        core = self._sched.core
        for pin, ids in pending:
            (core.pin_blocks if pin else core.unpin_blocks)(ids)

    def pin(self, block_ids: list[int]) -> None:
        """vLLM's ``BlockPool.touch`` (null blocks left out by the caller)."""
        self._call(True, block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        """vLLM's ``BlockPool.free_blocks``, first evicted first."""
        self._call(False, block_ids)

    def _call(self, pin: bool, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if self._deferring:
            self._pending.append((pin, block_ids))
            return
        self.flush()
        core = self._sched.core
        (core.pin_blocks if pin else core.unpin_blocks)(block_ids)

    @contextmanager
    def looking_up(self, request: Request, num_local_tokens: int) -> Iterator[None]:
        """A connector's prefix lookup of ``request``, whose local hit is ``num_local_tokens`` tokens, runs inside
        the core's call: :meth:`in_local_hit` answers for the hit's blocks meanwhile."""
        hash_block_size = self._sched.kv_cache_manager.block_pool.hash_block_size
        self._local_hit = frozenset(request.block_hashes[: num_local_tokens // hash_block_size])
        try:
            yield
        finally:
            self._local_hit = None

    def in_local_hit(self, block_hash: Any) -> bool:
        """Whether a connector's lookup is running (see :meth:`looking_up`) and vLLM's ``block_hash`` (without
        group) is one of the request's local hit, which is cached in every group (full attention and sliding
        windows: the adapter refuses the others for such connectors)."""
        return self._local_hit is not None and block_hash in self._local_hit

    # ---- vLLM's block hashes -------------------------------------------------------------------------------

    def _match(self, core_hash: bytes, vllm_hash: Any, index: int) -> None:
        if core_hash in self._by_core:
            return
        self._by_core[core_hash] = (vllm_hash, (index + 1) * self._sched.block_size)
        self._by_vllm[vllm_hash] = core_hash

    def learn_live(self) -> None:
        """Matches the block hashes of every live request not matched yet."""
        core = self._sched.core
        learned = self._learned
        for req_id in [r for r in learned if r not in self._sched.requests]:
            del learned[req_id]
        for req_id, request in list(self._sched.requests.items()):
            vllm_hashes = request.block_hashes
            done = learned.get(req_id, 0)
            if len(vllm_hashes) <= done or request.is_finished() or not core.has_request(req_id):
                continue
            core_hashes = core.get_block_hashes(req_id)
            n = min(len(core_hashes), len(vllm_hashes))
            for i in range(done, n):
                self._match(core_hashes[i], vllm_hashes[i], i)
            learned[req_id] = max(done, n)
        self._prune()

    def learn_finished(self, request: Request, block_ids: list[Any]) -> None:
        """Matches the cached blocks of a request the core just finished (``block_ids``: its blocks, in order; or,
        with several KV cache groups, one such table per group)."""
        core = self._sched.core
        tables = block_ids if block_ids and isinstance(block_ids[0], list) else [block_ids]
        for table in tables:
            for i, (b, h) in enumerate(zip(table, request.block_hashes, strict=False)):
                if b:
                    found = core.get_block_hash_group(b)
                    if found is not None:
                        self._match(found[0], h, i)
        self._learned.pop(request.request_id, None)

    def _prune(self) -> None:
        if len(self._by_core) <= 4 * self._sched.kv_config.num_blocks + 1024:
            return
        core = self._sched.core
        groups = range(len(self._sched.kv_config.kv_cache_groups or (None,)))
        for core_hash in [h for h in self._by_core if all(core.get_cached_block_id(h, g) is None for g in groups)]:
            vllm_hash, _ = self._by_core.pop(core_hash)
            self._by_vllm.pop(vllm_hash, None)
        # A live request's dropped hashes can be cached again later: match every live request afresh then.
        self._learned.clear()

    def block_hash(self, block_id: int) -> tuple[Any, int] | None:
        """vLLM's ``(block_hash, block_hash_num_tokens)`` of a block (the hash with its KV cache group), or None if
        it is not cached."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        cached = self._sched.core.get_block_hash_group(block_id)
        if cached is None:
            return None
        core_hash, group = cached
        found = self._by_core.get(core_hash)
        if found is None:
            self.learn_live()
            found = self._by_core.get(core_hash)
            if found is None:
                return None
        vllm_hash, num_tokens = found
        return make_block_hash_with_group_id(vllm_hash, group), num_tokens

    def cached_block_id(self, block_hash: Any) -> int | None:
        """The block a lookup of vLLM's ``block_hash`` (with group id) returns now, or None."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        vllm_hash, group = get_block_hash(block_hash), get_group_id(block_hash)
        if not 0 <= group < len(self._sched.kv_config.kv_cache_groups or (None,)):
            return None
        core_hash = self._by_vllm.get(vllm_hash)
        if core_hash is None:
            self.learn_live()
            core_hash = self._by_vllm.get(vllm_hash)
            if core_hash is None:
                return None
        block: int | None = self._sched.core.get_cached_block_id(core_hash, group)
        return block


class NoSecondaryHashes(Mapping[int, set[Any]]):
    """vLLM's ``BlockPool.cached_block_hashes_by_block``: the extra hashes a block is filed under when hash blocks
    are smaller than KV blocks. kvsched.vllm runs with one hash block per KV block, where vLLM's is empty too."""

    def __getitem__(self, block_id: int) -> set[Any]:
        raise KeyError(block_id)

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


def block_ids(blocks: Iterable[Any]) -> list[int]:
    """The ids of ``blocks`` (vLLM ``KVCacheBlock`` or kvsched block views) that are not the null block."""
    return [int(b.block_id) for b in blocks if not b.is_null]
