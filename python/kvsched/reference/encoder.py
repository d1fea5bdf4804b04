"""The encoder cache for multimodal inputs. Mirrors ``rust/kvsched-core/src/encoder.rs``.

Encoder outputs are held by content hash and sized in encoder tokens (vLLM's ``EncoderCacheManager`` rules);
``encoder_sched.py`` drives the cache from the step loop.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .request import _Request


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
