"""What hosts that mirror the scheduler's state read of it (the vLLM adapter, a router), and tests: views of its
queues and of the prefix cache, each a fresh list, and the KV cache events recorded since the last take. Mirrors
``rust/kvsched-core/src/introspect.rs``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InvalidOutputError, InvalidRequestError, SchedulerTypeError
from ..kv_events import KVCacheEvents
from .admission import _AdmissionMixin
from .convert import _I64_MAX, _I64_MIN, _block_id, _check_tokens, _int_array, _is_int, _opt_str
from .output import SchedulerOutput


class _IntrospectMixin(_AdmissionMixin):
    """The running and waiting ids, a request's cached blocks, prefix-cache probes, block reference counts and
    the most recent step's output counts."""

    def encoder_cache_entries(self) -> dict[int, list[str]]:
        """The encoder cache's entries, hash ascending, each with the sorted ids of the requests referencing it
        (empty for a freeable entry)."""
        return {
            h: sorted({r.req_id for r, _ in e[1]}) for h, e in sorted(self._encoder.entries.items(), key=lambda x: x[0])
        }

    def running_req_ids(self) -> list[str]:
        return [r.req_id for r in self._running]

    def waiting_req_ids(self) -> list[str]:
        """Requests not running in the order admission would consider them (fair: at the current counters, as
        if admitting charged nothing; aging included; sjf residuals as they stand; fcfs: before the admission
        window's one-step reorderings): loaded requests first, then waiting, then the parked ones (blocked, or
        ready since the last step) in the order added."""
        ids = [r.req_id for r in self._kv_waiting.in_order()]
        ids += [r.req_id for r in self._waiting_in_order()]
        parked = sorted((r for r in self._requests.values() if r.parked), key=lambda r: r.add_seq)
        return ids + [r.req_id for r in parked]

    def get_num_cached_blocks(self, req_id: str) -> int:
        return self._get(req_id).num_cached_blocks

    def get_cached_block_mask(
        self, token_ids: Any, cache_salt: str | None = None, lora_name: str | None = None
    ) -> list[bool]:
        """For each full block of these tokens (hashed as a request's with these extra keys), whether the prefix
        cache holds a block with its hash now, block by block. Changes nothing; all False without prefix
        caching."""
        arr = _int_array(token_ids, "token_ids")
        salt, lora = _opt_str(cache_salt, "cache_salt"), _opt_str(lora_name, "lora_name")
        _check_tokens(arr, "token_ids", InvalidRequestError)
        tokens = arr.tolist()
        if not self._config.enable_prefix_caching:
            return [False] * (len(tokens) // self._bs)
        return [bool(self._cached.get(h)) for h in self._hasher.block_hashes_of(tokens, salt, lora)]

    def get_cached_block_ids(
        self,
        token_ids: Any,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        max_hit_tokens: int | None = None,
        group: int = 0,
    ) -> np.ndarray:
        """The blocks a prefix lookup of these tokens would hit now, in order: at most ``max_hit_tokens`` tokens'
        worth of full blocks (None: all but the last token, which must be computed; negative: none). Changes
        nothing (ref counts, LRU, stats); none without prefix caching. ``group``: that KV cache group's blocks
        of the hit (with ``kv_cache_groups``; every group's hit has the same length)."""
        num_groups = len(self._config.kv_cache_groups or (None,))
        if not _is_int(group):
            raise SchedulerTypeError(f"group must be an int, got {type(group).__name__}")
        if not 0 <= group < num_groups:
            raise InvalidRequestError(f"group must be in [0, {num_groups}), got {group}")
        arr = _int_array(token_ids, "token_ids")
        salt, lora = _opt_str(cache_salt, "cache_salt"), _opt_str(lora_name, "lora_name")
        if max_hit_tokens is not None:
            if not _is_int(max_hit_tokens):
                raise SchedulerTypeError(f"max_hit_tokens must be an int, got {type(max_hit_tokens).__name__}")
            if not _I64_MIN <= max_hit_tokens <= _I64_MAX:
                raise InvalidRequestError(f"max_hit_tokens is out of the int64 range: {max_hit_tokens}")
        _check_tokens(arr, "token_ids", InvalidRequestError)
        tokens = arr.tolist()
        limit = len(tokens) - 1 if max_hit_tokens is None else min(int(max_hit_tokens), len(tokens))
        if not self._config.enable_prefix_caching or limit <= 0:
            return np.zeros(0, dtype=np.int32)
        # Hash only as far as a lookup may read (and the tokens a look-ahead hash covers after it); with several
        # groups and the trailing-block drop a lookup reads one block past the hits it may keep.
        c = self._config
        margin = int(c.drop_trailing_hit_block and c.kv_cache_groups is not None)
        reach = (limit // self._bs + margin) * self._bs + c.hash_lookahead_tokens
        hashes = self._hasher.block_hashes_of(tokens[:reach], salt, lora)
        # _lookup leaves the block of the last of its tokens out: limit + 1 tokens allow limit // bs blocks.
        hits = self._lookup(hashes, limit + 1)
        if group > 0:
            hits = self._hits_of_groups(hits)[group]
        return np.array(hits, dtype=np.int32)

    def get_block_ref_cnt(self, block_id: int) -> int:
        """How many requests hold block ``block_id`` (0 when free, and always for the null block 0);
        ``InvalidRequestError`` for an id outside the pool."""
        b = _block_id(block_id)
        self._check_in_pool(b)
        return self._ref_cnt[b]

    def step_num_output_tokens(self, out: SchedulerOutput) -> np.ndarray:
        """vLLM's ``num_output_tokens`` column for each entry of ``out``: the request's output tokens plus its
        output placeholders as they were before the step added its own. Only for the most recent step, right
        after ``schedule()`` and before any other call changes the scheduler (as ``prepare_model_inputs``)."""
        out = self._check_output(out)
        if out is not self._last_out or not self._last_out_fresh:
            raise InvalidOutputError(
                "step_num_output_tokens needs the most recent step, right after schedule() and before any other "
                f"call changes the scheduler; step {out.step_id} is not that step"
            )
        counts = []
        for r, is_chunk, num_drafts in out._entries:
            placeholders = r.num_output_placeholders
            if self._config.async_scheduling and not is_chunk:  # the step's own: one per sampled token and draft
                placeholders -= 1 + num_drafts
            counts.append(r.num_output_tokens + placeholders)
        return np.array(counts, dtype=np.int32)

    def take_kv_cache_events(self) -> KVCacheEvents:
        """The KV cache events since the last call, in the order they happened (none unless
        ``enable_kv_cache_events``)."""
        width = 16 if self._config.prefix_hash_algo == "xxh3_128" else 32
        if self._events is None:
            return KVCacheEvents.empty(self._bs, width)
        return self._events.take(self._bs, width)

    def cached_block_hashes(self) -> list[bytes]:
        """The hash of every block in the prefix cache, in block id order (one entry per block)."""
        return [h for h in self._block_hash if h is not None]
