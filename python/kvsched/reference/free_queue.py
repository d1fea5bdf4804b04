"""The free block queue. Mirrors ``rust/kvsched-core/src/free_queue.rs``.

A circular doubly linked list over block ids kept in two index arrays, so popping the head, unlinking any block
(a prefix hit reviving a cached free block), appending and prepending are all O(1).
"""

from __future__ import annotations

from collections.abc import Iterator


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
