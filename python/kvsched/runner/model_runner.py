"""``ModelRunner``: the scheduler's ``ModelInputs`` in, one sampled token per finished-prompt request out.

Per step: the flat int32 arrays are copied into pinned host buffers and sent to the device with one
non-blocking copy each; the model runs over the flat batch; logits are computed only for the last scheduled
token of the requests whose prompt (plus outputs so far) is now fully in the KV cache; those rows are sampled.
The result is the ragged ``(values, indptr)`` pair ``Scheduler.update_from_output`` takes, with empty entries
for partial prefills (the scheduler's ``is_prefill_chunk``: ``seq_lens[i] < num_tokens(r)``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .attention import AttentionMetadata, allocate_kv_cache
from .attention_factory import make_backend
from .config import ModelConfig
from .cuda_graphs import DecodeGraphs
from .model import LlamaForCausalLM
from .sampler import sample
from .swap import CpuKvPool

__all__ = ["ModelRunner"]


class _RequestTable:
    """Per-request sampling state as struct-of-arrays indexed by a slot, so a step gathers it with one lookup
    per request and numpy fancy indexing (no per-request attribute reads)."""

    def __init__(self, capacity: int = 64) -> None:
        self.slot_of: dict[str, int] = {}
        self.free: list[int] = []
        self.size = 0
        self.num_tokens = np.zeros(capacity, np.int64)  # prompt + outputs: the scheduler's num_tokens(r)
        self.num_output_tokens = np.zeros(capacity, np.int64)
        self.min_tokens = np.zeros(capacity, np.int64)
        self.temperature = np.zeros(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int64)
        self.top_p = np.ones(capacity, np.float32)
        self.stop_ids: dict[int, list[int]] = {}  # masked while num_output_tokens < min_tokens
        self.generators: dict[int, torch.Generator] = {}

    def add(
        self,
        req_id: str,
        num_prompt_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_tokens: int,
        stop_ids: list[int],
        generator: torch.Generator | None,
    ) -> None:
        if req_id in self.slot_of:
            raise ValueError(f"request {req_id!r} is already in the runner")
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.size
            self.size += 1
            if slot >= len(self.num_tokens):
                for name in (
                    "num_tokens",
                    "num_output_tokens",
                    "min_tokens",
                    "temperature",
                    "top_k",
                    "top_p",
                ):
                    old = getattr(self, name)
                    new = np.zeros(2 * len(old), old.dtype)
                    new[: len(old)] = old
                    setattr(self, name, new)
        self.slot_of[req_id] = slot
        self.num_tokens[slot] = num_prompt_tokens
        self.num_output_tokens[slot] = 0
        self.min_tokens[slot] = min_tokens
        self.temperature[slot] = temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p
        if stop_ids and min_tokens > 0:
            self.stop_ids[slot] = stop_ids
        if generator is not None:
            self.generators[slot] = generator

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.stop_ids.pop(slot, None)
            self.generators.pop(slot, None)
            self.free.append(slot)


class _Staging:
    """Grow-only pinned host buffers and their device twins, one per input array."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        # Recorded after a step's copies; waited on before the pinned buffers are written again.
        self.copied: torch.cuda.Event | None = None

    def begin(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def end(self) -> None:
        if self.pin:
            self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
            self.copied.record()

    def to_device(self, name: str, arr: np.ndarray) -> torch.Tensor:
        flat = np.ascontiguousarray(arr).reshape(-1)
        size = flat.shape[0]
        host = self.host.get(name)
        if host is None or host.shape[0] < size:
            cap = max(size, 2 * (host.shape[0] if host is not None else 0), 64)
            host = torch.empty(cap, dtype=torch.int32, pin_memory=self.pin)
            self.host[name] = host
            self.dev[name] = host if not self.pin else torch.empty(cap, dtype=torch.int32, device=self.device)
        # A numpy-side copy: the scheduler's arrays may be read-only views of native memory.
        host.numpy()[:size] = flat
        dev = self.dev[name]
        if dev is not host:
            dev[:size].copy_(host[:size], non_blocking=True)
        return dev[:size].view(arr.shape)


class ModelRunner:
    """Runs a :class:`LlamaForCausalLM` over the paged KV cache for the scheduler's steps."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "auto",
        cuda_graph_max_batch_size: int = 0,
        max_model_len: int | None = None,
        num_cpu_blocks: int = 0,
        remove_finished_requests: bool = True,
    ) -> None:
        self.model = model
        # execute() forgets the step's finished_req_ids, as vLLM's worker does. An owner that removes each
        # request itself when it finishes (kvsched.LLM) turns this off: the scheduler reports a finish one step
        # later, and by then the id may belong to a new request.
        self.remove_finished_requests = remove_finished_requests
        self.config: ModelConfig = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # The longest sequence the model's rotary table covers.
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.backend = make_backend(attention_backend, device, block_size, self.config.head_dim)
        self.kv_caches = allocate_kv_cache(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            device=device,
        )
        # The CPU swap pool (preemption by swapping; ``kvsched.runner.swap``), when the scheduler has one.
        self.cpu_pool = CpuKvPool(self.kv_caches, num_cpu_blocks) if num_cpu_blocks > 0 else None
        self._requests = _RequestTable()
        # Decode-only steps replay CUDA graphs when enabled (CUDA + Triton backend only).
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch_size > 0:
            if device.type != "cuda" or self.backend.name != "triton":
                raise ValueError("CUDA graphs need a CUDA device and the triton attention backend")
            max_len = max_model_len or self.config.max_position_embeddings
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                self.backend,
                max_batch_size=cuda_graph_max_batch_size,
                max_blocks_per_seq=-(-max_len // block_size),
                block_size=block_size,
                device=device,
            )
        self._staging = _Staging(device)
        # Seconds spent in the last execute(): host-side input preparation, and model + sampling.
        self.last_prep_s = 0.0
        self.last_model_s = 0.0

    # -- request bookkeeping ---------------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        num_prompt_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        min_tokens: int = 0,
        stop_ids: Sequence[int] = (),
    ) -> None:
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        self._requests.add(req_id, num_prompt_tokens, temperature, top_k, top_p, min_tokens, list(stop_ids), generator)

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._requests.remove(req_id)

    @property
    def num_requests(self) -> int:
        return len(self._requests.slot_of)

    # -- the step --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: Any, inputs: Any) -> tuple[np.ndarray, np.ndarray]:
        """Run one scheduled step; returns the sampled tokens as ragged ``(values, indptr)``, int32."""
        t0 = time.perf_counter()
        if self.remove_finished_requests:
            self.remove_requests(out.finished_req_ids)
        self._swap(out)
        n = int(inputs.num_reqs)
        if n == 0:
            self.last_prep_s, self.last_model_s = time.perf_counter() - t0, 0.0
            return np.zeros(0, np.int32), np.zeros(1, np.int32)
        table = self._requests
        slot_of = table.slot_of
        slots = np.fromiter((slot_of[r] for r in out.req_ids), np.int64, n)
        seq_lens = np.asarray(inputs.seq_lens)
        # A request samples once all its known tokens are in the KV cache; the others are prefill chunks.
        has_token = seq_lens >= table.num_tokens[slots]
        sample_rows = np.flatnonzero(has_token)
        sample_slots = slots[sample_rows]

        self._staging.begin()
        stage = self._staging.to_device
        input_ids = stage("input_ids", inputs.input_token_ids)
        positions = stage("positions", inputs.input_positions).long()
        qsl_cpu = np.asarray(inputs.query_start_loc)
        meta = AttentionMetadata(
            slot_mapping=stage("slot_mapping", inputs.slot_mapping).long(),
            query_start_loc=stage("query_start_loc", qsl_cpu),
            seq_lens=stage("seq_lens", seq_lens),
            block_table=stage("block_table", inputs.block_table),
            num_reqs=n,
            max_query_len=int(inputs.max_query_len),
            max_seq_len=int(inputs.max_seq_len),
            block_size=self.block_size,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens,
        )
        logits_rows = stage("logits_rows", np.asarray(inputs.logits_indices)[sample_rows]).long()
        self._staging.end()
        t1 = time.perf_counter()

        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(n, int(inputs.num_tokens), meta.block_table.shape[1]):
            hidden = graphs.run(
                input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table
            )
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        tokens = np.zeros(0, np.int64)
        if sample_rows.size:
            logits = self.model.compute_logits(hidden[logits_rows])
            tokens = self._sample(logits, sample_slots).cpu().numpy()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so last_model_s is this step's time
        t2 = time.perf_counter()
        self.last_prep_s, self.last_model_s = t1 - t0, t2 - t1

        table.num_tokens[sample_slots] += 1
        table.num_output_tokens[sample_slots] += 1
        indptr = np.zeros(n + 1, np.int32)
        np.cumsum(has_token, out=indptr[1:])
        return tokens.astype(np.int32), indptr

    def _swap(self, out: Any) -> None:
        """The step's block copies, before its forward pass: every ``swap_out``, then every ``swap_in``."""
        swap_out = getattr(out, "swap_out", None)
        swap_in = getattr(out, "swap_in", None)
        if (swap_out is None or not len(swap_out)) and (swap_in is None or not len(swap_in)):
            return
        if self.cpu_pool is None:
            raise ValueError("the step swaps KV blocks but this runner has no CPU pool (num_cpu_blocks=0)")
        self.cpu_pool.execute(swap_out, swap_in)

    @torch.inference_mode()
    def measure_preemption_costs(
        self, num_tokens: int = 256, num_blocks: int = 8, repeats: int = 3
    ) -> tuple[float, float]:
        """Seconds per token of a prefill (a timed forward pass of ``num_tokens`` tokens of one sequence) and
        seconds per block copied one way (a timed swap-out plus swap-in of ``num_blocks`` blocks, divided by
        twice their number): the scheduler's ``recompute_cost_per_token`` and ``swap_cost_per_block``. Best of
        ``repeats`` after one warm-up each. Call it before serving: it writes garbage KV into the first
        blocks of both pools (no request holds them yet)."""
        bs = self.block_size
        num_tokens = max(1, min(num_tokens, (self.num_blocks - 1) * bs, self.max_model_len))
        k = -(-num_tokens // bs)
        pos = np.arange(num_tokens, dtype=np.int64)
        slots = (1 + pos // bs) * bs + pos % bs
        dev = self.device
        qsl = np.array([0, num_tokens], np.int32)
        seq = np.array([num_tokens], np.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq).to(dev),
            block_table=torch.arange(1, k + 1, dtype=torch.int32, device=dev).view(1, k),
            num_reqs=1,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            block_size=bs,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
        positions = torch.from_numpy(pos).to(dev)

        def prefill() -> None:
            self.model(input_ids, positions, self.kv_caches, meta, self.backend)

        per_token = self._best_time(prefill, repeats) / num_tokens
        per_block = 0.0
        pool = self.cpu_pool
        if pool is not None:
            m = max(1, min(num_blocks, pool.num_blocks, self.num_blocks - 1))
            ids = np.arange(m, dtype=np.int32)
            out_pairs = np.stack([ids + 1, ids], axis=1)
            in_pairs = np.stack([ids, ids + 1], axis=1)

            def copy() -> None:
                pool.execute(out_pairs, None)
                pool.execute(None, in_pairs)

            per_block = self._best_time(copy, repeats) / (2 * m)
        return per_token, per_block

    def _best_time(self, fn: Any, repeats: int) -> float:
        sync = self.device.type == "cuda"
        best = float("inf")
        for i in range(repeats + 1):
            if sync:
                torch.cuda.synchronize(self.device)
            t = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize(self.device)
            if i > 0:  # the first run warms up
                best = min(best, time.perf_counter() - t)
        return best

    def _sample(self, logits: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        table = self._requests
        if table.stop_ids:
            for row in np.flatnonzero(table.num_output_tokens[slots] < table.min_tokens[slots]):
                stop_ids = table.stop_ids.get(int(slots[row]))
                if stop_ids:
                    logits[int(row), stop_ids] = float("-inf")
        temps = table.temperature[slots]
        if temps.max() < 1e-5:
            return logits.argmax(dim=-1)
        dev = logits.device
        temperature = torch.from_numpy(temps).to(dev, non_blocking=True)
        top_k = top_p = None
        if (table.top_k[slots] > 0).any():
            top_k = torch.from_numpy(table.top_k[slots]).to(dev, non_blocking=True)
        if (table.top_p[slots] < 1.0).any():
            top_p = torch.from_numpy(table.top_p[slots]).to(dev, non_blocking=True)
        generators = None
        if table.generators:
            generators = [table.generators.get(int(slot)) for slot in slots]
            if not any(g is not None for g in generators):
                generators = None
        return sample(logits, temperature, top_k, top_p, generators)
