"""vLLM 0.33's auxiliary output connector (``Scheduler.aux_output_connector``, routed-experts capture) on
:class:`kvsched.vllm.Scheduler`.

vLLM's ``AuxOutputSchedulerConnector`` decides one scheduling matter: how far a request's prefix hit may reach
(``max_cache_hit``, ``cap_external_hit``), since the routed experts of a cached block can be returned only while
the connector still holds them. kvsched's core asks that through its cache-hit cap (docs/semantics.md, "Cache-hit
cap"): :class:`AuxBridge` is that cap, and hands the questions to vLLM's connector with the ``Request`` objects.
Everything else the connector does is bookkeeping (the block hashes it sends per step, those it retains and
releases, its outputs), which the adapter drives from the same places of a step as vLLM's scheduler.

The connector reads ``kv_cache_manager.block_pool.get_cached_block(block_hash, group_ids)`` with vLLM's block
hashes: whether a block with that hash is in the prefix cache. :meth:`AuxBridge.cached` answers it: inside the
core's call from the mask the core passes with each question (the request's own blocks), outside it from the core
(``get_cached_block_mask``) for the blocks of requests the connector was told about.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._kv_view import lora_key

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["AuxBridge"]


class AuxBridge:
    """The core's cache-hit cap in front of vLLM's auxiliary output connector, and the prefix-cache oracle the
    connector reads through ``kv_cache_manager``."""

    def __init__(self, sched: Any, connector: Any = None) -> None:
        self._sched = sched
        self.connector = connector
        # Answers for vLLM block hashes while the core is inside a call (the mask of the request asked about).
        self._answers: dict[Any, bool] | None = None
        # vLLM block hash -> (the tokens of a request it was a block of, its block index, salt, LoRA key).
        self._sources: dict[Any, tuple[list[int], int, str | None, str | None]] = {}
        # Masks computed in the current adapter call, by the id of their token list.
        self._masks: dict[int, list[bool]] | None = None

    # ---- the core's cache-hit cap hooks ------------------------------------------------------------------

    def max_cache_hit(self, req_id: str, cached: list[bool]) -> int:
        request = self._sched.requests[req_id]
        with self._answering(request, cached):
            return self.connector.max_cache_hit(request)  # type: ignore[no-any-return]

    def cap_external_hit(self, req_id: str, cached: list[bool], num_local: int, num_external: int) -> int:
        request = self._sched.requests[req_id]
        with self._answering(request, cached):
            n = self.connector.cap_external_hit(request, num_local, num_external)
        bridge = self._sched._bridge
        if bridge is not None and isinstance(n, int):
            bridge.cap_external(req_id, max(0, min(n, num_external)))
        return n  # type: ignore[no-any-return]

    @contextmanager
    def _answering(self, request: Request, cached: list[bool]) -> Iterator[None]:
        self._answers = dict(zip(request.block_hashes, cached, strict=False))
        try:
            yield
        finally:
            self._answers = None

    # ---- calls outside the core's ------------------------------------------------------------------------

    @contextmanager
    def outside(self) -> Iterator[None]:
        """An adapter call on the connector between the core's calls: masks are computed once each."""
        self._masks = {}
        try:
            yield
        finally:
            self._masks = None

    def request_finished(self, request: Request) -> None:
        """vLLM's ``request_finished`` (a finish, an abort or a preemption), with the request's blocks known to
        the oracle."""
        self.learn(request)
        with self.outside():
            self.connector.request_finished(request)

    def learn(self, request: Request) -> None:
        """Remembers where the request's block hashes come from, for the oracle."""
        hashes = request.block_hashes
        if not hashes:
            return
        tokens = list(request.all_token_ids)
        salt, lora = request.cache_salt, lora_key(request.lora_request)
        sources = self._sources
        for i, h in enumerate(hashes):
            sources[h] = (tokens, i, salt, lora)
        limit = 4 * self._sched.kv_config.num_blocks + 1024
        if len(sources) > limit:
            # Blocks no longer cached answer "not cached" either way, unless the same blocks are cached again
            # later by a request the connector has not been told about yet.
            with self.outside():
                for h in [h for h in sources if not self.cached(h)]:
                    del sources[h]

    # ---- the oracle --------------------------------------------------------------------------------------

    def cached(self, block_hash: Any) -> bool:
        """Whether a block with vLLM's hash ``block_hash`` is in the core's prefix cache now."""
        answers = self._answers
        if answers is not None:
            return answers.get(block_hash, False)
        source = self._sources.get(block_hash)
        if source is None:
            # A block of a live request the connector was not told about yet.
            for request in list(self._sched.requests.values()):
                if block_hash in request.block_hashes:
                    self.learn(request)
                    break
            source = self._sources.get(block_hash)
            if source is None:
                return False
        tokens, i, salt, lora = source
        masks = self._masks
        mask = masks.get(id(tokens)) if masks is not None else None
        if mask is None:
            mask = self._sched.core.get_cached_block_mask(tokens, cache_salt=salt, lora_name=lora)
            if masks is not None:
                masks[id(tokens)] = mask
        return i < len(mask) and bool(mask[i])
