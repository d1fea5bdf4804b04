"""Progress output (tqdm): drawn on a terminal, plain start/end lines elsewhere, nothing when disabled; the
simulator's bar counts the runs of a sweep and never passes its total."""

from __future__ import annotations

import io
import re
from typing import Any

from conftest import requires_rust
from kvsched.bench.progress import Progress
from kvsched.sim.progress import SimProgress


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


# ---- kvsched simulate: one bar over a sweep --------------------------------------------------------------------

_PERCENT = re.compile(r"(\d+)%\|")


def _sim_spec(**kw: Any) -> Any:
    from kvsched.sim import WorkloadSpec, parse_length

    base: dict[str, Any] = {"rate": 20.0, "duration": 30.0, "prompt_len": parse_length("uniform:200:800"),
                            "output_len": parse_length("uniform:20:200"), "seed": 5}  # fmt: skip
    return WorkloadSpec(**{**base, **kw})


class _Recording(SimProgress):
    """Keeps every position the bar takes."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.positions: list[int] = []

    def update(self, sim_time: float, num_finished: int) -> None:
        super().update(sim_time, num_finished)
        self.positions.append(self.position)

    def finish_run(self, detail: str = "") -> None:
        super().finish_run(detail)
        self.positions.append(self.position)


@requires_rust
def test_simulate_bar_counts_whole_runs_and_ends_exactly_at_its_total() -> None:
    from kvsched.sim import PRESETS, generate_workload, simulate

    w = generate_workload(_sim_spec())
    stream = _Tty()
    prog = _Recording(3, stream=stream)
    for i in range(3):
        # The run drains past its last arrival (the old bar's total) and its steps are float sums.
        simulate(w, {"num_blocks": 2000}, PRESETS["llama-3.2-1b-h100"], progress=prog, progress_desc=f"run{i}")
    assert prog.position == prog.total == 3000
    prog.close()
    assert len(prog.positions) > 6  # moved within runs, not only at their ends
    assert prog.positions == sorted(prog.positions) and max(prog.positions) <= prog.total
    assert {1000, 2000, 3000} <= set(prog.positions)  # each run ends on its unit
    text = stream.getvalue()
    assert "run 3/3" in text and "run 4/3" not in text
    assert 0 < max(int(p) for p in _PERCENT.findall(text)) <= 100
    assert "<-" not in text  # no negative ETA


@requires_rust
def test_simulate_bar_with_a_horizon_never_passes_its_total() -> None:
    from kvsched.sim import PRESETS, generate_workload, simulate

    w = generate_workload(_sim_spec())
    prog = _Recording(1, stream=_Tty())
    simulate(w, {"num_blocks": 2000}, PRESETS["llama-3.1-8b-h100"], horizon=10.0, progress=prog)
    assert prog.positions == sorted(prog.positions) and prog.positions[-1] == prog.total == 1000
    prog.close()


@requires_rust
def test_a_sweep_off_a_terminal_prints_a_line_at_once_and_one_per_run() -> None:
    from kvsched.sim import PRESETS
    from kvsched.sim.sweep import run_sweep

    stream = io.StringIO()
    lines_when_first_run_started: list[int] = []

    class _Spy(SimProgress):
        def start_run(self, label: str, num_requests: int, horizon: float | None = None) -> None:
            super().start_run(label, num_requests, horizon)
            lines_when_first_run_started.append(len(stream.getvalue().splitlines()))

    import kvsched.sim.sweep as sweep

    original = sweep.SimProgress
    sweep.SimProgress = lambda n: _Spy(n, stream=stream)  # type: ignore[assignment,misc]
    try:
        runs = run_sweep(_sim_spec(duration=5.0), rates=[5.0, 10.0], policies=["fcfs", "priority"],
                         step_model=PRESETS["llama-3.1-8b-h100"], progress=True)  # fmt: skip
    finally:
        sweep.SimProgress = original  # type: ignore[misc]
    lines = stream.getvalue().splitlines()
    assert lines_when_first_run_started[0] == 1 and lines[0] == "simulate: 4 runs"
    assert [line.split(":")[0] for line in lines[1:]] == [
        "run 1/4 rate5_fcfs", "run 2/4 rate5_priority", "run 3/4 rate10_fcfs", "run 4/4 rate10_priority",
    ]  # fmt: skip
    assert all(f"{r.summary['overall']['num_requests']}/" in line for r, line in zip(runs, lines[1:], strict=True))


def test_sim_progress_is_silent_when_disabled_and_clamps_bad_input() -> None:
    quiet = io.StringIO()
    p = SimProgress(2, enabled=False, stream=quiet)
    p.start_run("x", 10)
    p.update(5.0, 3)
    p.finish_run("done")
    p.message("m")
    p.close()
    assert quiet.getvalue() == ""
    bar = SimProgress(1, stream=_Tty())
    bar.start_run("x", 10)
    bar.update(1e9, 10**6)  # more finished than exist: the bar stops at its total
    assert bar.position == bar.total
    bar.finish_run()
    bar.finish_run()  # a stray extra finish does not pass the total either
    assert bar.position == bar.total
    bar.close()
