"""The reference's result types: ``SchedulerOutput``, ``UpdateResult`` and ``ModelInputs``.

Mirrors ``rust/kvsched-core/src/output.rs``: the same fields as the core's types (``kvsched._core``), as plain
Python objects. A ``SchedulerOutput`` also carries private links to the requests it scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .request import _Request

__all__ = ["ModelInputs", "SchedulerOutput", "UpdateResult"]


class SchedulerOutput:
    """What one ``schedule()`` call decided. Array fields are int32 arrays; CSR pairs end in ``_indptr``.

    ``_owner`` and ``_entries`` are private: they tie the output to its scheduler and to the exact request
    objects it scheduled (so an id reused after a request finished never receives a stale step's tokens).
    """

    __slots__ = (
        "_cached_blocks",
        "_encoder_hashes",
        "_entries",
        "_group_new_block_ids",
        "_group_new_block_ids_indptr",
        "_owner",
        "_primary_group",
        "_swapped_out",
        "finished_req_ids",
        "free_encoder_hashes",
        "kv_cache_block_copies",
        "kv_connector_metadata",
        "new_block_ids",
        "new_block_ids_indptr",
        "new_req_ids",
        "num_computed_tokens",
        "num_scheduled_tokens",
        "preempted_req_ids",
        "req_ids",
        "resumed_req_ids",
        "scheduled_encoder_inputs",
        "scheduled_encoder_inputs_indptr",
        "scheduled_encoder_loads",
        "scheduled_encoder_loads_indptr",
        "spec_token_ids",
        "spec_token_ids_indptr",
        "step_id",
        "swap_in",
        "swap_out",
        "total_num_scheduled_tokens",
        "zero_block_ids",
    )
    step_id: int
    req_ids: list[str]
    num_scheduled_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    new_req_ids: list[str]
    resumed_req_ids: list[str]
    new_block_ids: np.ndarray
    new_block_ids_indptr: np.ndarray
    # with a Mamba group: every attention-group block this step allocated, group by group (vLLM's
    # new_block_ids_to_zero); empty otherwise
    zero_block_ids: np.ndarray
    # (m, 2) int32: with prefix hits inside a block, block copies (source, destination) run before the forward pass
    # (vLLM's kv_cache_block_copies), group by group; empty otherwise
    kv_cache_block_copies: np.ndarray
    spec_token_ids: np.ndarray
    spec_token_ids_indptr: np.ndarray
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    swap_out: np.ndarray  # (m, 2) int32: GPU block -> CPU block, copied before the forward pass
    swap_in: np.ndarray  # (m, 2) int32: CPU block -> GPU block, copied after swap_out
    kv_connector_metadata: Any  # the KV connector's build_connector_meta(out), None without a connector
    scheduled_encoder_inputs: np.ndarray  # int32 CSR: indices of the encoder inputs computed this step
    scheduled_encoder_inputs_indptr: np.ndarray
    scheduled_encoder_loads: np.ndarray  # int32 CSR: indices of the encoder inputs the EC connector loads
    scheduled_encoder_loads_indptr: np.ndarray
    free_encoder_hashes: np.ndarray  # uint64: encoder-cache entries evicted since the previous step
    _encoder_hashes: list[int]  # hashes this step computes (they leave the cache if it fails)
    _owner: object
    _entries: list[tuple[_Request, bool, int]]  # (request, was a prefill chunk, number of drafts scheduled)
    _cached_blocks: list[tuple[int, bytes]]  # (block, hash) this step entered into the prefix cache
    _swapped_out: list[_Request]  # victims this step swapped out
    _group_new_block_ids: list[np.ndarray]  # every group's but the primary's, in group order
    _group_new_block_ids_indptr: list[np.ndarray]  # their CSR offsets
    _primary_group: int  # the group whose ids are new_block_ids (the first that is not Mamba)

    def _group_slot(self, group: int) -> int | None:
        """Where ``group``'s ids sit in ``_group_new_block_ids``; None for the primary group's."""
        num_groups = len(self._group_new_block_ids) + 1
        if not 0 <= group < num_groups:
            raise IndexError(f"group must be in [0, {num_groups}), got {group}")
        p = self._primary_group
        return None if group == p else group if group < p else group - 1

    def group_new_block_ids(self, group: int) -> np.ndarray:
        """Group ``group``'s new block ids, laid out as ``new_block_ids`` (CSR offsets:
        ``group_new_block_ids_indptr(group)``); the primary group's (the first that is not Mamba; group 0 with one
        group) are ``new_block_ids``."""
        slot = self._group_slot(group)
        return self.new_block_ids if slot is None else self._group_new_block_ids[slot]

    def group_new_block_ids_indptr(self, group: int) -> np.ndarray:
        """The CSR offsets of ``group_new_block_ids(group)``: ``new_block_ids_indptr`` for every group but a
        cross-attention or Mamba one."""
        slot = self._group_slot(group)
        return self.new_block_ids_indptr if slot is None else self._group_new_block_ids_indptr[slot]

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def one_token_each(self) -> bool:
        """No entry is a prefill chunk or carries drafts: every entry samples exactly one token."""
        return not any(is_chunk or num_drafts for _, is_chunk, num_drafts in self._entries)

    def num_scheduled_tokens_by_id(self) -> dict[str, int]:
        return dict(zip(self.req_ids, self.num_scheduled_tokens.tolist(), strict=True))

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(step_id={self.step_id}, req_ids={self.req_ids}, "
            f"num_scheduled_tokens={self.num_scheduled_tokens.tolist()}, "
            f"preempted={self.preempted_req_ids}, finished={self.finished_req_ids})"
        )


@dataclass(frozen=True)
class UpdateResult:
    """What ``update_from_output`` did: requests that stopped, why, and the tokens each entry added."""

    finished_req_ids: list[str]
    finish_reasons: np.ndarray  # int8 FinishReason values, aligned with finished_req_ids
    stop_reasons: np.ndarray  # int64: the stop token id, or -1
    num_new_tokens: np.ndarray  # int32, aligned with out.req_ids
    # the KV connector's request_finished params of the requests this call finished (those that gave some)
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    # streaming-input sessions whose current input part stopped (they continue), with its reason and stop token
    part_finished_req_ids: list[str] = field(default_factory=list)
    part_finish_reasons: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    part_stop_reasons: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class ModelInputs:
    """Flat int32 arrays for a paged-attention runner (see docs/api.md)."""

    input_token_ids: np.ndarray
    input_positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    logits_indices: np.ndarray
    num_reqs: int
    num_tokens: int
    max_seq_len: int
    max_query_len: int
