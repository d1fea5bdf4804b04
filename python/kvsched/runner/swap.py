"""The CPU side of preemption by swapping: a host KV pool shaped like the device pool, the block copies each
step's ``SchedulerOutput`` asks for, and the timings ``kvsched.LLM`` turns into the scheduler's cost constants.

``SchedulerOutput.swap_out`` is an ``(m, 2)`` int32 array of (device block, CPU block) pairs and ``swap_in`` one
of (CPU block, device block) pairs. Before the step's forward pass every ``swap_out`` copy is made, then every
``swap_in`` copy: per layer and per direction one gather (``index_select``) of all the blocks and one scatter
(``index_copy_``) for K and one for V, never a copy per block. On CUDA the host pool is pinned and the copies run
on a side stream that first waits for the compute stream (the last forward pass wrote the blocks being swapped
out) and that the compute stream then waits for (the forward pass overwrites swapped-out blocks and reads
swapped-in ones), so attention never reads a block before its copy lands.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["CpuKvPool"]


class CpuKvPool:
    """A host copy of the paged KV cache's shape (``num_cpu_blocks`` blocks per layer, K and V)."""

    def __init__(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], num_cpu_blocks: int) -> None:
        self.device_caches = device_caches
        self.num_blocks = num_cpu_blocks
        k0 = device_caches[0][0]
        self.device = k0.device
        self.pin = self.device.type == "cuda"
        shape = (num_cpu_blocks, *k0.shape[1:])

        def host() -> torch.Tensor:
            return torch.zeros(shape, dtype=k0.dtype, pin_memory=self.pin)

        self.caches = [(host(), host()) for _ in device_caches]
        self._stream: Any = torch.cuda.Stream(self.device) if self.pin else None  # type: ignore[no-untyped-call]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    def execute(self, swap_out: np.ndarray | None, swap_in: np.ndarray | None) -> None:
        """All of ``swap_out`` (device -> CPU), then all of ``swap_in`` (CPU -> device)."""
        has_out = swap_out is not None and len(swap_out) > 0
        has_in = swap_in is not None and len(swap_in) > 0
        if not (has_out or has_in):
            return
        if self._stream is None:
            if has_out:
                self._copy_out(swap_out)  # type: ignore[arg-type]
            if has_in:
                self._copy_in(swap_in)  # type: ignore[arg-type]
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            if has_out:
                self._copy_out(swap_out)  # type: ignore[arg-type]
            if has_in:
                self._copy_in(swap_in)  # type: ignore[arg-type]
        compute.wait_stream(self._stream)

    def _indices(self, pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        return torch.from_numpy(np.ascontiguousarray(arr[:, 0])), torch.from_numpy(np.ascontiguousarray(arr[:, 1]))

    def _copy_out(self, pairs: np.ndarray) -> None:
        src, dst = self._indices(pairs)
        src_dev = src.to(self.device, non_blocking=self.pin)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (CPU cache, gathered blocks on the host)
        for (dk, dv), (ck, cv) in zip(self.device_caches, self.caches, strict=True):
            for d, c in ((dk, ck), (dv, cv)):
                gathered = d.index_select(0, src_dev)
                if self.pin:  # device -> pinned host, asynchronously; scattered once all have landed
                    host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    host.copy_(gathered, non_blocking=True)
                    gathered = host
                staged.append((c, gathered))
        if self.pin:
            self._stream.synchronize()  # the host-side scatter reads the data
        for c, gathered in staged:
            c.index_copy_(0, dst, gathered)

    def _copy_in(self, pairs: np.ndarray) -> None:
        src, dst = self._indices(pairs)
        dst_dev = dst.to(self.device, non_blocking=self.pin)
        for (dk, dv), (ck, cv) in zip(self.device_caches, self.caches, strict=True):
            for d, c in ((dk, ck), (dv, cv)):
                gathered = c.index_select(0, src)
                if self.pin:
                    gathered = gathered.pin_memory().to(self.device, non_blocking=True)
                d.index_copy_(0, dst_dev, gathered)
