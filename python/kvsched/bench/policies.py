"""Policy experiments on seeded request streams: fair share across tenants, and priority aging.

``python -m kvsched.bench.policies`` prints, for the default streams:

- fair share: one tenant sending 10x the rate of three others, every tenant backlogged. Jain's fairness index of
  the weighted service per window (``fair`` vs ``fcfs``) and the total throughput (tokens per step) of both;
- starvation: a stream of high-priority requests that saturates the engine plus a trickle of low-priority ones.
  The longest wait (steps from arrival to first admission) of a low-priority request with and without
  ``priority_aging_steps``.

Both experiments drive the scheduler directly with a fake model (one token per completed prompt per step, no EOS:
requests end at ``max_tokens``). The arrival stream depends only on the seed, never on the policy, so the
policies see identical requests. Service is measured from the scheduler's outputs, independently of its own
counters: prompt tokens computed for the first time (recomputation after a preemption is not service) and output
tokens appended, weighted as the virtual token counter weighs them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsched.config import SchedulerConfig

__all__ = [
    "PriorityRun",
    "PriorityStream",
    "TenantRun",
    "TenantStream",
    "jain_index",
    "main",
    "run_priority_stream",
    "run_tenant_stream",
]

FloatArray = npt.NDArray[np.float64]


def jain_index(x: Any) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: 1 when all equal, 1/n when one gets everything."""
    a = np.asarray(x, dtype=np.float64)
    denom = len(a) * float(np.sum(a * a))
    return float(np.sum(a)) ** 2 / denom if denom > 0 else 1.0


@dataclass(frozen=True)
class TenantStream:
    """Poisson arrivals per tenant; uniform prompt and output lengths; distinct random prompts."""

    rates: tuple[float, ...] = (3.0, 0.3, 0.3, 0.3)  # requests per step; tenant 0 sends 10x the others
    weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    prompt_len: tuple[int, int] = (32, 128)
    output_len: tuple[int, int] = (16, 64)
    config: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(
            num_blocks=2048, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
            prefix_hash_seed=0,
        )
    )  # fmt: skip

    def tenant(self, i: int) -> str:
        return f"t{i}"


@dataclass
class TenantRun:
    """Per step and tenant: weighted service; per step: tokens scheduled and tenants with waiting requests."""

    service: FloatArray  # [steps, tenants], (w_p * new prompt tokens + w_d * output tokens) / weight
    tokens: npt.NDArray[np.int64]  # [steps]
    backlogged: npt.NDArray[np.bool_]  # [steps, tenants]: the tenant had waiting requests after the step
    tenant_stats: dict[str, Any]

    def window_jain(self, window: int, skip: int = 0) -> FloatArray:
        """Jain's index of each full window's per-tenant service (after ``skip`` warm-up steps)."""
        s = self.service[skip:]
        n = len(s) // window
        return np.array([jain_index(s[k * window : (k + 1) * window].sum(axis=0)) for k in range(n)])

    def throughput(self, skip: int = 0) -> float:
        return float(self.tokens[skip:].mean())


def _make(impl: str, config: SchedulerConfig) -> Any:
    if impl == "reference":
        from kvsched.reference import ReferenceScheduler

        return ReferenceScheduler(config)
    from kvsched.scheduler import Scheduler

    return Scheduler(config)


def run_tenant_stream(
    policy: str, stream: TenantStream, num_steps: int, seed: int = 0, impl: str = "rust"
) -> TenantRun:
    """Run ``num_steps`` steps of ``stream`` under ``policy`` and measure each tenant's service."""
    weights = {stream.tenant(i): w for i, w in enumerate(stream.weights)}
    config = replace(stream.config, policy=policy, tenant_weights=weights)  # type: ignore[arg-type]
    s = _make(impl, config)
    rng = np.random.Generator(np.random.PCG64(seed))
    n_t = len(stream.rates)
    service = np.zeros((num_steps, n_t))
    tokens = np.zeros(num_steps, dtype=np.int64)
    backlogged = np.zeros((num_steps, n_t), dtype=bool)
    tenant_of: dict[str, int] = {}
    prompt_len: dict[str, int] = {}
    charged: dict[str, int] = {}  # prompt tokens computed at least once
    num_tokens: dict[str, int] = {}  # prompt + outputs so far
    w_p, w_d = config.fair_prefill_weight, config.fair_decode_weight
    next_id = 0
    for step in range(num_steps):
        for t in range(n_t):
            for _ in range(int(rng.poisson(stream.rates[t]))):
                plen = int(rng.integers(stream.prompt_len[0], stream.prompt_len[1] + 1))
                olen = int(rng.integers(stream.output_len[0], stream.output_len[1] + 1))
                prompt = rng.integers(3, 30000, size=plen)
                rid = f"r{next_id}"
                next_id += 1
                s.add_request(rid, prompt, max_tokens=olen, arrival_time=float(step), tenant=stream.tenant(t))
                tenant_of[rid], prompt_len[rid], charged[rid], num_tokens[rid] = t, plen, 0, plen
        out = s.schedule()
        computed = out.num_computed_tokens.tolist()
        sampled = []
        for k, (rid, n) in enumerate(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True)):
            end = computed[k] + n
            new_prompt = max(0, min(end, prompt_len[rid]) - max(computed[k], charged[rid]))
            charged[rid] = max(charged[rid], min(end, prompt_len[rid]))
            t = tenant_of[rid]
            service[step, t] += w_p * new_prompt / stream.weights[t]
            sampled.append([5] if end >= num_tokens[rid] else [])
        tokens[step] = int(out.total_num_scheduled_tokens)
        res = s.update_from_output(out, sampled)
        for rid, appended in zip(out.req_ids, res.num_new_tokens.tolist(), strict=True):
            t = tenant_of[rid]
            service[step, t] += w_d * appended / stream.weights[t]
            num_tokens[rid] += appended
        stats = s.tenant_stats()
        for t in range(n_t):
            st = stats.get(stream.tenant(t))
            backlogged[step, t] = st is not None and st.num_waiting_reqs > 0
    return TenantRun(service, tokens, backlogged, s.tenant_stats())


@dataclass(frozen=True)
class PriorityStream:
    """High-priority (0) and low-priority (1) Poisson arrivals; the high ones alone load the engine fully."""

    rate_high: float = 0.5
    rate_low: float = 0.03
    prompt_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (8, 24)
    config: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(
            num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
            policy="priority", prefix_hash_seed=0,
        )
    )  # fmt: skip


@dataclass
class PriorityRun:
    """Waits (steps from arrival to first admission) of the requests admitted in the run, by priority."""

    waits: dict[int, list[int]]
    num_not_admitted: dict[int, int]
    num_steps: int


def run_priority_stream(
    aging_steps: int, stream: PriorityStream, arrival_steps: int, seed: int = 0, impl: str = "rust"
) -> PriorityRun:
    """Arrivals for ``arrival_steps`` steps, then the backlog drains; returns every request's wait."""
    s = _make(impl, replace(stream.config, priority_aging_steps=aging_steps))
    rng = np.random.Generator(np.random.PCG64(seed))
    arrived: dict[str, tuple[int, int]] = {}  # id -> (priority, arrival step)
    waits: dict[int, list[int]] = {0: [], 1: []}
    num_tokens: dict[str, int] = {}
    step = 0
    next_id = 0
    while step < arrival_steps or s.has_unfinished_requests():
        if step < arrival_steps:
            for prio, rate in ((0, stream.rate_high), (1, stream.rate_low)):
                for _ in range(int(rng.poisson(rate))):
                    plen = int(rng.integers(stream.prompt_len[0], stream.prompt_len[1] + 1))
                    olen = int(rng.integers(stream.output_len[0], stream.output_len[1] + 1))
                    rid = f"r{next_id}"
                    next_id += 1
                    s.add_request(rid, rng.integers(3, 30000, size=plen), max_tokens=olen, priority=prio,
                                  arrival_time=float(step))  # fmt: skip
                    arrived[rid] = (prio, step)
                    num_tokens[rid] = plen
        out = s.schedule()
        for rid in out.new_req_ids:
            prio, at = arrived.pop(rid)
            waits[prio].append(step - at)
        computed = out.num_computed_tokens.tolist()
        sampled = [
            [5] if computed[k] + n >= num_tokens[rid] else []
            for k, (rid, n) in enumerate(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True))
        ]
        res = s.update_from_output(out, sampled)
        for rid, appended in zip(out.req_ids, res.num_new_tokens.tolist(), strict=True):
            num_tokens[rid] += appended
        step += 1
    not_admitted = {p: sum(1 for q, _ in arrived.values() if q == p) for p in (0, 1)}
    return PriorityRun(waits, not_admitted, step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsched.bench.policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="steps of the tenant stream (%(default)s)")
    p.add_argument("--window", type=int, default=100, help="steps per Jain window (%(default)s)")
    p.add_argument("--arrival-steps", type=int, default=3000, help="steps of arrivals, priority stream")
    p.add_argument("--aging-steps", type=int, default=50, help="priority_aging_steps to compare with 0")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    stream = TenantStream()
    skip = args.window  # the first window: queues still filling
    print(f"fair share: rates {stream.rates} req/step, weights {stream.weights}, {args.steps} steps")
    runs = {}
    for policy in ("fcfs", "fair"):
        run = runs[policy] = run_tenant_stream(policy, stream, args.steps, args.seed)
        j = run.window_jain(args.window, skip)
        shares = run.service[skip:].sum(axis=0)
        shares = shares / shares.sum()
        print(
            f"  {policy:5s} Jain per {args.window}-step window: mean {j.mean():.4f} min {j.min():.4f}; "
            f"service shares {np.round(shares, 3).tolist()}; throughput {run.throughput(skip):.2f} tokens/step; "
            f"all backlogged in {run.backlogged[skip:].all(axis=1).mean():.0%} of steps"
        )
    ratio = runs["fair"].throughput(skip) / runs["fcfs"].throughput(skip)
    print(f"  throughput fair / fcfs = {ratio:.4f}")

    pstream = PriorityStream()
    print(
        f"starvation: priority 0 at {pstream.rate_high} req/step, priority 1 at {pstream.rate_low} req/step, "
        f"{args.arrival_steps} steps of arrivals then drain"
    )
    for aging in (0, args.aging_steps):
        pr = run_priority_stream(aging, pstream, args.arrival_steps, args.seed)
        lo, hi = pr.waits[1], pr.waits[0]
        print(
            f"  priority_aging_steps={aging:<4d} longest wait: priority 1 {max(lo)} steps "
            f"(mean {np.mean(lo):.1f}), priority 0 {max(hi)} steps (mean {np.mean(hi):.1f}); "
            f"{pr.num_steps} steps in all"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
