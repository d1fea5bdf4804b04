"""A dependency-free progress bar on stderr.

On a terminal it redraws one line (at most ten times a second); elsewhere (CI logs, pipes) it prints only a
line when a task starts and when it ends, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True, width: int = 28) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._width = width
        self._label = ""
        self._last_draw = 0.0
        self._t0 = 0.0

    def start(self, label: str) -> None:
        self._label = label
        self._t0 = time.monotonic()
        self._last_draw = 0.0
        if self._enabled and not self._tty:
            self._stream.write(f"{label} ...\n")
            self._stream.flush()
        self.update(0.0, "")

    def update(self, fraction: float, detail: str) -> None:
        """Redraw if on a terminal and the last redraw is old enough; cheap otherwise."""
        if not self._tty:
            return
        now = time.monotonic()
        if now - self._last_draw < 0.1 and fraction < 1.0:
            return
        self._last_draw = now
        fraction = min(max(fraction, 0.0), 1.0)
        filled = round(fraction * self._width)
        bar = "#" * filled + "-" * (self._width - filled)
        line = f"\r{self._label} [{bar}] {fraction * 100:5.1f}% {detail} ({now - self._t0:.1f}s)"
        self._stream.write(line + "\x1b[K")
        self._stream.flush()

    def finish(self, detail: str = "") -> None:
        if not self._enabled:
            return
        elapsed = time.monotonic() - self._t0
        if self._tty:
            self._stream.write("\r\x1b[K")
        self._stream.write(f"{self._label}: done in {elapsed:.1f}s {detail}\n")
        self._stream.flush()

    def message(self, text: str) -> None:
        if not self._enabled:
            return
        if self._tty:
            self._stream.write("\r\x1b[K")
        self._stream.write(text + "\n")
        self._stream.flush()
