"""Progress of ``kvsched bench`` on stderr, drawn by tqdm.

On a terminal each task gets a tqdm bar (0-100 %, with a detail text); elsewhere (CI logs, pipes) only a line
when a task starts and when it ends is printed, so logs stay readable. tqdm is imported when a bar is drawn.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]

_TOTAL = 1000  # a task's bar counts per-mille of its fraction done


class Progress:
    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, width: int = 28) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._width = width
        self._label = ""
        self._t0 = 0.0
        self._bar: Any = None

    def start(self, label: str) -> None:
        self._close_bar()
        self._label = label
        self._t0 = time.monotonic()
        if not self._enabled:
            return
        if not self._tty:
            self._stream.write(f"{label} ...\n")
            self._stream.flush()
            return
        from tqdm import tqdm

        self._bar = tqdm(
            total=_TOTAL,
            desc=label,
            file=self._stream,
            leave=False,
            mininterval=0.1,
            bar_format="{desc} {percentage:5.1f}%|{bar:" + str(self._width) + "}| {postfix} ({elapsed})",
        )

    def update(self, fraction: float, detail: str) -> None:
        """Move the bar (tqdm redraws at most ten times a second); cheap when not on a terminal."""
        bar = self._bar
        if bar is None:
            return
        target = round(min(max(fraction, 0.0), 1.0) * _TOTAL)
        if target > bar.n:
            bar.set_postfix_str(detail, refresh=False)
            bar.update(target - bar.n)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def finish(self, detail: str = "") -> None:
        self._close_bar()
        if not self._enabled:
            return
        elapsed = time.monotonic() - self._t0
        self._stream.write(f"{self._label}: done in {elapsed:.1f}s {detail}\n")
        self._stream.flush()

    def message(self, text: str) -> None:
        if not self._enabled:
            return
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(text, file=self._stream)
            return
        self._stream.write(text + "\n")
        self._stream.flush()
