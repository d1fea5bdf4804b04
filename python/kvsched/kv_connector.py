"""The KV connector protocol: what ``Scheduler(config, kv_connector=...)`` calls (scheduler side only).

These are vLLM's ``KVConnectorBase_V1`` scheduler-role hooks, keyed by request id instead of vLLM's ``Request``
object (``kvsched.vllm`` adapts a real vLLM connector to them). The scheduler calls a hook only when a connector
is set; see ``docs/api.md`` ("KV connector") for when each hook runs and ``docs/semantics.md`` for the rules.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["KVConnector"]


@runtime_checkable
class KVConnector(Protocol):
    """Scheduler-side hooks of a KV connector (duck-typed: any object with these methods will do)."""

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        """At admission of a request with nothing computed, after its local prefix hit of
        ``num_computed_tokens`` tokens: how many more tokens the connector can supply, and whether they load
        asynchronously. ``(None, False)``: cannot tell yet, the request is skipped this step."""
        ...

    def update_state_after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted: ``block_ids`` is its whole block table; the ``num_external_tokens`` tokens
        after its local hit are the connector's to load. A connector with a true ``wants_num_cached_blocks``
        attribute gets a fourth argument: how many leading blocks are in the prefix cache after the allocation, or
        with ``kv_connector_groups`` one list per group of the tokens of each of its blocks' cache key, 0 for a block
        not cached (``get_block_hash_num_tokens``: sparse retention and a window among groups of different block
        sizes leave blocks anywhere in a table out of the cache)."""
        ...

    def request_finished(self, req_id: str, block_ids: list[int]) -> bool | tuple[bool, dict[str, Any] | None]:
        """The request finished; ``block_ids`` hold its computed tokens. True (or ``(True, params)``): the engine
        is sending them; the scheduler frees them when ``update_kv_transfers(finished_sending=...)`` names the
        request. ``params`` are handed back in ``UpdateResult.kv_transfer_params``."""
        ...


K = TypeVar("K")


def claim_invalid_blocks(
    tables: Iterable[tuple[K, Sequence[int], int]], invalid: Container[int], block_size: int
) -> list[tuple[K, int | None]]:
    """Which running requests invalid blocks roll back (vLLM's synchronous loads; docs/semantics.md, KV connector).
    ``tables``: ``(key, block table, done)`` per running request in running order, ``done`` its computed count
    less its tokens in the step being applied. Returns ``(key, idx)`` for each request holding an invalid block
    among its first ``ceil(done / block_size)`` blocks, in order: ``idx`` is the block it claims (its computed
    count is cut to ``idx * block_size``), or None when an earlier request claimed every such block (its computed
    count becomes ``done``)."""
    claimed: set[int] = set()
    out: list[tuple[K, int | None]] = []
    for key, blocks, done in tables:
        affected = False
        cut: int | None = None
        for idx, b in enumerate(blocks[: max(0, -(-done // block_size))]):
            if b not in invalid:
                continue
            affected = True
            if b in claimed:
                continue
            claimed.add(b)
            if cut is None:
                cut = idx
        if affected:
            out.append((key, cut))
    return out
