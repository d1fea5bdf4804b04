"""``kvsched.router`` against a brute-force model, and its hashing, errors and estimate on hand-made cases.

The model keeps a plain set of block keys per replica, the in-flight requests as a list, and re-derives every
policy's choice from scratch; hypothesis drives both with random streams of block events (out of order,
duplicated, ints and bytes for the same block, cleared), routing, finishing and replica loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsched import (
    DuplicateRequestError,
    InvalidConfigError,
    InvalidRequestError,
    SchedulerError,
    SchedulerTypeError,
    UnknownRequestError,
)
from kvsched.router import (
    POLICIES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DuplicateReplicaError,
    NoReplicaAvailableError,
    ReplicaLoad,
    Router,
    RouterConfig,
    UnknownReplicaError,
    block_key,
)
from kvsched.sim.steptime import StepTimeModel

pytestmark = requires_rust

BS = 4
STEP = StepTimeModel(step_s=0.01, prefill_token_s=1e-4, prefill_req_s=1e-3, decode_req_s=2e-4, kv_token_s=1e-7)


def config(policy: str, **kw: Any) -> RouterConfig:
    return RouterConfig(policy=policy, block_size=BS, step_time=STEP, balance_abs_threshold=3, **kw)  # type: ignore[arg-type]


# -- the brute-force model -----------------------------------------------------------------------------------


@dataclass
class Flight:
    req: str
    replica: str
    epoch: int
    uncached: int
    num_tokens: int
    prefilled: bool = False


@dataclass
class Model:
    cfg: RouterConfig
    slots: list[str | None] = field(default_factory=list)
    healthy: dict[str, bool] = field(default_factory=dict)
    blocks: dict[str, set[int]] = field(default_factory=dict)
    report: dict[str, tuple[int, int, int, int, float]] = field(default_factory=dict)
    epoch: dict[str, int] = field(default_factory=dict)
    flights: list[Flight] = field(default_factory=list)
    sessions: dict[str, str] = field(default_factory=dict)
    counter: int = 0

    def add(self, r: str) -> None:
        slot = self.slots.index(None) if None in self.slots else len(self.slots)
        if slot == len(self.slots):
            self.slots.append(None)
        self.slots[slot] = r
        self.healthy[r], self.blocks[r], self.report[r], self.epoch[r] = True, set(), (0, 0, 0, 0, 0.0), 0

    def remove(self, r: str) -> list[str]:
        moved = [f.req for f in self.flights if f.replica == r]
        self.flights = [f for f in self.flights if f.replica != r]
        self.slots[self.slots.index(r)] = None
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        self.sessions = {s: x for s, x in self.sessions.items() if x != r}
        for d in (self.healthy, self.blocks, self.report, self.epoch):
            del d[r]  # type: ignore[attr-defined]
        return moved

    def load(self, r: str) -> ReplicaLoad:
        w, n, wt, nt, kv = self.report[r]
        for f in self.flights:
            if f.replica == r and f.epoch == self.epoch[r]:
                if f.prefilled:
                    n, nt = n + 1, nt + f.num_tokens
                else:
                    w, wt = w + 1, wt + f.uncached
        return ReplicaLoad(w, n, wt, nt, kv)

    def overlap(self, r: str, keys: list[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks[r]:
            n += 1
        return n

    def ttft(self, load: ReplicaLoad, num_tokens: int, overlap: int) -> float:
        m, cfg = self.cfg.step_time, self.cfg
        cached = min(overlap * BS, num_tokens, num_tokens - 1)
        u, c = max(num_tokens - cached, 1), cached
        steps = max(math.ceil((load.num_waiting_tokens + u) / max(cfg.max_num_batched_tokens - load.num_running, 1)), 1)
        own = u * (2 * c + u + 1) / 2
        queued = (
            load.num_waiting
            * ((load.num_waiting_tokens / load.num_waiting) * (load.num_waiting_tokens / load.num_waiting + 1) / 2)
            if load.num_waiting
            else 0.0
        )
        return (
            steps * (m.step_s + m.decode_req_s * load.num_running + m.kv_token_s * load.num_running_tokens)
            + m.prefill_token_s * (load.num_waiting_tokens + u)
            + m.prefill_req_s * max(steps, load.num_waiting + 1)
            + m.prefill_attn_s * (own + queued)
        )

    def imbalanced(self, busy: int, idle: int) -> bool:
        return busy - idle > self.cfg.balance_abs_threshold and busy > self.cfg.balance_rel_threshold * idle

    def choices(self, keys: list[int], num_tokens: int, session: str | None) -> tuple[list[str], str, dict[str, float]]:
        """The replicas the policy may choose (several only on a floating-point near-tie), the reason, and the
        score of every candidate (for the near-tie check)."""
        cands = [r for r in self.slots if r is not None and self.healthy[r]]
        ov = {r: self.overlap(r, keys) for r in cands}
        ld = {r: self.load(r) for r in cands}
        req = {r: ld[r].num_waiting + ld[r].num_running for r in cands}
        slot = {r: self.slots.index(r) for r in cands}
        if self.cfg.sticky_sessions and session in self.sessions and self.sessions[session] in cands:
            home = self.sessions[session]
            if not self.imbalanced(req[home], min(req.values())):
                return [home], "sticky", {}
        policy = self.cfg.policy
        if policy == "round_robin":
            return [cands[self.counter % len(cands)]], "round_robin", {}
        if policy == "least_loaded":
            return [min(cands, key=lambda r: (req[r], ld[r].kv_usage, slot[r]))], "least_loaded", {}
        if policy == "cache_aware":
            if self.imbalanced(max(req.values()), min(req.values())):
                return [min(cands, key=lambda r: (req[r], slot[r]))], "imbalanced", {}
            best = max(ov.values())
            if min(best * BS, num_tokens) / num_tokens > self.cfg.cache_threshold:
                return [min(cands, key=lambda r: (-ov[r], req[r], slot[r]))], "cache_hit", {}
            return [min(cands, key=lambda r: (len(self.blocks[r]), req[r], slot[r]))], "smallest_cache", {}
        if policy == "kv_overlap":
            qs = [ld[r].num_waiting for r in cands]
            qmax, qmin = max(qs), min(qs)
            score = {
                r: -(
                    self.cfg.overlap_weight * (ov[r] / len(keys) if keys else 0.0)
                    + self.cfg.queue_weight * (1.0 if qmax == qmin else (qmax - ld[r].num_waiting) / (qmax - qmin))
                    + self.cfg.kv_usage_weight * (1.0 - ld[r].kv_usage)
                )
                for r in cands
            }
            reason = "score"
        else:
            score = {r: self.ttft(ld[r], num_tokens, ov[r]) for r in cands}
            reason = "ttft"
        best_score = min(score.values())
        return [r for r in cands if score[r] <= best_score + 1e-9], reason, score

    def commit(self, req: str, r: str, keys: list[int], num_tokens: int, session: str | None) -> None:
        cached = min(self.overlap(r, keys) * BS, num_tokens)
        self.flights.append(Flight(req, r, self.epoch[r], max(num_tokens - cached, 1), num_tokens))
        if self.cfg.record_routed_prefixes:
            self.blocks[r].update(keys)
        if self.cfg.sticky_sessions and session is not None:
            self.sessions[session] = r
        self.counter += 1


# -- random operation streams ----------------------------------------------------------------------------------

REPLICAS = ["r0", "r1", "r2", "r3"]
KEY = st.integers(0, 11)


def as_hash(key: int, form: int) -> int | bytes:
    """The same block as an int, as 8 bytes, or as 16 bytes (as kvsched's xxh3 hashes show)."""
    return key if form == 0 else key.to_bytes(8 * form, "big")


HASHES = st.lists(st.tuples(KEY, st.integers(0, 2)), max_size=5)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("remove"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("healthy"), st.sampled_from(REPLICAS), st.booleans()),
        st.tuples(st.just("stored"), st.sampled_from(REPLICAS), HASHES),
        st.tuples(st.just("stored"), st.sampled_from(REPLICAS), HASHES),
        st.tuples(st.just("removed"), st.sampled_from(REPLICAS), HASHES),
        st.tuples(st.just("cleared"), st.sampled_from(REPLICAS)),
        st.tuples(
            st.just("route"), st.lists(KEY, max_size=6), st.integers(0, BS - 1), st.sampled_from([None, "s0", "s1"])
        ),
        st.tuples(
            st.just("route"), st.lists(KEY, max_size=6), st.integers(0, BS - 1), st.sampled_from([None, "s0", "s1"])
        ),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("prefill"), st.integers(0, 30)),
        st.tuples(
            st.just("load"),
            st.sampled_from(REPLICAS),
            st.integers(0, 8),
            st.integers(0, 8),
            st.integers(0, 3000),
            st.floats(0.0, 1.0),
        ),
    ),
    max_size=60,
)


def play(cfg: RouterConfig, ops: list[tuple[Any, ...]]) -> list[Any]:
    """Runs the ops on a router and the model side by side, checking each step; returns the router's answers."""
    router, model = Router(cfg), Model(cfg)
    answers: list[Any] = []
    next_req = 0
    for op in ops:
        kind, args = op[0], op[1:]
        known = len(args) > 0 and isinstance(args[0], str) and args[0] in model.healthy
        if kind == "add":
            if known:
                with pytest.raises(DuplicateReplicaError):
                    router.add_replica(args[0])
            else:
                router.add_replica(args[0])
                model.add(args[0])
        elif kind in ("remove", "healthy", "stored", "removed", "cleared", "load") and not known:
            with pytest.raises(UnknownReplicaError):
                if kind == "remove":
                    router.remove_replica(args[0])
                elif kind == "healthy":
                    router.set_healthy(args[0], args[1])
                elif kind == "load":
                    router.update_load(args[0], num_waiting=args[1])
                else:
                    router.apply_events(args[0], [AllBlocksCleared()])
        elif kind == "remove":
            moved = router.remove_replica(args[0])
            assert moved == model.remove(args[0])
            answers.append(moved)
        elif kind == "healthy":
            router.set_healthy(args[0], args[1])
            model.healthy[args[0]] = args[1]
        elif kind in ("stored", "removed"):
            hashes = [as_hash(k, f) for k, f in args[1]]
            keys = [k for k, _ in args[1]]
            ev: Any
            if kind == "stored":
                parent = as_hash(keys[0] + 100, 0) if keys else None
                ev = BlockStored(hashes, parent, list(range(len(hashes) * BS)), BS)
                model.blocks[args[0]].update(keys)
            else:
                ev = BlockRemoved(hashes)
                model.blocks[args[0]].difference_update(keys)
            router.apply_events(args[0], [ev, ev])  # a duplicate in the same batch changes nothing
        elif kind == "cleared":
            router.apply_events(args[0], [AllBlocksCleared()])
            model.blocks[args[0]].clear()
        elif kind == "load":
            r, w, n, wt, kv = args
            router.update_load(
                r, num_waiting=w, num_running=n, num_waiting_tokens=wt, num_running_tokens=10 * n, kv_usage=kv
            )
            model.report[r], model.epoch[r] = (w, n, wt, 10 * n, kv), model.epoch[r] + 1
        elif kind == "route":
            keys, extra, session = args
            num_tokens = len(keys) * BS + (extra if keys else extra % (BS - 1) + 1)
            req = f"q{next_req}"
            next_req += 1
            if not any(model.healthy.values()):
                with pytest.raises(NoReplicaAvailableError):
                    router.route(req, block_hashes=keys, num_prompt_tokens=num_tokens, session_id=session)
                continue
            allowed, reason, _ = model.choices(keys, num_tokens, session)
            ranked = router.rank(block_hashes=keys, num_prompt_tokens=num_tokens, session_id=session)
            d = router.route(req, block_hashes=keys, num_prompt_tokens=num_tokens, session_id=session)
            assert ranked[0] == d.replica
            assert sorted(ranked) == sorted(r for r, h in model.healthy.items() if h)
            assert d.replica in allowed, (d, allowed, reason)
            assert d.reason == reason
            assert d.num_overlap_blocks == model.overlap(d.replica, keys)
            assert (d.num_prompt_blocks, d.num_prompt_tokens) == (len(keys), num_tokens)
            expected_ttft = model.ttft(model.load(d.replica), num_tokens, d.num_overlap_blocks)
            assert d.estimated_ttft_s == pytest.approx(expected_ttft, rel=1e-9)
            model.commit(req, d.replica, keys, num_tokens, session)
            answers.append(d)
        elif kind in ("finish", "prefill"):
            req = f"q{args[0]}"
            flight = next((f for f in model.flights if f.req == req), None)
            call = router.finish if kind == "finish" else router.prefill_done
            if flight is None:
                with pytest.raises(UnknownRequestError):
                    call(req)
            else:
                call(req)
                if kind == "finish":
                    model.flights.remove(flight)
                else:
                    flight.prefilled = True
        router.check_invariants()
        assert router.replicas == [r for r in model.slots if r is not None]
        assert router.num_in_flight == len(model.flights)
        for r in model.healthy:
            assert router.num_cached_blocks(r) == len(model.blocks[r])
            assert router.load(r) == model.load(r)
    return answers


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), sticky=st.booleans(), record=st.booleans(), ops=OPS)
def test_the_router_matches_a_brute_force_model(policy: str, sticky: bool, record: bool, ops: list[Any]) -> None:
    play(config(policy, sticky_sessions=sticky, record_routed_prefixes=record), ops)


@settings(max_examples=15, deadline=None)
@given(policy=st.sampled_from(POLICIES), ops=OPS)
def test_decisions_are_a_function_of_the_state(policy: str, ops: list[Any]) -> None:
    cfg = config(policy, sticky_sessions=True, prefix_hash_seed="x")
    assert play(cfg, ops) == play(cfg, ops)


# -- hand-made cases -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_token_prompts_hash_to_the_keys_of_the_schedulers_block_hashes(algo: str) -> None:
    from kvsched import Scheduler

    sched = Scheduler(block_size=BS, num_blocks=64, max_model_len=256, prefix_hash_algo=algo, prefix_hash_seed=7)
    router = Router(replace(config("kv_overlap"), prefix_hash_algo=algo, prefix_hash_seed=7), replicas=["a"])  # type: ignore[arg-type]
    prompt = list(range(3, 17))
    for salt, lora in [(None, None), ("tenant-1", None), (None, "adapter")]:
        req = f"r-{salt}-{lora}"
        sched.add_request(req, prompt, max_tokens=1, cache_salt=salt, lora_name=lora)
        want = [block_key(h) for h in sched.get_block_hashes(req)]
        assert len(want) == 3
        assert router.prompt_keys(prompt, cache_salt=salt, lora_name=lora).tolist() == want
        # What the scheduler publishes as stored blocks is what a token lookup finds.
        router.apply_events("a", [AllBlocksCleared(), BlockStored(sched.get_block_hashes(req), None, prompt[:12], BS)])
        assert router.overlaps(prompt, cache_salt=salt, lora_name=lora) == {"a": 3}
        assert router.overlaps(prompt, cache_salt="someone-else") == {"a": 0}


def _router_view_is(router: Router, replica: str, hashes: list[bytes]) -> bool:
    """Whether the router's index of ``replica`` holds exactly the keys of ``hashes``: every one, and no more."""
    keys = {block_key(h) for h in hashes}
    if router.num_cached_blocks(replica) != len(keys):
        return False
    return all(router.overlaps(block_hashes=[k])[replica] == 1 for k in keys)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_the_router_mirrors_each_replicas_prefix_cache_from_its_kv_cache_events(algo: str) -> None:
    """Two kvsched schedulers behind one router: requests routed by it, both schedulers stepping, each step's
    KV cache events applied to the router. After every step (and after the run) the router's view of each replica
    is exactly the set of hashes that replica's prefix cache holds, through evictions (small caches), hashes
    cached in two blocks at once (prompts of whole blocks, repeated; equal outputs), a reset, and token-prompt
    lookups find what the replicas cache. The same events as objects (``apply_events``, honouring ``num_copies``)
    give the same view; without ``num_copies`` (vLLM's events) a hash cached twice and removed once is lost."""
    from kvsched import Scheduler

    seed = "fleet"
    replicas = ["r0", "r1"]
    scheds = {
        r: Scheduler(block_size=BS, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=64,
                     prefix_hash_algo=algo, prefix_hash_seed=seed, enable_kv_cache_events=True)
        for r in replicas
    }  # fmt: skip
    cfg = replace(config("cache_aware"), prefix_hash_algo=algo, prefix_hash_seed=seed, balance_abs_threshold=2)
    router = Router(cfg, replicas=replicas)  # type: ignore[arg-type]
    as_objects = Router(cfg, replicas=replicas)  # type: ignore[arg-type]
    per_block = Router(cfg, replicas=replicas)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    families = [[int(t) for t in rng.integers(3, 40, 40)] for _ in range(3)]
    pending: dict[str, Any] = {}
    known: dict[str, int] = {}  # each request's tokens so far
    stored_twice = lost = 0
    for step in range(160):
        if step < 120 and rng.random() < 0.6:
            fam = families[int(rng.integers(0, 3))]
            prompt = fam[: BS * int(rng.integers(1, 9))] + ([int(rng.integers(3, 40))] if rng.random() < 0.5 else [])
            req = f"q{step}"
            replica = router.route(req, prompt).replica
            scheds[replica].add_request(req, prompt, max_tokens=int(rng.integers(1, 6)), ignore_eos=True)
            known[req] = len(prompt)
        for r, sched in scheds.items():
            if r in pending:
                out = pending.pop(r)
                sampled = []
                for req, c, k in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, strict=True):
                    done = int(c) + int(k) >= known[req]  # a prefill chunk samples nothing
                    sampled.append([5] if done else [])  # equal outputs fill equal blocks
                    known[req] += done
                for req in sched.update_from_output(out, sampled).finished_req_ids:
                    router.finish(req)
            if step == 80:  # a reset: preempts what runs, drops the whole cache
                assert sched.reset_prefix_cache(reset_running_requests=True)
            if sched.has_unfinished_requests():
                pending[r] = sched.schedule()
            events = sched.take_kv_cache_events()
            router.apply_scheduler_events(r, events)
            as_objects.apply_events(r, events.events())
            per_block.apply_events(r, [replace(e, num_copies=None) if hasattr(e, "num_copies") else e for e in events])
            stored_twice += int((events.num_copies > 1).sum())
            cached = sched.cached_block_hashes()
            assert _router_view_is(router, r, cached), f"step {step}: the router's view of {r} is off"
            assert _router_view_is(as_objects, r, cached)
            lost += not _router_view_is(per_block, r, cached)
    for r, sched in scheds.items():
        assert not sched.has_unfinished_requests()
        cached = sched.cached_block_hashes()
        assert cached and _router_view_is(router, r, cached)
        for fam in families:  # a token prompt finds exactly the blocks the replica caches
            want = 0
            while want < len(fam) // BS and sched.get_num_cached_tokens(fam[: BS * (want + 1) + 1]) > BS * want:
                want += 1
            assert router.overlaps(fam)[r] == want
    router.check_invariants()
    assert stored_twice > 0 and lost > 0, (stored_twice, lost)


def test_apply_scheduler_events_checks_the_batch() -> None:
    from kvsched import Scheduler

    sched = Scheduler(block_size=8, num_blocks=8, max_model_len=32, enable_kv_cache_events=True)
    sched.add_request("a", list(range(20)), max_tokens=1)
    sched.schedule()
    events = sched.take_kv_cache_events()
    router = Router(config("kv_overlap"), replicas=["a"])
    with pytest.raises(InvalidRequestError, match="block_size 8"):
        router.apply_scheduler_events("a", events)  # the replica's blocks are 8 tokens, the router's 4
    with pytest.raises(SchedulerTypeError):
        router.apply_scheduler_events("a", events.events())  # type: ignore[arg-type]
    with pytest.raises(UnknownReplicaError):
        router.apply_scheduler_events("nope", events)
    assert router.num_cached_blocks("a") == 0


def test_block_keys_follow_vllms_int_conversion() -> None:
    h = bytes(range(32))
    assert block_key(h) == int.from_bytes(h, "big") & ((1 << 64) - 1)
    assert block_key(5) == 5
    assert block_key(-1) == (1 << 64) - 1
    assert block_key(np.uint64(9)) == 9
    with pytest.raises(InvalidRequestError):
        block_key(1 << 64)
    with pytest.raises(SchedulerTypeError):
        block_key(True)
    with pytest.raises(SchedulerTypeError):
        block_key("ab")  # type: ignore[arg-type]


def test_predictive_estimate_on_a_hand_computed_case() -> None:
    # 2 waiting requests with 1000 uncached tokens, 10 running over 5000 context tokens; a 600-token prompt of
    # which 256 tokens (16 blocks of 16) are cached; a budget of 512 tokens per step, 502 after the decodes, so
    # ceil(1344 / 502) = 3 steps:
    #   3 * (0.01 + 2e-4 * 10 + 1e-7 * 5000)       = 0.0375      per-step cost
    # + 1e-4 * 1344                                = 0.1344      prefill tokens
    # + 1e-3 * max(3, 2 + 1)                       = 0.003       prefill chunks
    # + 1e-9 * (344 * 857 / 2 + 2 * 500 * 501 / 2) = 0.000397904 attention pairs
    model = StepTimeModel(
        step_s=0.01, prefill_token_s=1e-4, prefill_req_s=1e-3, decode_req_s=2e-4, kv_token_s=1e-7, prefill_attn_s=1e-9
    )
    router = Router(RouterConfig(policy="predictive", block_size=16, step_time=model, max_num_batched_tokens=512))
    router.add_replica("a")
    router.apply_events("a", [BlockStored(list(range(16)), None, [], 16)])
    router.update_load("a", num_waiting=2, num_running=10, num_waiting_tokens=1000, num_running_tokens=5000)
    d = router.route("x", block_hashes=list(range(37)), num_prompt_tokens=600)
    assert d.num_overlap_blocks == 16
    assert d.estimated_ttft_s == pytest.approx(0.175297904, rel=1e-12)
    # The request now waits there with its 344 uncached tokens.
    assert router.load("a") == ReplicaLoad(3, 10, 1344, 5000, 0.0)


def test_predictive_trades_a_cached_prefix_against_a_queue() -> None:
    router = Router(config("predictive"), replicas=["warm", "cold"])
    keys = list(range(50))
    router.apply_events("warm", [BlockStored(keys, None, [], BS)])
    assert router.route("a", block_hashes=keys).replica == "warm"
    # 4000 queued prefill tokens on the warm replica cost 0.4 s; recomputing 200 tokens costs 0.02 s.
    router.update_load("warm", num_waiting=4, num_waiting_tokens=4000)
    d = router.route("b", block_hashes=keys)
    assert (d.replica, d.reason, d.num_overlap_blocks) == ("cold", "ttft", 0)


def test_a_lost_replica_hands_back_its_requests_in_routing_order() -> None:
    router = Router(config("cache_aware"), replicas=["a", "b"])
    router.apply_events("a", [BlockStored([1, 2, 3], None, [], BS)])
    for i in range(3):
        assert router.route(f"x{i}", block_hashes=[1, 2, 3]).replica == "a"
    router.route("y", block_hashes=[9], candidates=["b"])
    router.finish("x1")
    assert router.in_flight("a") == ["x0", "x2"]
    assert router.remove_replica("a") == ["x0", "x2"]
    assert router.num_cached_blocks("b") == 0 and router.replicas == ["b"]
    with pytest.raises(UnknownRequestError):
        router.finish("x0")
    # Re-routed, they go to the survivor.
    assert router.route("x0", block_hashes=[1, 2, 3]).replica == "b"
    assert router.in_flight("b") == ["y", "x0"]


def test_vllm_shaped_events_apply_and_other_media_are_skipped() -> None:
    router = Router(config("kv_overlap"), replicas=["a"])

    class BlockStored:  # a stand-in with vLLM's class name and fields (vLLM itself: test_vllm_kv_events_apply)
        def __init__(self, block_hashes: list[Any], medium: str | None) -> None:
            self.block_hashes, self.parent_block_hash, self.token_ids = block_hashes, None, []
            self.block_size, self.medium, self.lora_name = BS, medium, None

    router.apply_events("a", [BlockStored([b"\x01" * 32], "GPU"), BlockStored([7], "CPU")])
    assert router.num_cached_blocks("a") == 1
    assert router.overlaps(block_hashes=[int.from_bytes(b"\x01" * 8, "big")]) == {"a": 1}


def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    router = Router(config("least_loaded"), replicas=["a"])
    router.route("x", [1, 2, 3, 4, 5])
    before = (router.load("a"), router.num_in_flight, router.num_cached_blocks("a"))
    cases: list[tuple[type[Exception], Any]] = [
        (DuplicateRequestError, lambda: router.route("x", [1, 2])),
        (UnknownReplicaError, lambda: router.route("y", [1], candidates=["nope"])),
        (KeyError, lambda: router.load("nope")),
        (InvalidRequestError, lambda: router.route("y", [])),
        (InvalidRequestError, lambda: router.route("y", [-1, 2])),
        (SchedulerTypeError, lambda: router.route("y", [1.5])),
        (SchedulerTypeError, lambda: router.route("y")),
        (SchedulerTypeError, lambda: router.route("y", [1], block_hashes=[1])),
        (InvalidRequestError, lambda: router.route("y", block_hashes=[1], num_prompt_tokens=99)),
        (
            InvalidRequestError,
            lambda: router.apply_events("a", [BlockStored([5], None, [], BS), BlockStored([6], None, [], 8)]),
        ),
        (InvalidRequestError, lambda: router.apply_events("a", [BlockStored([5], None, [1, 2], BS)])),
        (SchedulerTypeError, lambda: router.apply_events("a", [object()])),
        (InvalidRequestError, lambda: router.update_load("a", kv_usage=1.5)),
        (InvalidRequestError, lambda: router.update_load("a", num_waiting=-1)),
        (SchedulerTypeError, lambda: router.update_load("a", kv_usage=True)),
        (SchedulerTypeError, lambda: router.set_healthy("a", 1)),  # type: ignore[arg-type]
        (DuplicateReplicaError, lambda: router.add_replica("a")),
    ]
    for exc, call in cases:
        with pytest.raises(exc) as info:
            call()
        assert isinstance(info.value, SchedulerError)
        assert (router.load("a"), router.num_in_flight, router.num_cached_blocks("a")) == before
    router.set_healthy("a", False)
    with pytest.raises(NoReplicaAvailableError, match="no replica is healthy"):
        router.route("y", [1])
    router.check_invariants()


@pytest.mark.parametrize(
    "field_value",
    [
        {"policy": "random"},
        {"cache_threshold": 1.5},
        {"balance_rel_threshold": 0.5},
        {"block_size": 0},
        {"queue_weight": -1.0},
        {"max_num_batched_tokens": 0},
        {"prefix_hash_algo": "md5"},
        {"sticky_sessions": 1},
    ],
)
def test_bad_configs_raise_invalid_config(field_value: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfigError):
        Router(replace(RouterConfig(), **field_value))


def test_the_default_config_follows_the_routers_it_learns_from() -> None:
    c = RouterConfig()
    assert (c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold) == (0.3, 64, 1.5)
    assert (c.overlap_weight, c.queue_weight, c.kv_usage_weight) == (3.0, 2.0, 2.0)
    assert c.step_time.name == "llama-3.1-8b-h100"
    assert "cache_aware" in repr(Router())


@pytest.mark.vllm
def test_vllm_kv_events_apply() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    router = Router(config("kv_overlap"), replicas=["a"])
    stored = kv_events.BlockStored(
        block_hashes=[b"\x02" * 32, 12345],
        parent_block_hash=None,
        token_ids=list(range(2 * BS)),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    batch = kv_events.KVEventBatch(ts=0.0, events=[stored, kv_events.BlockRemoved(block_hashes=[12345], medium="GPU")])
    router.apply_events("a", batch.events)
    assert router.num_cached_blocks("a") == 1
    router.apply_events("a", [kv_events.AllBlocksCleared()])
    assert router.num_cached_blocks("a") == 0
