"""The flat batch layout a paged-attention runner needs for the most recent step. Mirrors
``rust/kvsched-core/src/model_inputs.rs``.

Under decode context parallelism a block id covers ``block_size * dcp_world_size`` tokens and names
``block_size`` slots on every DCP rank; the slot mapping is per rank, as vLLM's workers compute it: a block's
tokens are dealt to the ranks round-robin in runs of ``cp_kv_cache_interleave_size``, and a token stored on
another rank maps to the padding slot -1.
"""

from __future__ import annotations

import numpy as np

from .._errors import InvalidOutputError, InvalidRequestError, SchedulerTypeError
from .convert import _indptr
from .output import ModelInputs, SchedulerOutput
from .state import _SchedulerState

PAD_SLOT_ID = -1  # vLLM's padding slot: this token's K/V is stored on another DCP rank


class _ModelInputsMixin(_SchedulerState):
    """``prepare_model_inputs``."""

    def prepare_model_inputs(self, out: SchedulerOutput, *, dcp_rank: int | None = None) -> ModelInputs:
        """Flat runner inputs for the most recent step, valid until the scheduler next changes, as DCP rank
        ``dcp_rank`` (None: 0) sees them (only ``slot_mapping`` differs between ranks)."""
        c = self._config
        dcp_rank = 0 if dcp_rank is None else dcp_rank
        if isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int):
            raise SchedulerTypeError(f"dcp_rank must be an int, got {type(dcp_rank).__name__}")
        if c.kv_cache_groups is not None:
            raise InvalidRequestError(
                "prepare_model_inputs does not support kv_cache_groups (it lays out one block table)"
            )
        if not 0 <= dcp_rank < c.dcp_world_size:
            raise InvalidRequestError(f"dcp_rank must be in [0, dcp_world_size={c.dcp_world_size}), got {dcp_rank}")
        out = self._check_output(out)
        if out is not self._last_out or not self._last_out_fresh:
            raise InvalidOutputError("prepare_model_inputs needs the latest output, before other changes")
        bs, rank_bs, dcp, inter = self._bs, c.block_size, c.dcp_world_size, c.cp_kv_cache_interleave_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for k, (r, _, _) in enumerate(out._entries):
            start = int(out.num_computed_tokens[k])
            end = start + int(out.num_scheduled_tokens[k])
            drafts = out.spec_token_ids[out.spec_token_ids_indptr[k] : out.spec_token_ids_indptr[k + 1]]
            seq = r.token_ids + drafts.tolist()
            for pos in range(start, end):
                if pos < r.num_tokens:
                    tokens.append(r.token_ids[pos])
                elif self._config.async_scheduling:
                    tokens.append(-1)  # sampled by a step still in flight, or a draft placeholder: the runner's
                elif pos < len(seq):
                    tokens.append(seq[pos])
                else:
                    raise InvalidOutputError(f"{r.req_id!r}: token at position {pos} is not known yet")
                positions.append(pos)
                # vLLM's worker slot mapping: a block's tokens are dealt to the DCP ranks in runs of `inter`.
                off = pos % bs
                if (off // inter) % dcp == dcp_rank:
                    slots.append(r.block_ids[pos // bs] * rank_bs + off // (dcp * inter) * inter + off % inter)
                else:
                    slots.append(PAD_SLOT_ID)
            seq_lens.append(end)
            tables.append(r.block_ids)
        num_reqs = len(tables)
        width = max((len(t) for t in tables), default=0)
        block_table = np.zeros((num_reqs, width), dtype=np.int32)
        for k, t in enumerate(tables):
            block_table[k, : len(t)] = t
        query_start_loc = _indptr(out.num_scheduled_tokens.tolist())
        return ModelInputs(
            input_token_ids=np.array(tokens, dtype=np.int32),
            input_positions=np.array(positions, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int32),
            query_start_loc=query_start_loc,
            seq_lens=np.array(seq_lens, dtype=np.int32),
            block_table=block_table,
            logits_indices=(query_start_loc[1:] - 1).astype(np.int32),
            num_reqs=num_reqs,
            num_tokens=len(tokens),
            max_seq_len=max(seq_lens, default=0),
            max_query_len=int(out.num_scheduled_tokens.max(initial=0)),
        )
