"""Progress of ``kvsched simulate`` on stderr: one bar over a whole sweep.

The bar counts runs. A sweep of N runs is N units; a run moves its unit from 0 to 1 as its requests finish (with
a horizon: as simulated time reaches it), and a finished run fills its unit, so the bar ends at exactly N of N.
Its position never passes the total, so its ETA (tqdm's, from the rate so far) is never negative. On a terminal
tqdm draws the bar at once; elsewhere (logs, pipes) one line is printed when the sweep starts and one when each
run ends, so a long sweep shows progress there too. tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["SimProgress"]

_UNITS = 1000  # a run's share of the bar, in steps of a thousandth


class SimProgress:
    """Progress of ``num_runs`` simulated runs (see the module docstring)."""

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
        self._label = ""
        self._num_requests = 0
        self._horizon: float | None = None
        self._run_t0 = 0.0
        self.position = 0  # the bar's position, in thousandths of a run (at most ``total``)

    @property
    def total(self) -> int:
        return _UNITS * self.num_runs

    def _write(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()

    def start_run(self, label: str, num_requests: int, horizon: float | None = None) -> None:
        """A run of ``num_requests`` requests starts (``horizon``: it stops at this simulated time)."""
        self._label = label
        self._num_requests = num_requests
        self._horizon = horizon
        self._run_t0 = time.monotonic()
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

    def _show(self, sim_time: float, num_finished: int, *, refresh: bool = False) -> None:
        bar = self._bar
        if bar is None:
            return
        if self._horizon is not None and self._horizon > 0:
            fraction = sim_time / self._horizon
        else:
            fraction = num_finished / self._num_requests if self._num_requests else 1.0
        target = self._done * _UNITS + round(min(max(fraction, 0.0), 1.0) * _UNITS)
        bar.set_description_str(f"run {min(self._done + 1, self.num_runs)}/{self.num_runs}", refresh=False)
        bar.set_postfix_str(
            f"{self._label} t={sim_time:.0f}s {num_finished:,}/{self._num_requests:,} done", refresh=False
        )
        if target > bar.n:
            bar.update(min(target, self.total) - bar.n)
        elif refresh:
            bar.refresh()
        self.position = int(bar.n)

    def update(self, sim_time: float, num_finished: int) -> None:
        """The current run has reached simulated time ``sim_time`` with ``num_finished`` requests finished."""
        if self._bar is not None:
            self._show(sim_time, num_finished)

    def finish_run(self, detail: str = "") -> None:
        """The current run has ended; ``detail`` is shown off a terminal."""
        self._done = min(self._done + 1, self.num_runs)
        if not self._enabled:
            return
        bar = self._bar
        if bar is not None:
            target = self._done * _UNITS
            if target > bar.n:
                bar.update(target - bar.n)
            self.position = int(bar.n)
            return
        elapsed = time.monotonic() - self._run_t0
        self._write(f"run {self._done}/{self.num_runs} {self._label}: {detail + ', ' if detail else ''}{elapsed:.1f}s")

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
