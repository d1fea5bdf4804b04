"""Block pins: references taken on blocks by id outside any request (vLLM's ``BlockPool.touch`` /
``free_blocks`` as a KV connector calls them), and the block-hash reads that go with them. Mirrors
``rust/kvsched-core/src/pins.rs``.

A pin holds a block like a request does: a free block leaves the free queue when pinned (a cached one stays
cached), and a block whose last reference an unpin drops goes back where vLLM's ``free_blocks`` puts it: to the
tail when it carries a hash, in the order given, to the head when it does not, the blocks of one call as one group
in the order given. Each call checks all its ids first: on an error nothing changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InvalidRequestError, SchedulerTypeError
from .block_pool import _BlockPoolMixin
from .convert import _block_id, _block_ids, _is_int
from .kv_cache_manager import _KVCacheManagerMixin


class _PinsMixin(_BlockPoolMixin):
    """``pin_blocks``, ``unpin_blocks``, ``get_block_pin_cnt``, ``get_block_hash``, ``get_block_hash_group``,
    ``get_cached_block_id``, ``free_block_ids``."""

    def _check_block_id(self, b: int, what: str) -> None:
        self._check_in_pool(b)
        if b == 0:
            raise InvalidRequestError(f"block 0 is the null block: it cannot be {what}")

    def pin_blocks(self, block_ids: Any) -> None:
        """Takes one reference on each block (an id listed twice takes two): vLLM's ``BlockPool.touch``."""
        blocks = _block_ids(block_ids)
        for b in blocks:
            self._check_block_id(b, "pinned")
        for b in blocks:
            if self._ref_cnt[b] == 0:
                self._free.remove(b)
            self._ref_cnt[b] += 1
            self._pins[b] = self._pins.get(b, 0) + 1

    def unpin_blocks(self, block_ids: Any) -> None:
        """Gives back one pin of each block, first evicted first: vLLM's ``BlockPool.free_blocks``."""
        blocks = _block_ids(block_ids)
        wanted: dict[int, int] = {}
        for b in blocks:
            self._check_block_id(b, "unpinned")
            n = wanted[b] = wanted.get(b, 0) + 1
            pinned = self._pins.get(b, 0)
            if n > pinned:
                raise InvalidRequestError(
                    f"block {b} is not pinned"
                    if pinned == 0
                    else f"block {b} is unpinned {n} times but pinned only {pinned} times"
                )
        for b, n in wanted.items():
            left = self._pins[b] - n
            if left:
                self._pins[b] = left
            else:
                del self._pins[b]
        # The pool's release of a request's blocks, which walks them last first: the reversed list keeps the
        # order given, first evicted first.
        self._free_block_list(blocks[::-1])

    def get_block_pin_cnt(self, block_id: int) -> int:
        """How many pins block ``block_id`` carries (0 for the null block)."""
        b = _block_id(block_id, "block_id")
        if b != 0:
            self._check_block_id(b, "pinned")
        return self._pins.get(b, 0)

    def get_block_hash(self, block_id: int) -> bytes | None:
        """The hash block ``block_id`` is cached under (as ``cached_block_hashes`` shows it), or None."""
        b = _block_id(block_id, "block_id")
        if b != 0:
            self._check_block_id(b, "read")
        return self._block_hash[b]

    def free_block_ids(self) -> np.ndarray:
        """The free blocks in eviction order, head first (the order the next allocations take them)."""
        return np.array(list(self._free), dtype=np.int32)

    def _hash_width(self) -> int:
        return 16 if self._config.prefix_hash_algo == "xxh3_128" else 32

    def get_block_hash_group(self, block_id: int) -> tuple[bytes, int] | None:
        """The request block hash block ``block_id`` is cached under and the KV cache group whose key of it that
        is (group 0's key is the hash itself), or None if it is not cached."""
        key = self.get_block_hash(block_id)
        if key is None:
            return None
        width = self._hash_width()
        # A group's key is the hash with the group id appended (``_group_key``); group 0's is the hash.
        return key[:width], key[width] if len(key) > width else 0

    def get_cached_block_id(self, block_hash: bytes, group: int = 0) -> int | None:
        """The block a prefix lookup of ``block_hash`` (KV cache group ``group``'s key of it) returns now (the first
        cached under it), or None."""
        if not isinstance(block_hash, bytes):
            raise SchedulerTypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
        if not _is_int(group):
            raise SchedulerTypeError(f"group must be an int, got {type(group).__name__}")
        width = self._hash_width()
        if len(block_hash) != width:
            raise InvalidRequestError(
                f"block_hash must be {width} bytes (the width of this scheduler's hashes), got {len(block_hash)}"
            )
        num_groups = len(self._config.kv_cache_groups or (None,))
        if not 0 <= group < num_groups:
            raise InvalidRequestError(f"group must be in [0, {num_groups}), got {group}")
        if not self._config.enable_prefix_caching:
            return None
        blocks = self._cached.get(_KVCacheManagerMixin._group_key(block_hash, group))
        return next(iter(blocks)) if blocks else None
