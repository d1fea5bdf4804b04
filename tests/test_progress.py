"""Progress output (tqdm): drawn on a terminal, plain start/end lines elsewhere, nothing when disabled."""

from __future__ import annotations

import io

from kvsched.bench.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_tqdm_bar_on_a_terminal() -> None:
    stream = _Tty()
    p = Progress(stream)
    p.start("c | rust")
    p.update(0.5, "step 32 running 7")
    p.message("wrote x.json")
    p.finish("(64 steps)")
    text = stream.getvalue()
    assert "c | rust" in text and "%|" in text  # a tqdm bar was drawn
    assert "wrote x.json" in text
    assert text.rstrip().endswith("c | rust: done in 0.0s (64 steps)") or "done in" in text.splitlines()[-1]


def test_progress_prints_plain_lines_off_a_terminal_and_nothing_when_disabled() -> None:
    stream = io.StringIO()
    p = Progress(stream)
    p.start("a | reference")
    p.update(0.5, "detail")
    p.finish()
    assert stream.getvalue().splitlines()[0] == "a | reference ..."
    assert "%|" not in stream.getvalue() and "done in" in stream.getvalue()
    quiet = io.StringIO()
    q = Progress(quiet, enabled=False)
    q.start("x")
    q.update(1.0, "y")
    q.message("z")
    q.finish()
    assert quiet.getvalue() == ""
