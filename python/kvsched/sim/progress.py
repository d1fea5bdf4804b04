"""Progress of ``kvsched simulate`` on stderr: one bar over a whole sweep.

The bar counts runs. A sweep of N runs is N units; a run moves its unit from 0 to 1 as its requests finish (with
a horizon: as simulated time reaches it), and a finished run fills its unit, so the bar ends at exactly N of N.
Its position never passes the total, so its ETA (tqdm's, from the rate so far) is never negative. Runs may go on
at once (a sweep's worker processes report theirs to the parent's bar, keyed by run: :meth:`SimProgress.run_started`,
:meth:`~SimProgress.run_progress`, :meth:`~SimProgress.run_finished`); the bar is then at the finished runs plus
the share of each running one. On a terminal tqdm draws the bar at once; elsewhere (logs, pipes) one line is
printed when the sweep starts and one when each run ends, so a long sweep shows progress there too. tqdm is
imported only when a bar is drawn.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Hashable
from typing import Any, TextIO

__all__ = ["SimProgress"]

_UNITS = 1000  # a run's share of the bar, in steps of a thousandth


class _Run:
    __slots__ = ("fraction", "horizon", "label", "num_requests", "t0")

    def __init__(self, label: str, num_requests: int, horizon: float | None) -> None:
        self.label = label
        self.num_requests = num_requests
        self.horizon = horizon
        self.t0 = time.monotonic()
        self.fraction = 0.0

    def advance(self, sim_time: float, num_finished: int) -> None:
        if self.horizon is not None and self.horizon > 0:
            fraction = sim_time / self.horizon
        else:
            fraction = num_finished / self.num_requests if self.num_requests else 1.0
        self.fraction = min(max(fraction, 0.0), 1.0)


class SimProgress:
    """Progress of ``num_runs`` simulated runs (see the module docstring). :meth:`start_run`, :meth:`update` and
    :meth:`finish_run` follow one run at a time (the simulator calls them); the ``run_*`` methods follow runs that
    go on at once, each by a key."""

    def __init__(self, num_runs: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        if num_runs < 1:
            raise ValueError(f"num_runs must be >= 1, got {num_runs}")
        self.num_runs = num_runs
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._started = False
        self._done = 0  # runs finished
        self._active: dict[Hashable, _Run] = {}
        self._last: _Run | None = None  # the run whose progress was reported last (shown after the bar)
        self.position = 0  # the bar's position, in thousandths of a run (at most ``total``)

    @property
    def total(self) -> int:
        return _UNITS * self.num_runs

    def _write(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()

    # -- one run at a time (the simulator's calls)

    def start_run(self, label: str, num_requests: int, horizon: float | None = None) -> None:
        """A run of ``num_requests`` requests starts (``horizon``: it stops at this simulated time)."""
        self.run_started(None, label, num_requests, horizon)

    def update(self, sim_time: float, num_finished: int) -> None:
        """The current run has reached simulated time ``sim_time`` with ``num_finished`` requests finished."""
        self.run_progress(None, sim_time, num_finished)

    def finish_run(self, detail: str = "") -> None:
        """The current run has ended; ``detail`` is shown off a terminal."""
        self.run_finished(None, detail)

    # -- runs that go on at once, by key

    def run_started(self, key: Hashable, label: str, num_requests: int, horizon: float | None = None) -> None:
        run = _Run(label, num_requests, horizon)
        self._active[key] = run
        self._last = run
        if not self._enabled:
            return
        if not self._started:
            self._started = True
            if self._tty:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=self.total,
                    desc=f"run 1/{self.num_runs}",
                    file=self._stream,
                    leave=False,
                    mininterval=0.2,
                    dynamic_ncols=True,
                    bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]{postfix}",
                )
            else:
                self._write(f"simulate: {self.num_runs} run{'s' if self.num_runs != 1 else ''}")
        self._show(0.0, 0, refresh=True)

    def run_progress(self, key: Hashable, sim_time: float, num_finished: int) -> None:
        run = self._active.get(key)
        if run is None:
            return
        run.advance(sim_time, num_finished)
        self._last = run
        if self._bar is not None:
            self._show(sim_time, num_finished)

    def run_finished(self, key: Hashable, detail: str = "") -> None:
        run = self._active.pop(key, None)
        self._done = min(self._done + 1, self.num_runs)
        if not self._enabled:
            return
        bar = self._bar
        if bar is not None:
            target = min(self._target(), self.total)
            if target > bar.n:
                bar.update(target - bar.n)
            self.position = int(bar.n)
            return
        label = run.label if run is not None else ""
        elapsed = time.monotonic() - run.t0 if run is not None else 0.0
        self._write(f"run {self._done}/{self.num_runs} {label}: {detail + ', ' if detail else ''}{elapsed:.1f}s")

    def _target(self) -> int:
        return self._done * _UNITS + sum(round(r.fraction * _UNITS) for r in self._active.values())

    def _show(self, sim_time: float, num_finished: int, *, refresh: bool = False) -> None:
        bar = self._bar
        if bar is None:
            return
        target = self._target()
        if len(self._active) <= 1:
            bar.set_description_str(f"run {min(self._done + 1, self.num_runs)}/{self.num_runs}", refresh=False)
        else:
            bar.set_description_str(
                f"{self._done}/{self.num_runs} runs done, {len(self._active)} running", refresh=False
            )
        run = self._last
        if run is not None:
            bar.set_postfix_str(
                f"{run.label} t={sim_time:.0f}s {num_finished:,}/{run.num_requests:,} done", refresh=False
            )
        if target > bar.n:
            bar.update(min(target, self.total) - bar.n)
        elif refresh:
            bar.refresh()
        self.position = int(bar.n)

    def message(self, text: str) -> None:
        """A line on the stream, above the bar if one is drawn."""
        if not self._enabled:
            return
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(text, file=self._stream)
        else:
            self._write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
