"""End to end on the CPU: a KV connector written in Python moves prefix KV between two ``kvsched.LLM`` engines.

Engine A generates; its connector saves the KV blocks of each finished request (``request_finished`` keeps them
for a "send", freed on ``finished_sending``). Engine B gets the same prompts; its connector offers the saved
full prompt blocks (``get_num_new_matched_tokens`` → asynchronous load), and "loads" them into B's paged KV cache
a few steps later, then reports ``finished_recving``. B's greedy outputs equal A's, and B's prefill computes only
the tokens that were not loaded. A load reported failed falls back to recomputing, with the same outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
pytest.importorskip("transformers")

from conftest import requires_rust  # noqa: E402
from kvsched import RequestStatus, Scheduler  # noqa: E402
from kvsched.engine import LLM, SamplingParams  # noqa: E402

pytestmark = requires_rust

BS = 8
PROMPTS = {
    "p0": [1, *range(10, 37)],  # 28 tokens: 3 full blocks loaded, 4 tokens computed
    "p1": [1, *range(50, 82)],  # 33 tokens: 4 full blocks loaded, 1 computed
    "p2": [1, *range(90, 113)],  # 24 tokens, exactly 3 blocks: all loaded, the last one recomputed
}


class SaveConnector:
    """Engine A's side: copies the KV of each finished request's full prompt blocks out of the runner's cache."""

    def __init__(self) -> None:
        self.saved: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.llm: LLM | None = None
        self.sending: list[str] = []

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def request_finished(self, req_id: str, block_ids: list[int]) -> tuple[bool, dict[str, Any]]:
        assert self.llm is not None
        full = len(PROMPTS[req_id]) // BS
        caches = self.llm.runner.kv_caches
        self.saved[req_id] = [[(k[b].clone(), v[b].clone()) for k, v in caches] for b in block_ids[:full]]
        self.sending.append(req_id)
        return True, {"saved_blocks": full}  # free the blocks once the "send" is reported over


class LoadConnector:
    """Engine B's side: offers the saved prompt blocks beyond the local hit, loads them ``delay`` steps later."""

    def __init__(self, saved: dict[str, Any], delay: int, fail: set[str], copy: bool = True) -> None:
        self.saved, self.delay, self.fail, self.copy = saved, delay, fail, copy
        self.pending: dict[str, tuple[int, list[int], int]] = {}  # req_id -> (steps waited, target blocks, first)
        self.loaded_tokens: dict[str, int] = {}
        self.local: dict[str, int] = {}
        self.failed: set[str] = set()

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> tuple[int, bool]:
        if req_id in self.failed:
            return 0, False  # its remote copy is gone: compute it here
        self.local[req_id] = num_computed_tokens
        have = len(self.saved.get(req_id, ())) * BS
        return max(0, have - num_computed_tokens), True

    def update_state_after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            self.pending[req_id] = (0, block_ids, self.local[req_id] // BS)  # the blocks after the local hit
            self.loaded_tokens[req_id] = num_external_tokens

    def request_finished(self, req_id: str, block_ids: list[int]) -> bool:
        return False

    def worker_step(self, llm: LLM) -> None:
        """The engine's transfer thread: finish loads that have waited ``delay`` steps."""
        done, failed = [], []
        for req_id, (waited, blocks, first) in list(self.pending.items()):
            if waited < self.delay:
                self.pending[req_id] = (waited + 1, blocks, first)
                continue
            del self.pending[req_id]
            done.append(req_id)
            if req_id in self.fail:
                failed.append(req_id)  # nothing written: the request must recompute
                self.failed.add(req_id)
                continue
            n = self.loaded_tokens[req_id] // BS if self.copy else 0
            for i in range(first, first + n):
                for layer, (k, v) in enumerate(llm.runner.kv_caches):
                    k[blocks[i]].copy_(self.saved[req_id][i][layer][0])
                    v[blocks[i]].copy_(self.saved[req_id][i][layer][1])
        if done:
            llm.scheduler.update_kv_transfers(finished_recving=done, failed_recving=failed)


class Recording(Scheduler):
    """Records the tokens each request is scheduled for while its prompt is not complete (its prefill)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self.prefill_tokens: dict[str, int] = {}

    def schedule(self) -> Any:
        out = super().schedule()
        for rid, comp, n in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, strict=True):
            prompt = len(PROMPTS[rid])
            self.prefill_tokens[rid] = self.prefill_tokens.get(rid, 0) + max(0, min(prompt, comp + n) - comp)
        return out


def run(llm: LLM, on_step: Any = None) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for rid, prompt in PROMPTS.items():
        llm.add_request(prompt, params, request_id=rid)
    outs: dict[str, list[int]] = {}
    for _ in range(500):
        if on_step is not None:
            on_step()
        if not llm.has_unfinished_requests():
            break
        for o in llm.step():
            outs[o.request_id] = o.output_token_ids
        llm.scheduler.check_invariants()
    assert sorted(outs) == sorted(PROMPTS)
    return outs


@pytest.fixture
def tiny(tiny_llama: tuple[Path, Any]) -> Path:
    return tiny_llama[0]


def engine(path: Path, conn: Any) -> LLM:
    return LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=BS,
        num_blocks=64,
        max_num_batched_tokens=32,
        scheduler_cls=lambda config: Recording(config, kv_connector=conn),
    )


@pytest.mark.parametrize("fail", [(), ("p1",)], ids=["loads", "p1-load-fails"])
def test_loaded_prefix_kv_gives_the_same_greedy_output(tiny: Path, fail: tuple[str, ...]) -> None:
    save = SaveConnector()
    a = engine(tiny, save)
    save.llm = a

    def end_sends() -> None:
        if save.sending:
            a.scheduler.update_kv_transfers(finished_sending=save.sending)
            save.sending = []

    expected = run(a, end_sends)
    end_sends()
    assert a.scheduler.num_held_kv_requests == 0 and a.scheduler.num_free_blocks == 63

    load = LoadConnector(save.saved, delay=3, fail=set(fail))
    b = engine(tiny, load)
    statuses: list[Any] = []

    def worker() -> None:
        statuses.append(b.scheduler.get_request_status("p0") if "p0" in b._requests else None)
        load.worker_step(b)

    got = run(b, worker)
    assert got == expected
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses, "p0 waited for its load"
    stats = b.scheduler.stats()
    assert stats.connector_prefix_cache_hits == sum(load.loaded_tokens.values()) == 24 + 32 + 24
    prefill = b.scheduler.prefill_tokens
    for rid, prompt in PROMPTS.items():
        if rid in fail:
            assert prefill[rid] == len(prompt), "a failed load recomputes the whole prompt"
        else:
            # only the tokens not loaded (at least the last one, to sample from)
            assert prefill[rid] == max(1, len(prompt) - load.loaded_tokens[rid]), rid
    assert b.scheduler.num_free_blocks == 63
    np.testing.assert_equal(len(load.pending), 0)


def test_the_loaded_kv_is_what_the_output_depends_on(tiny: Path) -> None:
    """Control: a "load" reported finished without writing the blocks changes the outputs (so the test above
    compares outputs that really come from the loaded KV)."""
    save = SaveConnector()
    a = engine(tiny, save)
    save.llm = a

    def end_sends() -> None:
        if save.sending:
            a.scheduler.update_kv_transfers(finished_sending=save.sending)
            save.sending = []

    expected = run(a, end_sends)
    load = LoadConnector(save.saved, delay=1, fail=set(), copy=False)
    b = engine(tiny, load)
    assert run(b, lambda: load.worker_step(b)) != expected
