"""The prefix cache's block events, recorded with ``enable_kv_cache_events``. Mirrors
``rust/kvsched-core/src/events.rs``.

Stored: a run of one request's full blocks entered the cache of one KV cache group (the hashes of its blocks
that are not null and were kept, the number of the group's blocks carrying each hash after the store and each
one's index in the request's table, the parent hash, the run's tokens, the request's LoRA name and cache salt, the
request, the index of the run's first block in its table and the group). Removed: one block left its group's cache
(the group's blocks still carrying its hash). Cleared: the whole cache was dropped. Taken as a
:class:`kvsched.kv_events.KVCacheEvents`, in the order they happened.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..kv_events import CLEARED, REMOVED, STORED, KVCacheEvents

_Event = tuple[
    int, list[tuple[bytes, int, int]], bytes | None, list[int], str | None, str | None, str | None, int, int, int
]


class _KvCacheEvents:
    """The events not taken yet, one tuple each: (kind, [(hash, copies, index in the table)], parent, tokens,
    lora, salt, req_id, first block, group, tokens per block)."""

    def __init__(self) -> None:
        self.events: list[_Event] = []

    def push_stored(
        self, blocks: list[tuple[bytes, int, int]], parent: bytes | None, tokens: list[int], lora: str | None,
        salt: str | None, req_id: str, first: int, group: int, block_size: int,
    ) -> None:  # fmt: skip
        self.events.append((STORED, blocks, parent, tokens, lora, salt, req_id, first, group, block_size))

    def push_removed(self, h: bytes, copies: int, group: int = 0) -> None:
        self.events.append((REMOVED, [(h, copies, 0)], None, [], None, None, None, 0, group, 0))

    def push_cleared(self) -> None:
        self.events.append((CLEARED, [], None, [], None, None, None, 0, 0, 0))

    def take(self, block_size: int, hash_width: int) -> KVCacheEvents:
        events, self.events = self.events, []
        if not events:
            return KVCacheEvents.empty(block_size, hash_width)
        blocks = [b for e in events for b in e[1]]

        def rows(hashes: list[bytes]) -> npt.NDArray[np.uint8]:
            out: npt.NDArray[np.uint8] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, hash_width).copy()
            return out

        return KVCacheEvents(
            kinds=np.array([e[0] for e in events], dtype=np.uint8),
            block_hashes=rows([h for h, _, _ in blocks]),
            block_hashes_indptr=np.cumsum([0] + [len(e[1]) for e in events], dtype=np.int32),
            num_copies=np.array([n for _, n, _ in blocks], dtype=np.int32),
            parent_block_hashes=rows([e[2] or bytes(hash_width) for e in events]),
            has_parent=np.array([e[2] is not None for e in events], dtype=np.bool_),
            token_ids=np.array([t for e in events for t in e[3]], dtype=np.int32),
            token_ids_indptr=np.cumsum([0] + [len(e[3]) for e in events], dtype=np.int32),
            lora_names=[e[4] for e in events],
            cache_salts=[e[5] if e[0] == STORED else None for e in events],
            req_ids=[e[6] for e in events],
            num_cached_blocks=np.array([e[7] for e in events], dtype=np.int32),
            groups=np.array([e[8] for e in events], dtype=np.int32),
            block_positions=np.array([i for _, _, i in blocks], dtype=np.int32),
            block_sizes=np.array([e[9] for e in events], dtype=np.int32),
            block_size=block_size,
        )
