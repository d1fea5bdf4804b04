"""``kvsched simulate``'s workloads fit the configuration: drawn prompt lengths are clipped to
``max_model_len - 1`` (nothing else about the workload changes, and nothing at all when every prompt fits), the
summary says how many were clipped and how many outputs capped, and a workload that cannot fit is refused before
anything runs."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched.sim import PRESETS, TraceFormatError, WorkloadSpec, generate_workload, parse_length, simulate, summarize
from kvsched.sim.sweep import run_sweep
from kvsched.sim.workload import check_prompt_lengths, dump_trace

pytestmark = requires_rust

MODEL = PRESETS["llama-3.1-8b-h100"]
FIELDS = ("arrival_time", "output_len", "tenant", "priority", "prefix_group", "prefix_len")


def _readme_spec(**kw: Any) -> WorkloadSpec:
    """The workload of the README's simulate example (seed 0 draws one 8,362-token prompt at 20 req/s)."""
    from kvsched.sim import parse_tenants

    base: dict[str, Any] = {
        "rate": 20.0,
        "duration": 600.0,
        "prompt_len": parse_length("lognormal:1000:0.5"),
        "output_len": parse_length("lognormal:200:0.6"),
        "tenants": parse_tenants("a:0.7:1:1,b:0.2:1:1,c:0.1:1:0"),
        "seed": 0,
    }
    return WorkloadSpec(**{**base, **kw})


def test_a_workload_whose_prompts_fit_is_identical_with_and_without_the_limit() -> None:
    spec = _readme_spec(rate=4.0, duration=120.0)
    free = generate_workload(spec)
    assert int(free.prompt_len.max()) < 8191  # no prompt needs clipping
    fitted = generate_workload(spec, max_model_len=8192)
    assert fitted.num_clipped_prompts == 0
    for name in ("prompt_len", *FIELDS):
        np.testing.assert_array_equal(getattr(fitted, name), getattr(free, name), err_msg=name)


def test_clipping_cuts_only_the_prompts_that_do_not_fit() -> None:
    spec = _readme_spec()
    free = generate_workload(spec)
    over = free.prompt_len > 8191
    assert over.sum() >= 1 and int(free.prompt_len.max()) == 8362
    fitted = generate_workload(spec, max_model_len=8192)
    assert fitted.num_clipped_prompts == int(over.sum())
    np.testing.assert_array_equal(fitted.prompt_len, np.minimum(free.prompt_len, 8191))
    for name in FIELDS:  # the seeded stream is unchanged: every other draw is the same
        np.testing.assert_array_equal(getattr(fitted, name), getattr(free, name), err_msg=name)


def test_the_summary_counts_clipped_prompts_and_capped_outputs() -> None:
    spec = WorkloadSpec(
        rate=10.0, duration=20.0, prompt_len=parse_length("lognormal:600:0.8"), output_len=parse_length("300"), seed=2
    )
    w = generate_workload(spec, max_model_len=1024)
    res = simulate(w, {"max_model_len": 1024, "num_blocks": 4096}, MODEL)
    o = summarize(res)["overall"]
    free = generate_workload(spec).prompt_len
    assert o["num_clipped_prompts"] == w.num_clipped_prompts == int((free > 1023).sum()) > 0
    assert o["num_capped_outputs"] == int((w.prompt_len + 300 > 1024).sum()) > 0
    assert o["num_finished"] == len(w)


class _Counting:
    """A scheduler factory that counts the schedulers it builds (the runs that started)."""

    def __init__(self) -> None:
        self.built = 0

    def __call__(self, config: Any) -> Any:
        from kvsched import Scheduler

        self.built += 1
        return Scheduler(config)


def test_a_sweep_clips_to_its_smallest_max_model_len_and_every_run_sees_the_same_requests() -> None:
    spec = WorkloadSpec(rate=5.0, duration=10.0, prompt_len=parse_length("uniform:100:1500"), seed=4)
    runs = run_sweep(spec, axes={"max_model_len": [2048, 1024], "num_blocks": [4096]}, step_model=MODEL)
    assert [r.result.config.max_model_len for r in runs] == [2048, 1024]
    o0, o1 = (r.summary["overall"] for r in runs)
    w = generate_workload(spec, max_model_len=1024)  # the requests every run of the sweep sees
    assert int(w.prompt_len.max()) == 1023
    assert o0["num_clipped_prompts"] == o1["num_clipped_prompts"] == w.num_clipped_prompts > 0
    for o, max_model_len in ((o0, 2048), (o1, 1024)):
        outputs = int(np.minimum(w.output_len, max_model_len - w.prompt_len).sum())
        assert o["num_finished"] == len(w) and o["num_output_tokens"] == outputs
        assert o["total_token_throughput"] * o["duration"] == pytest.approx(int(w.prompt_len.sum()) + outputs)


@pytest.mark.parametrize("prompt_len", ["9000", "uniform:8192:9000", "lognormal:9000:0.2"])
def test_prompts_that_cannot_fit_are_refused_before_any_run(prompt_len: str) -> None:
    spec = WorkloadSpec(rate=5.0, duration=10.0, prompt_len=parse_length(prompt_len))
    with pytest.raises(TraceFormatError, match=r"max_model_len 8192.*--set max_model_len"):
        check_prompt_lengths(spec, 8192)
    factory = _Counting()
    with pytest.raises(TraceFormatError, match="max_model_len"):
        run_sweep(spec, policies=["fcfs", "priority"], step_model=MODEL, scheduler=factory)
    assert factory.built == 0


def test_a_trace_that_does_not_fit_is_refused_before_any_run(tmp_path: Path) -> None:
    w = generate_workload(WorkloadSpec(rate=5.0, duration=10.0, prompt_len=parse_length("uniform:100:3000"), seed=1))
    factory = _Counting()
    axes = {"max_model_len": [4096, 2048]}
    with pytest.raises(TraceFormatError, match=r"prompt_len >= max_model_len \(2048\).*--set max_model_len="):
        run_sweep(w, axes=axes, step_model=MODEL, scheduler=factory)
    assert factory.built == 0
    fits = dataclasses.replace(w, prompt_len=np.minimum(w.prompt_len, 2047))
    assert len(run_sweep(fits, axes=axes, step_model=MODEL, scheduler=factory)) == 2
    trace = dump_trace(w, tmp_path / "t.jsonl")
    from kvsched.cli import main

    assert main(["simulate", "--trace", str(trace), "--set", "max_model_len=2048", "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_the_cli_clips_says_so_and_writes_the_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsched.cli import main

    out = tmp_path / "out"
    argv = ["simulate", "--rates", "4,8", "--prompt-len", "lognormal:1000:0.5", "--output-len", "lognormal:200:0.6",
            "--set", "max_model_len=2048", "--duration", "10", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "prompt lengths drawn over max_model_len - 1 were clipped to it: in 2 of 2 runs" in text
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert all(int(r["num_clipped_prompts"]) > 0 for r in rows)
    doc = json.loads((out / "sim.json").read_text())
    assert doc["runs"][0]["overall"]["num_clipped_prompts"] == int(rows[0]["num_clipped_prompts"])
    # A prompt length that cannot fit fails at once, with the fix in the message.
    assert main(["simulate", "--prompt-len", "9000", "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "max_model_len" in err and "--set max_model_len" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o2").exists()
