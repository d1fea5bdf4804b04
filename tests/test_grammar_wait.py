"""Where a request waiting for its structured-output grammar waits: parked out of `waiting` and queued at its
front once ready (park_grammar_waits=True, the newer vLLM rule), or kept in `waiting` at its place and skipped
by the admission passes that reach it (False, vLLM 0.33's rule). Both implementations."""

from __future__ import annotations

import kvsched
import pytest
from kvsched.reference import ReferenceScheduler


@pytest.mark.parametrize("impl", ["rust", "reference"])
@pytest.mark.parametrize(("park", "first"), [(True, "g"), (False, "c")])
def test_a_ready_grammar_wait_goes_first_only_when_parked(impl: str, park: bool, first: str) -> None:
    """Two slots: "a" and "b" run, "c" and then "g" (grammar not ready) wait; the pass never reaches "g". Its
    grammar becomes ready; when "a" finishes, the freed slot goes to "g" if parked (queued at the front), to the
    older "c" if "g" kept its place behind it (vLLM 0.33)."""
    cfg = kvsched.SchedulerConfig(num_blocks=64, max_model_len=256, max_num_seqs=2, park_grammar_waits=park)
    core = kvsched.Scheduler(cfg) if impl == "rust" else ReferenceScheduler(cfg)
    core.add_request("a", list(range(10, 18)), max_tokens=2)
    core.add_request("b", list(range(20, 28)), max_tokens=8)
    core.add_request("c", list(range(30, 38)), max_tokens=8)
    core.add_request("g", list(range(40, 48)), max_tokens=8, ready=False)
    out = core.schedule()
    assert sorted(out.req_ids) == ["a", "b"]
    stats = core.stats()
    assert (stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (1, 1)  # "g" deferred from the start
    core.set_ready("g")
    for _ in range(4):
        core.update_from_output(out, [[9] for _ in out.req_ids])
        out = core.schedule()
        if out.new_req_ids:
            assert out.new_req_ids[0] == first
            return
    raise AssertionError("no slot was freed")
