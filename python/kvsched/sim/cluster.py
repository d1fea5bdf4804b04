"""A fleet in simulated time: N replicas, each the real scheduler, behind a :class:`kvsched.router.Router`.

:func:`simulate_cluster` keeps one clock for the whole fleet. Each replica is a real scheduler (one per replica)
stepped as :func:`kvsched.sim.simulate` steps its one engine: a step starts when the replica's previous step ends
(or, when it is idle, when a request reaches it), the scheduler decides it, the step-time model prices it, and its
tokens come out at its end. Events are taken in time order; at equal times arrivals go first, so a request
arriving exactly when a replica's step ends is in that replica's next step, as in :func:`simulate`.

Each arriving request is routed once, at its arrival time, and stays on its replica until it finishes. Before a
request is routed, every replica that stepped since the last one publishes to the router what a deployment's
replicas publish: its KV cache events (``take_kv_cache_events``, applied with
:meth:`Router.apply_scheduler_events`) and a load snapshot (waiting and running requests, their uncached prompt
and context tokens, KV usage). Both are the state after its last ``schedule()`` and update, so the router sees a
step in progress as done (at most one step early). The router also counts the requests it routed since a
snapshot, each as waiting until its first token (:meth:`Router.prefill_done`), then running, until it finishes.
Policies: the router's (:data:`kvsched.router.POLICIES`), plus two that do not read the cache: ``random`` (a
replica at random) and ``pow2`` (two at random, the one with fewer requests; Ray Serve's default), chosen here
and recorded with :meth:`Router.assign`.

With one replica the fleet is :func:`simulate` on the same workload: the same batches, the same times
(``tests/test_sim_cluster.py`` compares every request). Metrics stream into one
:class:`~kvsched.sim.metrics.RunMetrics` per replica and one for the fleet, summarized by
:func:`~kvsched.sim.summary.summarize`; :func:`summarize_cluster` adds the fleet's prefix hit rate (hit tokens
over looked-up tokens, all replicas together) and its load imbalance (the busiest replica's computed tokens over
the mean; 1 is even).

Workloads: any :class:`~kvsched.sim.workload.Workload` (its shared-prefix groups are shared system prompts), or a
multi-turn one from :func:`session_workload`: sessions whose every turn resends the whole conversation so far.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import SchedulerConfig
from ..router import POLICIES, Router, RouterConfig
from .metrics import RunMetrics
from .simulator import (
    _SAMPLED_TOKEN,
    SimResult,
    StalledError,
    _accepts_tenant,
    _make_scheduler,
    _with_tenant_weights,
    make_config,
)
from .steptime import StepNoise, StepSizeCache, StepTimeModel, request_pairs, spill_pairs
from .summary import summarize
from .workload import LengthDist, PromptFactory, Workload

__all__ = [
    "ROUTERS",
    "ClusterResult",
    "SessionSpec",
    "SessionWorkload",
    "session_workload",
    "simulate_cluster",
    "summarize_cluster",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: Routing policies :func:`simulate_cluster` takes: the router's, and two that ignore the cache.
ROUTERS: tuple[str, ...] = (*POLICIES, "random", "pow2")
_LOCAL = ("random", "pow2")


# ---------------------------------------------------------------------------------------------------------
# Multi-turn sessions


@dataclass(frozen=True)
class SessionSpec:
    """Multi-turn chat sessions. Sessions start as a Poisson process at ``rate`` per second for ``duration``
    seconds (or ``num_sessions`` of them); each has ``turns`` turns (a whole number of at least 1, drawn from the
    distribution). Session ``s`` belongs to system-prompt group ``s % num_groups`` and every turn starts with
    that group's ``system_len``-token system prompt (none when ``num_groups`` is 0). Turn ``k``'s prompt is the
    conversation so far: the system prompt, then for each earlier turn its user message and its answer, then
    this turn's user message (``user_len`` tokens); its answer has ``output_len`` tokens. A turn arrives
    ``think_time`` seconds (exponential, this mean) after the previous turn of its session arrived: an open
    loop, so a turn may arrive before the previous answer is done (its prompt then holds the whole answer all
    the same, as a client that waited would send). Sessions stop early rather than grow past
    ``max_context_len`` tokens (prompt and answer)."""

    rate: float = 1.0
    duration: float = 60.0
    num_sessions: int | None = None
    turns: LengthDist = field(default_factory=lambda: LengthDist("uniform", 1, 8))
    user_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    think_time: float = 10.0
    num_groups: int = 4
    system_len: int = 512
    max_context_len: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.num_sessions is None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if self.num_sessions is not None and self.num_sessions < 1:
            raise ValueError(f"num_sessions must be >= 1, got {self.num_sessions}")
        if not (self.think_time >= 0 and math.isfinite(self.think_time)):
            raise ValueError(f"think_time must be >= 0, got {self.think_time}")
        if self.num_groups < 0 or self.system_len < 0:
            raise ValueError("num_groups and system_len must be >= 0")
        if self.system_len + self.user_len.mean() + self.output_len.mean() > self.max_context_len:
            raise ValueError(
                f"a first turn ({self.system_len} + ~{self.user_len.mean():g} + ~{self.output_len.mean():g} tokens) "
                f"does not fit max_context_len ({self.max_context_len})"
            )


@dataclass
class SessionWorkload:
    """A multi-turn workload: the requests (turns, in arrival order) as a :class:`Workload` whose
    ``prefix_group`` is its conversation's system-prompt group, each turn's prompt token ids, and its session id."""

    workload: Workload
    prompts: list[npt.NDArray[np.int32]]
    session_ids: list[str]
    num_sessions: int

    def prompt(self, i: int) -> npt.NDArray[np.int32]:
        return self.prompts[i]


def session_workload(spec: SessionSpec) -> SessionWorkload:
    """The turns of ``spec``'s sessions (see :class:`SessionSpec`); deterministic for its seed. An answer's
    tokens are the token the simulator's model emits, so a turn's prompt holds exactly the tokens the replica
    that served the previous turn computed and cached."""
    rng = np.random.default_rng([spec.seed, 11])
    if spec.num_sessions is not None:
        starts = np.cumsum(rng.exponential(1.0 / spec.rate, spec.num_sessions))
    else:
        gaps = rng.exponential(1.0 / spec.rate, max(16, int(spec.rate * spec.duration * 2) + 16))
        starts = np.cumsum(gaps)
        starts = starts[starts < spec.duration]
    factory = PromptFactory(spec.seed)
    vocab_pool = factory.tokens(0, 1 << 16, -1, 0)[2:]
    rows: list[tuple[float, int, int, int, int]] = []  # arrival, session, turn, group, output_len
    prompts: dict[tuple[int, int], npt.NDArray[np.int32]] = {}
    for s, t0 in enumerate(starts.tolist()):
        group = s % spec.num_groups if spec.num_groups else -1
        system = factory.tokens(0, spec.system_len, group, spec.system_len) if group >= 0 else np.zeros(0, np.int32)
        num_turns = max(1, int(spec.turns.sample(rng, 1)[0]))
        users = spec.user_len.sample(rng, num_turns)
        outs = spec.output_len.sample(rng, num_turns)
        context = system
        t = t0
        for k in range(num_turns):
            ulen = max(1, int(users[k]))
            off = int(rng.integers(0, len(vocab_pool) - ulen)) if len(vocab_pool) > ulen else 0
            user = vocab_pool[off : off + ulen].copy()
            user[0] = 1 + (s * 31 + k) % 30000  # distinct first tokens (below ~1,000 sessions of <= 31 turns)
            prompt = np.concatenate([context, user]).astype(np.int32)
            olen = max(1, int(outs[k]))
            if len(prompt) + olen > spec.max_context_len:
                break
            prompts[(s, k)] = prompt
            rows.append((t, s, k, group, olen))
            context = np.concatenate([prompt, np.full(olen, _SAMPLED_TOKEN, dtype=np.int32)])
            t += float(rng.exponential(spec.think_time)) if spec.think_time > 0 else 0.0
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    n = len(rows)
    arrival = np.array([r[0] for r in rows], dtype=np.float64)
    group_arr = np.array([r[3] for r in rows], dtype=np.int64)
    out_len = np.array([r[4] for r in rows], dtype=np.int64)
    plist = [prompts[(r[1], r[2])] for r in rows]
    w = Workload(
        arrival_time=arrival,
        prompt_len=np.array([len(p) for p in plist], dtype=np.int64),
        output_len=out_len,
        tenant=np.zeros(n, dtype=np.int64),
        priority=np.zeros(n, dtype=np.int64),
        prefix_group=group_arr,
        prefix_len=np.where(group_arr >= 0, spec.system_len, 0).astype(np.int64),
        seed=spec.seed,
        source="sessions",
    )
    return SessionWorkload(w, plist, [f"s{r[1]}" for r in rows], len(starts))


# ---------------------------------------------------------------------------------------------------------
# The fleet


@dataclass
class ClusterResult:
    """One fleet run: per replica a :class:`SimResult` (its own metrics and scheduler stats), the fleet's
    (``fleet``: every request, ``final_stats`` summed over replicas), where each request went (``replica_of``,
    -1 for a request that had not arrived when the run ended) and why (``reasons``: decisions per reason)."""

    router: str
    replica_names: list[str]
    replicas: list[SimResult]
    fleet: SimResult
    replica_of: IntArray
    reasons: dict[str, int]
    computed_tokens: IntArray  # per replica: tokens it computed (prefill, recomputation and decode)
    estimated_ttft: FloatArray  # per request: the router's predictive estimate where it went (routers that read
    # the cache only: NaN for the others, which are not fed the replicas' events)
    ttft: FloatArray  # per request: its time to first token (NaN if it had none)
    wall_s: float

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)


def _step_seconds(
    m: StepTimeModel,
    nst: IntArray,
    nct: IntArray,
    known: IntArray,
    num_swapped: int,
    charge_swaps: bool,
    sizes: StepSizeCache | None = None,
) -> tuple[float, int]:
    """A step's duration under ``m`` (the same terms as :func:`simulate`) and its number of prefill tokens;
    ``sizes``: the replica's recent step sizes, for the new-size term (None: the term is off)."""
    is_dec = nct == known - 1
    n_dec = int(np.count_nonzero(is_dec))
    size = len(nst)
    kv = int(nct[is_dec].sum()) + n_dec
    n_pre = int(nst.sum()) - n_dec
    dt = m.step_s + m.prefill_token_s * n_pre + m.prefill_req_s * (size - n_dec) + m.decode_req_s * n_dec
    dt += m.kv_token_s * kv
    if n_dec != size:
        pairs = request_pairs(nst, nct, is_dec)
        dt += m.prefill_attn_s * float(pairs.sum())
        if m.prefill_attn_spill_s:
            dt += m.prefill_attn_spill_s * spill_pairs(pairs, m.attn_spill_pairs)
    if size == 1 and n_dec == 0:
        dt += m.lone_prefill_token_s * n_pre
    if sizes is not None and sizes.new(n_pre + n_dec):
        dt += m.new_size_step_s
    if charge_swaps:
        dt += m.swap_block_s * num_swapped
    return dt, n_pre


class _Replica:
    def __init__(
        self,
        name: str,
        sched: Any,
        metrics: RunMetrics,
        noise: StepNoise | None = None,
        sizes: StepSizeCache | None = None,
    ) -> None:
        self.name = name
        self.noise = noise  # the step-time noise of the model, if any (its own draws per replica)
        self.sizes = sizes  # the replica's recent step sizes, when the model has a new-size term
        self.sched = sched
        self.metrics = metrics
        self.ready_at = math.inf  # when it next schedules (inf: idle until a request reaches it)
        self.changed = False  # it stepped since it last published to the router
        self.active: dict[str, int] = {}  # request id -> workload index, for the requests on it
        self.num_steps = 0
        self.step_time_sum = 0.0
        self.num_entries = 0
        self.computed_tokens = 0
        self.kv_samples: list[float] = []
        self.end_time = 0.0


def simulate_cluster(
    workload: Workload | SessionWorkload,
    config: SchedulerConfig | dict[str, Any] | None,
    step_model: StepTimeModel,
    *,
    replicas: int = 2,
    router: str = "cache_aware",
    router_config: RouterConfig | dict[str, Any] | None = None,
    scheduler: str = "rust",
    horizon: float | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    seed: int = 0,
    request_sink: Any = None,
    noise_seed: int = 0,
) -> ClusterResult:
    """Run ``workload`` through ``replicas`` copies of the scheduler (each with ``config``) behind a router
    (see the module docstring). ``router``: one of :data:`ROUTERS`. ``router_config``: :class:`RouterConfig`
    fields beyond the policy (a RouterConfig or a dict); its ``block_size``, ``prefix_hash_algo``,
    ``prefix_hash_seed``, ``step_time`` and ``max_num_batched_tokens`` are always the replicas' and
    ``step_model``. ``seed``: the ``random`` and ``pow2`` draws. ``request_sink``: called with the columns of
    each finished request batch (the fleet's; a ``replica`` column says where each ran). ``horizon``: stop at
    this simulated time (requests not finished are reported unfinished). ``noise_seed``: with a step-time model
    that has noise, replica ``i`` draws its steps' factors from seed ``noise_seed + i`` (so one replica runs as
    :func:`simulate` with the same ``noise_seed``)."""
    from .._errors import InvalidConfigError

    if router not in ROUTERS:
        raise InvalidConfigError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 128:
        raise InvalidConfigError(f"replicas must be an int from 1 to 128, got {replicas!r}")
    sessions: SessionWorkload | None = None
    if isinstance(workload, SessionWorkload):
        sessions, w = workload, workload.workload
    else:
        w = workload
    cfg = _with_tenant_weights(make_config(config, enable_kv_cache_events=True), w)
    if w.max_prompt_len >= cfg.max_model_len:
        raise ValueError(
            f"the workload has prompts of up to {w.max_prompt_len} tokens, not below max_model_len "
            f"({cfg.max_model_len})"
        )
    rc_fields: dict[str, Any] = {}
    if isinstance(router_config, RouterConfig):
        rc_fields = {f.name: getattr(router_config, f.name) for f in dataclasses.fields(RouterConfig)}
    elif router_config is not None:
        rc_fields = dict(router_config)
    rc_fields.update(
        policy="round_robin" if router in _LOCAL else router,
        block_size=cfg.block_size,
        prefix_hash_algo=cfg.prefix_hash_algo,
        prefix_hash_seed=cfg.prefix_hash_seed,
        step_time=step_model,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )
    try:
        rcfg = RouterConfig(**rc_fields)
    except TypeError as exc:
        raise InvalidConfigError(f"bad router config: {exc}") from None
    names = [f"replica-{k}" for k in range(replicas)]
    rt = Router(rcfg, replicas=names)
    rng = np.random.default_rng([seed, 13])

    n = len(w)
    nt = w.num_tenants
    prio_values = w.priority_values()
    first_arrival = w.first_arrival
    span = w.last_arrival
    window = (span - first_arrival) / 20.0 if span > first_arrival else 1.0

    def new_metrics(sink: Any) -> RunMetrics:
        return RunMetrics(
            tenant_names=w.tenant_names,
            tenant_weights=w.tenant_weights,
            priorities=prio_values,
            window=window,
            first_arrival=first_arrival,
            slo_ttft=slo_ttft,
            slo_tpot=slo_tpot,
            request_sink=sink,
        )

    fleet = new_metrics(request_sink)
    reps: list[_Replica] = []
    sched_name = scheduler
    for i, name in enumerate(names):
        sched_name, sched = _make_scheduler(scheduler, cfg)
        if cfg.preemption_mode == "auto":
            sched.set_preemption_costs(step_model.prefill_token_s, step_model.swap_block_s)
        reps.append(
            _Replica(
                name, sched, new_metrics(None), StepNoise.of(step_model, noise_seed + i), StepSizeCache.of(step_model)
            )
        )
    tenant_kw = _accepts_tenant(reps[0].sched.add_request) and (nt > 1 or cfg.policy not in ("fcfs", "priority"))
    charge_swaps = cfg.preemption_mode != "recompute"
    num_prios = len(fleet.prio_values)
    prio_index = {int(p): i for i, p in enumerate(fleet.prio_values.tolist())}

    # Per request (workload index).
    target = np.minimum(w.output_len, cfg.max_model_len - w.prompt_len).astype(np.int64)
    fleet.num_capped_outputs = int(np.count_nonzero(target < w.output_len))
    known = w.prompt_len.astype(np.int64).copy()
    code = w.tenant.astype(np.int64) * num_prios + np.array([prio_index[int(p)] for p in w.priority], np.int64)
    first_sched = np.full(n, np.nan)
    first_token = np.full(n, np.nan)
    last_token = np.full(n, np.nan)
    num_out = np.zeros(n, dtype=np.int64)
    num_sched = np.zeros(n, dtype=np.int64)
    high_water = np.zeros(n, dtype=np.int64)
    recomputed = np.zeros(n, dtype=np.int64)
    cached = np.zeros(n, dtype=np.int64)
    preemptions = np.zeros(n, dtype=np.int64)
    replica_of = np.full(n, -1, dtype=np.int64)
    estimate = np.full(n, np.nan)
    reasons: dict[str, int] = {}
    factory = PromptFactory(w.seed)

    def columns(idx: IntArray, finished: bool) -> dict[str, npt.NDArray[Any]]:
        return {
            "idx": idx,
            "arrival_time": w.arrival_time[idx],
            "prompt_len": w.prompt_len[idx],
            "output_len": target[idx],
            "tenant": w.tenant[idx],
            "priority": w.priority[idx],
            "prefix_group": w.prefix_group[idx],
            "added": replica_of[idx] >= 0,
            "finished": np.full(len(idx), finished),
            "num_output_tokens": num_out[idx],
            "first_scheduled_time": first_sched[idx],
            "first_token_time": first_token[idx],
            "finish_time": last_token[idx] if finished else np.full(len(idx), np.nan),
            "num_preemptions": preemptions[idx],
            "num_scheduled_tokens": num_sched[idx],
            "num_recomputed_tokens": recomputed[idx],
            "num_cached_tokens": cached[idx],
            "replica": replica_of[idx],
        }

    def fold(rep: _Replica, idx: IntArray, finished: bool) -> None:
        cols = columns(idx, finished)
        rep.metrics.add_requests({k: v for k, v in cols.items() if k != "replica"})
        fleet.add_requests(cols)

    reads_cache = router not in ("random", "round_robin", "least_loaded", "pow2")

    def publish(rep: _Replica) -> None:
        """The replica's block events and load reach the router."""
        rep.changed = False
        events = rep.sched.take_kv_cache_events()
        if reads_cache and len(events):
            rt.apply_scheduler_events(rep.name, events)
        st = rep.sched.stats()
        rep.kv_samples.append(st.kv_cache_usage)
        if rep.active:
            ids = np.fromiter(rep.active.values(), dtype=np.int64, count=len(rep.active))
            started = ~np.isnan(first_token[ids])
            wait_tokens = int((known[ids] - high_water[ids])[~started].clip(min=0).sum())
            run_tokens = int(known[ids][started].sum())
        else:
            wait_tokens = run_tokens = 0
        rt.update_load(
            rep.name,
            num_waiting=st.num_waiting_reqs,
            num_running=st.num_running_reqs,
            num_waiting_tokens=wait_tokens,
            num_running_tokens=run_tokens,
            kv_usage=st.kv_cache_usage,
        )

    def arrive(i: int) -> None:
        for r in reps:
            if r.changed:
                publish(r)
        rid = f"r{i}"
        prompt = (
            sessions.prompts[i]
            if sessions is not None
            else factory.tokens(i, int(w.prompt_len[i]), int(w.prefix_group[i]), int(w.prefix_len[i]))
        )
        session = sessions.session_ids[i] if sessions is not None else None
        if router in _LOCAL:
            if router == "random" or replicas == 1:
                k = int(rng.integers(replicas))
            else:
                a, b = rng.choice(replicas, size=2, replace=False).tolist()
                la, lb = rt.load(names[a]), rt.load(names[b])
                k = a if la.num_waiting + la.num_running <= lb.num_waiting + lb.num_running else b
            d = rt.assign(rid, names[k], prompt, session_id=session)
            reason = router
        else:
            d = rt.route(rid, prompt, session_id=session)
            k = names.index(d.replica)
            reason = d.reason
        reasons[reason] = reasons.get(reason, 0) + 1
        if reads_cache:  # the others are not fed the events the estimate needs
            estimate[i] = d.estimated_ttft_s
        replica_of[i] = k
        rep = reps[k]
        kw: dict[str, Any] = {"tenant": w.tenant_names[int(w.tenant[i])]} if tenant_kw else {}
        rep.sched.add_request(
            rid,
            prompt,
            max_tokens=int(target[i]),
            priority=int(w.priority[i]),
            arrival_time=float(w.arrival_time[i]),
            **kw,
        )
        rep.active[rid] = i
        if rep.ready_at == math.inf:
            rep.ready_at = float(w.arrival_time[i])

    tokens = np.full(max(cfg.max_num_seqs, 1), _SAMPLED_TOKEN, dtype=np.int64)
    empty_indptr = np.zeros(1, dtype=np.int64)

    def step(rep: _Replica, t: float) -> None:
        sched = rep.sched
        out = sched.schedule()
        rids = out.req_ids
        m = len(rids)
        if m == 0:
            # Every schedule() awaits its update, an empty one too; then nothing happens until a request arrives.
            sched.update_from_output(out, (tokens[:0], empty_indptr))
            rep.ready_at = math.inf
            rep.changed = True
            return
        idx = np.fromiter((rep.active[r] for r in rids), dtype=np.int64, count=m)
        nst = np.asarray(out.num_scheduled_tokens, dtype=np.int64)
        nct = np.asarray(out.num_computed_tokens, dtype=np.int64)
        kl = known[idx]
        swapped = len(out.swap_out) + len(out.swap_in) if charge_swaps else 0
        dt, _ = _step_seconds(step_model, nst, nct, kl, swapped, charge_swaps, rep.sizes)
        if rep.noise is not None:
            dt *= rep.noise.next()
        complete = (nct + nst) >= kl
        sel = idx[complete]
        k = len(sel)
        indptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(complete, out=indptr[1:])
        res = sched.update_from_output(out, (tokens[:k], indptr))
        known[sel] += 1
        t_end = t + dt
        end = nct + nst
        hw = high_water[idx]
        recomputed[idx] += np.maximum(np.minimum(end, hw) - nct, 0)
        cached[idx] += np.maximum(nct - hw, 0)
        high_water[idx] = np.maximum(hw, end)
        num_sched[idx] += nst
        new = np.isnan(first_sched[idx])
        if new.any():
            first = idx[new]
            first_sched[first] = t
            for mt in (rep.metrics, fleet):
                mt.windows.wait(w.arrival_time[first], np.full(len(first), t), w.tenant[first])
        n_tok = float(nst.sum())
        served: Any = n_tok if nt == 1 else np.bincount(w.tenant[idx], weights=nst, minlength=nt)
        rep.metrics.windows.step(t_end, served)
        fleet.windows.step(t_end, served)
        last = last_token[sel]
        had = ~np.isnan(last)
        if had.any():
            gaps = t_end - last[had]
            codes = code[sel[had]]
            rep.metrics.add_itl(gaps, codes)
            fleet.add_itl(gaps, codes)
        if not had.all():
            got_first = sel[~had]
            first_token[got_first] = t_end
            for j in got_first.tolist():
                rt.prefill_done(f"r{j}")
        last_token[sel] = t_end
        num_out[sel] += 1
        for r in out.preempted_req_ids:
            preemptions[rep.active[r]] += 1
        fin = res.finished_req_ids
        if fin:
            done = np.fromiter((rep.active.pop(r) for r in fin), dtype=np.int64, count=len(fin))
            for r in fin:
                rt.finish(r)
            fold(rep, done, True)
        rep.num_steps += 1
        rep.step_time_sum += dt
        rep.num_entries += m
        rep.computed_tokens += int(n_tok)
        rep.ready_at = t_end
        rep.changed = True
        rep.end_time = t_end

    wall0 = time.perf_counter()
    nxt = 0
    t = 0.0
    logger = logging.getLogger("kvsched")
    old_level = logger.level
    logger.setLevel(logging.ERROR)  # the preemption warning is expected under load; the metrics count them
    try:
        while True:
            t_arr = float(w.arrival_time[nxt]) if nxt < n else math.inf
            rep = min(reps, key=lambda r: r.ready_at)
            t_rep = rep.ready_at
            t_next = min(t_arr, t_rep)
            if t_next == math.inf or (horizon is not None and t_next >= horizon):
                break
            t = t_next
            if t_arr <= t_rep:
                arrive(nxt)
                nxt += 1
            else:
                step(rep, t)
    finally:
        logger.setLevel(old_level)
    wall = time.perf_counter() - wall0
    if horizon is None and any(r.active for r in reps):
        stuck = sum(len(r.active) for r in reps)
        raise StalledError(f"{stuck} request(s) did not finish although no replica could schedule anything")
    end_time = max([t, *(r.end_time for r in reps)])
    for r in reps:
        if r.active:
            fold(r, np.fromiter(r.active.values(), dtype=np.int64, count=len(r.active)), False)
    unsched = np.flatnonzero((replica_of >= 0) & np.isnan(first_sched))
    if unsched.size:
        for k, r in enumerate(reps):
            mine = unsched[replica_of[unsched] == k]
            r.metrics.windows.add_waits(w.arrival_time[mine], np.full(len(mine), end_time), w.tenant[mine])
        fleet.windows.add_waits(w.arrival_time[unsched], np.full(len(unsched), end_time), w.tenant[unsched])
    if nxt < n:
        fleet.add_requests(columns(np.arange(nxt, n, dtype=np.int64), False))

    results: list[SimResult] = []
    hits = queries = 0
    for r in reps:
        st = r.sched.stats()
        hits += st.prefix_cache_hits
        queries += st.prefix_cache_queries
        r.metrics.num_steps = r.num_steps
        r.metrics.step_time_sum = r.step_time_sum
        r.metrics.num_scheduled_entries = r.num_entries
        r.metrics.finish(end_time)
        fs: dict[str, Any] = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
        fs["prefix_cache_hit_rate"] = st.prefix_cache_hit_rate
        results.append(
            SimResult(
                workload=w,
                config=cfg,
                step_model=step_model,
                scheduler=sched_name,
                horizon=horizon,
                metrics=r.metrics,
                timeseries={"kv_cache_usage": np.asarray(r.kv_samples, dtype=np.float64)},
                final_stats=fs,
                end_time=end_time,
                wall_s=wall,
                extra={"num_steps": r.num_steps},
            )
        )
    fleet.num_steps = sum(r.num_steps for r in reps)
    fleet.step_time_sum = sum(r.step_time_sum for r in reps)
    fleet.num_scheduled_entries = sum(r.num_entries for r in reps)
    fleet.finish(end_time)
    kv_all = [np.asarray(r.kv_samples, dtype=np.float64) for r in reps]
    fleet_result = SimResult(
        workload=w,
        config=cfg,
        step_model=step_model,
        scheduler=sched_name,
        horizon=horizon,
        metrics=fleet,
        timeseries={"kv_cache_usage": np.concatenate(kv_all) if kv_all else np.zeros(0)},
        final_stats={
            "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        },
        end_time=end_time,
        wall_s=wall,
        extra={"num_steps": fleet.num_steps},
    )
    return ClusterResult(
        router=router,
        replica_names=names,
        replicas=results,
        fleet=fleet_result,
        replica_of=replica_of,
        reasons=reasons,
        computed_tokens=np.array([r.computed_tokens for r in reps], dtype=np.int64),
        estimated_ttft=estimate,
        ttft=first_token - w.arrival_time,
        wall_s=wall,
    )


def _imbalance(x: npt.NDArray[Any]) -> float:
    mean = float(np.mean(x)) if len(x) else 0.0
    return float(np.max(x)) / mean if mean > 0 else math.nan


def summarize_cluster(
    result: ClusterResult, *, slo_ttft: float | None = None, slo_tpot: float | None = None
) -> dict[str, Any]:
    """The fleet's :func:`summarize` and every replica's, plus the fleet figures: prefix hit rate (hit tokens
    over looked-up tokens, all replicas), requests per replica, and load imbalance: the busiest replica's
    computed tokens (``token_imbalance``) and routed requests (``request_imbalance``) over the mean (1: even)."""
    per_replica = [summarize(r, slo_ttft=slo_ttft, slo_tpot=slo_tpot) for r in result.replicas]
    requests = np.bincount(result.replica_of[result.replica_of >= 0], minlength=result.num_replicas)
    fleet = summarize(result.fleet, slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    for k, s in enumerate(per_replica):
        s["replica"] = result.replica_names[k]
        s["num_routed"] = int(requests[k])
        s["computed_tokens"] = int(result.computed_tokens[k])
    ok = np.isfinite(result.ttft) & np.isfinite(result.estimated_ttft) & (result.ttft > 0)
    rel = (result.estimated_ttft[ok] - result.ttft[ok]) / result.ttft[ok]
    return {
        "router": result.router,
        "num_replicas": result.num_replicas,
        "fleet": fleet,
        "replicas": per_replica,
        "prefix_cache_hit_rate": float(result.fleet.final_stats["prefix_cache_hit_rate"]),
        "requests_per_replica": requests.tolist(),
        "request_imbalance": _imbalance(requests),
        "token_imbalance": _imbalance(result.computed_tokens),
        "reasons": dict(sorted(result.reasons.items())),
        # The predictive estimate against the TTFT each request then had: (estimate - actual) / actual.
        "ttft_estimate_error": {
            "median": float(np.median(rel)) if rel.size else math.nan,
            "median_abs": float(np.median(np.abs(rel))) if rel.size else math.nan,
            "p90_abs": float(np.quantile(np.abs(rel), 0.9)) if rel.size else math.nan,
        },
        "wall_s": result.wall_s,
    }


def compare_routers(
    workload: Workload | SessionWorkload,
    config: SchedulerConfig | dict[str, Any] | None,
    step_model: StepTimeModel,
    *,
    routers: Sequence[str],
    replicas: Sequence[int],
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`summarize_cluster` of every (router, replica count), on the same workload, in that order."""
    slo = {k: kwargs.get(k) for k in ("slo_ttft", "slo_tpot")}
    out = []
    for n in replicas:
        for r in routers:
            res = simulate_cluster(workload, config, step_model, replicas=n, router=r, **kwargs)
            out.append(summarize_cluster(res, **slo))
    return out
