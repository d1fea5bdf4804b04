"""KV cache events: the blocks a scheduler enters into and evicts from its prefix cache, in vLLM's shape.

With ``SchedulerConfig(enable_kv_cache_events=True)``, :meth:`kvsched.Scheduler.take_kv_cache_events` returns a
:class:`KVCacheEvents`, every event since the previous call in the order it happened (docs/semantics.md, "KV cache
events", says exactly when each is emitted):

- **stored** (vLLM's ``BlockStored``): full blocks of one request entered the prefix cache of one KV cache
  group, a run of blocks each the child of the one before and the first the child of the parent hash (none for a
  prompt's first block), with their tokens, the request's LoRA name and cache salt (the extra keys of their
  hashes), and their block size (the group's: KV cache groups may have different ones; or the hash block for a
  prompt's tail entry, below). In a sliding-window or chunked-local group the run's blocks already out of the
  window are null blocks, not stored: the event lists the others (the run's last blocks, possibly none, as vLLM
  does; under sparse retention, ``prefix_cache_retention_interval``, only the blocks it keeps, wherever they sit
  in the run: ``block_positions`` gives each listed block's index in the request's table) while its tokens and
  parent span the whole run;
- **stored**, a prompt's tail entry (KV cache groups of different block sizes, as vLLM): a full-attention group
  whose blocks are larger than the hash block (``block_size``) also keys the prompt's last full hash block, when
  it ends inside one of its blocks, on that block: a stored event of that one hash block (``block_sizes`` the
  hash block; its index and first block counted in hash blocks), removed right after its block's own removal;
- **removed** (``BlockRemoved``): one block left the prefix cache of its group;
- **cleared** (``AllBlocksCleared``): the whole prefix cache was dropped.

Stored and removed events name their KV cache group (``groups``, vLLM's ``group_idx``; 0 with one group); a
block's hash is the same in every group. As in vLLM the events are per block: two blocks cached under the same
hash (two requests that computed the same prefix) are stored twice and removed twice. ``num_copies`` gives, per
block, how many blocks of its group carry its hash right after the event, so a consumer that keeps the *set* of
cached hashes (a router) adds a hash when a store leaves one copy and drops it when a removal leaves none
(:meth:`KVCacheEvents.set_updates`, which follows group 0).

The batch is a struct of arrays (one row per event, ragged data as values plus ``_indptr`` offsets); the
per-event objects :class:`BlockStored`, :class:`BlockRemoved` and :class:`AllBlocksCleared` are built only when
asked for (:meth:`KVCacheEvents.events`). Block hashes are the bytes :meth:`kvsched.Scheduler.get_block_hashes`
returns (16 bytes for ``xxh3_128``, 32 for ``sha256``); :meth:`KVCacheEvents.block_keys` turns them into the 64-bit
keys of :mod:`kvsched.router` (and of vLLM's int hashes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "CLEARED",
    "REMOVED",
    "STORED",
    "AllBlocksCleared",
    "BlockEvent",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvents",
    "hash_keys",
]

#: ``KVCacheEvents.kinds``: full blocks entered the prefix cache.
STORED = 0
#: ``KVCacheEvents.kinds``: one block left the prefix cache.
REMOVED = 1
#: ``KVCacheEvents.kinds``: the whole prefix cache was dropped.
CLEARED = 2

BlockHashLike = int | bytes
BlockHashes = Sequence[BlockHashLike] | npt.NDArray[np.integer[Any]]


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered a prefix cache: ``block_hashes`` in order, the first a child of ``parent_block_hash``
    (None for a prompt's first block); ``token_ids``: the tokens of all of them (may be empty). The fields of
    vLLM's ``BlockStored`` that kvsched fills, plus the storing request's ``cache_salt`` and, from a kvsched
    scheduler, ``num_copies`` (per block, the blocks carrying its hash after the store; None when unknown)."""

    block_hashes: BlockHashes
    parent_block_hash: BlockHashLike | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    num_copies: Sequence[int] | None = None
    group: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left a prefix cache (as vLLM's ``BlockRemoved``); from a kvsched scheduler one block, with
    ``num_copies``: the blocks still carrying its hash (None when unknown)."""

    block_hashes: BlockHashes
    medium: str | None = None
    num_copies: Sequence[int] | None = None
    group: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """A whole prefix cache was dropped (as vLLM's ``AllBlocksCleared``)."""

    medium: str | None = None


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


def hash_keys(rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """The 64-bit keys of block hashes given as rows of bytes: each row's last 8 bytes, big-endian (vLLM's
    ``int.from_bytes(h, "big") & (2**64 - 1)``, :func:`kvsched.router.block_key`)."""
    if rows.ndim != 2 or rows.shape[1] < 8:
        raise ValueError(f"hash rows must be (n, >= 8) bytes, got shape {rows.shape}")
    tail = np.ascontiguousarray(rows[:, -8:])
    return tail.view(">u8").reshape(-1).astype(np.uint64)


@dataclass(frozen=True, eq=False)
class KVCacheEvents:
    """The KV cache events of one take, as arrays (see the module docstring).

    - ``kinds`` (uint8, one per event): :data:`STORED`, :data:`REMOVED` or :data:`CLEARED`;
    - ``block_hashes`` (uint8, one row of hash bytes per block) and ``block_hashes_indptr`` (int32, events + 1):
      event ``e``'s blocks are rows ``block_hashes_indptr[e]:block_hashes_indptr[e + 1]``; a removed event has
      one, a cleared event none;
    - ``num_copies`` (int32, one per block): the blocks carrying the block's hash right after its event;
    - ``parent_block_hashes`` (uint8, one row per event) and ``has_parent`` (bool): a stored run's parent;
    - ``token_ids`` (int32) and ``token_ids_indptr`` (int32, events + 1): a stored run's tokens, ``block_size``
      per block;
    - ``lora_names``, ``cache_salts`` (one per event): the storing request's, None for the others;
    - ``req_ids`` (one per event): the storing request, None for the others;
    - ``num_cached_blocks`` (int32, one per event): the index of a stored run's first block in its request's block
      table (the request's blocks cached before it), 0 for the others;
    - ``groups`` (int32, one per event): the KV cache group of a stored run or a removed block, 0 for a clear;
    - ``block_positions`` (int32, one per block): a stored block's index in its request's block table (from
      ``num_cached_blocks`` on, gaps where blocks are null or left out by sparse retention), 0 for a removed one;
    - ``block_sizes`` (int32, one per event): a stored run's tokens per block (its group's block size, or the hash
      block for a prompt's tail entry), 0 for the others;
    - ``block_size``: tokens per hash block (the scheduler's ``block_size``); a stored block ``i`` of a group
      whose blocks hold ``k`` of them is keyed by the request's hash ``(i + 1) * k - 1``.
    """

    kinds: npt.NDArray[np.uint8]
    block_hashes: npt.NDArray[np.uint8]
    block_hashes_indptr: npt.NDArray[np.int32]
    num_copies: npt.NDArray[np.int32]
    parent_block_hashes: npt.NDArray[np.uint8]
    has_parent: npt.NDArray[np.bool_]
    token_ids: npt.NDArray[np.int32]
    token_ids_indptr: npt.NDArray[np.int32]
    lora_names: list[str | None]
    cache_salts: list[str | None]
    req_ids: list[str | None]
    num_cached_blocks: npt.NDArray[np.int32]
    groups: npt.NDArray[np.int32]
    block_positions: npt.NDArray[np.int32]
    block_sizes: npt.NDArray[np.int32]
    block_size: int

    @classmethod
    def empty(cls, block_size: int, hash_width: int) -> KVCacheEvents:
        """No events."""
        zero = np.zeros(1, dtype=np.int32)
        return cls(
            kinds=np.zeros(0, dtype=np.uint8),
            block_hashes=np.zeros((0, hash_width), dtype=np.uint8),
            block_hashes_indptr=zero,
            num_copies=np.zeros(0, dtype=np.int32),
            parent_block_hashes=np.zeros((0, hash_width), dtype=np.uint8),
            has_parent=np.zeros(0, dtype=np.bool_),
            token_ids=np.zeros(0, dtype=np.int32),
            token_ids_indptr=zero.copy(),
            lora_names=[],
            cache_salts=[],
            req_ids=[],
            num_cached_blocks=np.zeros(0, dtype=np.int32),
            groups=np.zeros(0, dtype=np.int32),
            block_positions=np.zeros(0, dtype=np.int32),
            block_sizes=np.zeros(0, dtype=np.int32),
            block_size=block_size,
        )

    def __len__(self) -> int:
        """The number of events."""
        return len(self.kinds)

    @property
    def num_blocks(self) -> int:
        """Blocks over all events (stored and removed)."""
        return len(self.block_hashes)

    def __repr__(self) -> str:
        counts = np.bincount(self.kinds, minlength=3)
        return (
            f"KVCacheEvents(stored={counts[STORED]}, removed={counts[REMOVED]}, cleared={counts[CLEARED]}, "
            f"num_blocks={self.num_blocks})"
        )

    def block_hash_list(self) -> list[bytes]:
        """The block hashes as bytes (as :meth:`kvsched.Scheduler.get_block_hashes` gives them)."""
        return [bytes(row) for row in self.block_hashes]

    def block_keys(self) -> npt.NDArray[np.uint64]:
        """The 64-bit router key of every block (:func:`hash_keys`)."""
        return hash_keys(self.block_hashes)

    def parent_keys(self) -> npt.NDArray[np.uint64]:
        """The 64-bit router key of every event's parent (0 where ``has_parent`` is False)."""
        return np.where(self.has_parent, hash_keys(self.parent_block_hashes), np.uint64(0)).astype(np.uint64)

    def set_updates(self) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
        """Which blocks change the *set* of cached hashes: a store that leaves one copy of its hash (it was not
        cached) and a removal that leaves none; the others only change how many blocks carry a hash. With several
        KV cache groups, only group 0's blocks count (one set of hashes). Returns the mask over blocks and the
        events' offsets into the kept blocks (``len(self) + 1``)."""
        per_event = np.diff(self.block_hashes_indptr)
        per_block = np.repeat(self.kinds, per_event)
        keep = np.where(per_block == STORED, self.num_copies == 1, self.num_copies == 0)
        keep &= np.repeat(self.groups, per_event) == 0
        kept_before = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))
        return keep, kept_before[self.block_hashes_indptr]

    def events(self) -> list[BlockEvent]:
        """The events as objects, hashes as bytes (built now; the arrays are the fast path)."""
        return list(self)

    def __iter__(self) -> Iterator[BlockEvent]:
        bi, ti = self.block_hashes_indptr.tolist(), self.token_ids_indptr.tolist()
        copies = self.num_copies.tolist()
        groups = self.groups.tolist()
        sizes = self.block_sizes.tolist()
        for e, kind in enumerate(self.kinds.tolist()):
            hashes = [bytes(row) for row in self.block_hashes[bi[e] : bi[e + 1]]]
            n = copies[bi[e] : bi[e + 1]]
            if kind == STORED:
                parent = bytes(self.parent_block_hashes[e]) if self.has_parent[e] else None
                tokens = self.token_ids[ti[e] : ti[e + 1]].tolist()
                yield BlockStored(
                    hashes,
                    parent,
                    tokens,
                    sizes[e],
                    "GPU",
                    self.lora_names[e],
                    self.cache_salts[e],
                    n,
                    groups[e],
                )
            elif kind == REMOVED:
                yield BlockRemoved(hashes, "GPU", n, groups[e])
            else:
                yield AllBlocksCleared("GPU")
