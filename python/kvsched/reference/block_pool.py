"""The KV block pool: reference counts, the free queue and the prefix-cache map. Mirrors
``rust/kvsched-core/src/block_pool.rs``.

The pool's fields live on the scheduler (``state.py``): ``_ref_cnt[b]`` and ``_block_hash[b]`` per block id,
``_free`` (a :class:`_FreeBlockQueue`) and ``_cached`` (``block_hash -> {block_id: None}``, an insertion-ordered
set; lookups take its first block). Block 0 is the null block: never free, never allocated, never hashed. A
usable block is in the free queue iff its reference count is 0; a free block keeps its hash (it can still be
hit) until it is popped for reuse. With a prefix match unit finer than the block, a block can also be filed
under keys other than its hash (``_extra_keys``: a prefix ending inside it, vLLM's partial entries) in the same
``_cached`` map, so a lookup takes, of the blocks filed under a key either way, the one filed first; evicting or
re-keying a block drops all its keys. With KV cache events on (``_events``), a block leaving the map is recorded as
removed, with its group, its own hash (not the group's key) and the blocks still carrying the key, and then each
second key it carries (``_second_keys``: a prompt's tail entry with KV cache groups of different block sizes, kept
for the events only; no lookup can find it), each counted with the blocks carrying it either way.
"""

from __future__ import annotations

from .._errors import InvalidRequestError
from .request import _Request
from .state import _SchedulerState


class _BlockPoolMixin(_SchedulerState):
    """Popping a free block (evicting its cached contents), freeing a list of blocks, and the pool's id range."""

    def _check_in_pool(self, b: int) -> None:
        """``InvalidRequestError`` unless block ``b`` (a valid id, ``convert._block_id``) is in this pool."""
        num_blocks = len(self._ref_cnt)
        if b >= num_blocks:
            raise InvalidRequestError(f"block id {b} is outside the KV cache pool (block ids 0..{num_blocks})")

    @staticmethod
    def _group_key(h: bytes, g: int) -> bytes:
        """Group ``g``'s cache key of a block hash (group 0: the hash itself)."""
        return h if g == 0 else h + bytes([g])

    def _key_tokens(self, r: _Request, group: int, table: list[int]) -> list[int]:
        """For each block of ``table`` (KV cache group ``group``'s of ``r``), the tokens the hash it is cached under
        covers (vLLM's ``block_hash_num_tokens``; 0 for a null block or one not cached): the end of the request's
        hash block of that key. That is the block's own end, but for a Mamba prefill checkpoint keyed one block
        below its entry by the trailing-block drop, a partial entry (prefix hits inside a block: its own tokens),
        and in a group of larger blocks than ``block_size`` the prompt's tail entry when it is the block's key."""
        bs = self._bs
        sizes = self._config.kv_cache_group_block_sizes
        k = max(1, sizes[group] // bs) if sizes else 1
        hashes = r.block_hashes

        def keyed_at(i: int, key: bytes) -> bool:
            return i < len(hashes) and self._group_key(hashes[i], group) == key

        counts = []
        for j, b in enumerate(table):
            key = self._block_hash[b] if b else None
            if key is None:
                counts.append(0)
            elif b in self._partial_tokens:
                counts.append(self._partial_tokens[b])
            elif k > 1:
                # a group of larger blocks: keyed at its last hash block, or (the prompt's tail entry) inside it
                at = next((u for u in range((j + 1) * k - 1, j * k - 1, -1) if keyed_at(u, key)), (j + 1) * k - 1)
                counts.append((at + 1) * bs)
            else:
                counts.append((j if j > 0 and not keyed_at(j, key) and keyed_at(j - 1, key) else j + 1) * bs)
        return counts

    def _drop_boundary_offers(self, req_id: str) -> None:
        """A request's blocks go back to the pool: its boundary states not yet taken are withdrawn."""
        if self._boundary_offers:
            self._boundary_offers[:] = [o for o in self._boundary_offers if o[0] != req_id]

    def _pop_free_block(self) -> int:
        b = self._free.popleft()
        h = self._block_hash[b]
        if h is not None:  # evict: the block is reused, its cached contents are gone
            self._uncache(b, h)
        self._ref_cnt[b] = 1
        return b

    def _uncache(self, b: int, h: bytes) -> None:
        """Takes block ``b``, cached under ``h``, out of the cache map (it keeps its place in the free queue)."""
        del self._cached[h][b]
        if not self._cached[h]:
            del self._cached[h]
        self._block_hash[b] = None
        self._partial_tokens.pop(b, None)
        for k in self._extra_keys.pop(b, ()):
            del self._cached[k][b]
            if not self._cached[k]:
                del self._cached[k]
        if self._events is not None:
            self._push_removed(h)
            for key in self._second_keys.pop(b, ()):
                self._push_removed(key)

    def _push_removed(self, key: bytes) -> None:
        """The removed event of one block's key ``key`` (just taken out)."""
        assert self._events is not None
        # A group's key is the hash with the group id appended (an odd length; hashes are 16 or 32 bytes).
        group = key[-1] if len(key) % 2 else 0
        self._events.push_removed(key[:-1] if group else key, self._num_copies(key), group)

    def _num_copies(self, key: bytes) -> int:
        """The blocks carrying ``key``, as their key or as a second key."""
        return len(self._cached.get(key, ())) + sum(key in keys for keys in self._second_keys.values())

    def _add_second_key(self, b: int, key: bytes) -> bool:
        """Files ``key`` as a key of block ``b``: its key when it carries none (it is then cached), else, with events
        on, a second key. Whether ``b`` did not carry it already (False for the null block, and for a block with a
        key with events off)."""
        if b == 0:
            return False
        current = self._block_hash[b]
        if current is None:
            self._block_hash[b] = key
            self._cached.setdefault(key, {})[b] = None
            return True
        if self._events is None:
            return False
        keys = self._second_keys.setdefault(b, [])
        if current == key or key in keys:
            if not keys:
                del self._second_keys[b]
            return False
        keys.append(key)
        return True

    def _has_key(self, b: int, key: bytes) -> bool:
        """Whether block ``b`` is filed under ``key`` (as its hash or as an extra key)."""
        return self._block_hash[b] == key or key in self._extra_keys.get(b, ())

    def _cache_partial_block(self, b: int, key: bytes, num_tokens: int, replace: bool = False) -> bool:
        """Files block ``b`` under ``key``, a prefix of ``num_tokens`` tokens ending inside it or at its end: as its
        hash if it has none, else as an extra key. A block whose hash is a shorter partial entry, or every block
        with ``replace`` (its contents were rewritten), loses all its keys first. The null block is never filed."""
        if b == 0:
            return False
        h = self._block_hash[b]
        if h is not None:
            already = self._has_key(b, key)
            shorter = not already and self._partial_tokens.get(b, num_tokens) < num_tokens
            if replace or shorter:
                self._uncache(b, h)
        self._insert_key(b, key, num_tokens)
        return True

    def _insert_key(self, b: int, key: bytes, num_tokens: int | None) -> None:
        """Files ``b`` under ``key`` unless it is already: as its hash (a partial entry of ``num_tokens`` tokens, or a
        full block's hash with ``None``) if it has none, else as an extra key."""
        if self._has_key(b, key):
            return
        if self._block_hash[b] is not None:
            self._extra_keys.setdefault(b, []).append(key)
        else:
            self._block_hash[b] = key
            if num_tokens is not None:
                self._partial_tokens[b] = num_tokens
        self._cached.setdefault(key, {})[b] = None

    def _move_block_hashes(self, src: int, dst: int) -> None:
        """Re-files every key of ``src`` under ``dst`` (a block with none), quietly: the request holding ``src``
        keeps writing into it while the prefix cache keeps ``dst``, a copy."""
        h = self._block_hash[src]
        if h is None:
            return
        tokens = self._partial_tokens.get(src)
        extras = list(self._extra_keys.get(src, ()))
        events, self._events = self._events, None
        self._uncache(src, h)
        self._events = events
        self._insert_key(dst, h, tokens)
        for k in extras:
            self._insert_key(dst, k, None)

    def _free_block_list(self, block_ids: list[int]) -> None:
        to_head: list[int] = []
        for b in reversed(block_ids):
            if b == 0:
                continue  # a sliding window's null block: never held
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                if self._block_hash[b] is not None:
                    self._free.append(b)
                else:
                    to_head.append(b)
        for b in reversed(to_head):
            self._free.appendleft(b)
