"""CUDA graphs for decode-only steps: one replay instead of hundreds of kernel launches per step.

A decode-only step (every request schedules one token) is shaped by its number of requests alone, so the
model's forward is captured once per padded batch size into static input buffers. At run time the step's
inputs are copied into those buffers and the graph for the smallest size that fits is replayed. Padding rows
get an empty query (``query_start_loc`` repeats), so the attention kernel skips them, and write their K/V to
slot 0 of the null block, which no request ever reads. Needs CUDA and the Triton attention backend (the
reference backend loops on the host and cannot be captured).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from .model import LlamaForCausalLM

__all__ = ["DecodeGraphs", "graph_batch_sizes"]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch_size`` (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.backend, self.block_size = model, kv_caches, backend, block_size
        cap = max_batch_size
        self.sizes = graph_batch_sizes(cap)
        self.input_ids = torch.zeros(cap, dtype=torch.int32, device=device)
        self.positions = torch.zeros(cap, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(cap, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(cap + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(cap, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(cap, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool: Any = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first, so the smaller ones fit in its memory pool
                pool = self._capture(bs, pool)

    def _capture(self, bs: int, pool: Any) -> Any:
        self._forward(bs)  # warm-up outside the capture: Triton compiles, the allocator settles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[bs] = self._forward(bs)
        torch.cuda.synchronize()
        self.graphs[bs] = graph
        return graph.pool()

    def _replay(self, bs: int) -> None:
        self.graphs[bs].replay()

    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            num_reqs=bs,
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
            block_size=self.block_size,
            query_start_loc_cpu=np.arange(bs + 1, dtype=np.int32),
            seq_lens_cpu=np.ones(bs, dtype=np.int32),
        )
        out: torch.Tensor = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta, self.backend)
        return out

    def can_run(self, num_reqs: int, num_tokens: int, block_table_width: int) -> bool:
        return num_tokens == num_reqs <= self.sizes[-1] and block_table_width <= self.block_table.shape[1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states of a decode-only step (``len(input_ids)`` requests, one token each)."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.query_start_loc[: n + 1].copy_(query_start_loc)
        self.seq_lens[:n].copy_(seq_lens)
        self.block_table[:n, : block_table.shape[1]].copy_(block_table)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()  # slot 0 = the null block, never read
            self.query_start_loc[n + 1 : bs + 1].fill_(n)  # empty queries: the kernel returns at once
        self._replay(bs)
        return self.outputs[bs][:n]
