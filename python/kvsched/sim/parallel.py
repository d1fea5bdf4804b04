"""A sweep's points in parallel: worker processes (``--jobs N``) or Ray tasks (``--ray``).

Each point is a :class:`~kvsched.sim.point.SweepPoint` (a few KB: the workload's recipe, not its requests) and
:func:`~kvsched.sim.point.run_point` runs it the same way wherever it runs, so the outputs equal the serial
run's. They are returned in the sweep's order.

Worker processes are started with ``spawn`` (no state inherited from the parent, the same on every platform) and
report their runs' progress through a queue to the parent's one bar. With Ray, each point is a task of one CPU,
the way Vidur's configuration search fans its simulations out over a Ray cluster: ``ray.init(address=...)``
joins an existing cluster (``"auto"``, ``"ray://host:10001"``) or, without an address, starts a local one; a
task's progress shows when it ends. Ray is the optional ``ray`` extra, imported only here.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import queue as queue_mod
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .point import RunOutput, SweepPoint, run_point
from .progress import SimProgress

__all__ = ["RayMissingError", "run_points_processes", "run_points_ray"]


class RayMissingError(ImportError):
    """``--ray`` was asked for but Ray is not installed."""


class _QueueProgress(SimProgress):
    """A worker's side of the bar: sends the simulator's progress calls to the parent, keyed by the point."""

    def __init__(self, q: Any, key: Hashable) -> None:
        super().__init__(1, enabled=False)
        self._q = q
        self._key = key

    def start_run(self, label: str, num_requests: int, horizon: float | None = None) -> None:
        self._q.put((self._key, "start", (label, num_requests, horizon)))

    def update(self, sim_time: float, num_finished: int) -> None:
        self._q.put((self._key, "update", (sim_time, num_finished)))

    def finish_run(self, detail: str = "") -> None:
        self._q.put((self._key, "finish", (detail,)))


_WORKER_QUEUE: Any = None


def _init_worker(q: Any) -> None:
    global _WORKER_QUEUE
    _WORKER_QUEUE = q


def _run_in_worker(key: int, point: SweepPoint) -> RunOutput:
    prog = _QueueProgress(_WORKER_QUEUE, key) if _WORKER_QUEUE is not None else None
    return run_point(point, prog)


def _relay(q: Any, progress: SimProgress) -> None:
    while True:
        try:
            key, kind, args = q.get_nowait()
        except queue_mod.Empty:
            return
        if kind == "start":
            progress.run_started(key, *args)
        elif kind == "update":
            progress.run_progress(key, *args)
        else:
            progress.run_finished(key, *args)


def run_points_processes(
    points: Sequence[SweepPoint],
    *,
    jobs: int,
    progress: SimProgress | None = None,
    on_run: Callable[[RunOutput], None] | None = None,
) -> list[RunOutput]:
    """Run ``points`` in ``jobs`` worker processes; the outputs in the order of ``points``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue() if progress is not None else None
    outputs: list[RunOutput | None] = [None] * len(points)
    with cf.ProcessPoolExecutor(
        max_workers=min(jobs, len(points)), mp_context=ctx, initializer=_init_worker, initargs=(q,)
    ) as pool:
        futures = {pool.submit(_run_in_worker, k, p): k for k, p in enumerate(points)}
        pending = set(futures)
        try:
            while pending:
                done, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
                if q is not None and progress is not None:
                    _relay(q, progress)
                for fut in done:
                    out = fut.result()
                    outputs[futures[fut]] = out
                    if on_run is not None:
                        on_run(out)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    if q is not None and progress is not None:
        _relay(q, progress)
    return [o for o in outputs if o is not None]


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayMissingError(
            f"--ray needs Ray, which is not installed here (pip install 'kvsched[ray]'): {exc}"
        ) from exc
    return ray


def run_points_ray(
    points: Sequence[SweepPoint],
    *,
    progress: SimProgress | None = None,
    on_run: Callable[[RunOutput], None] | None = None,
    address: str | None = None,
) -> list[RunOutput]:
    """Run ``points`` as Ray tasks of one CPU each (``ray.init(address=address)`` unless Ray is initialised);
    the outputs in the order of ``points``."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    task = ray.remote(num_cpus=1)(run_point)
    refs = [task.remote(p) for p in points]
    key_of = {ref: k for k, ref in enumerate(refs)}
    if progress is not None:
        for k, p in enumerate(points):
            progress.run_started(k, p.run_id, 1)
    outputs: list[RunOutput | None] = [None] * len(points)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            k = key_of[ref]
            out: RunOutput = ray.get(ref)
            outputs[k] = out
            if progress is not None:
                o = out.summary["overall"]
                progress.run_finished(k, f"{o['num_finished']:,}/{o['num_requests']:,} requests finished")
            if on_run is not None:
                on_run(out)
    return [o for o in outputs if o is not None]
