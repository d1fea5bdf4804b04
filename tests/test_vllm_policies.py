"""kvsched's policies inside vLLM: knobs from ``additional_config["kvsched"]``, per-request attributes from
``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``), refusals, and the per-tenant log line.

Needs vLLM (``pip install '.[vllm]'``); skipped otherwise. Tests of policies and attributes that the core
does not have yet skip until it does (they key on ``kvsched.config.POLICIES``, the config's fields and the core's
``add_request`` keywords).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install '.[vllm]'")

import kvsched
from kvsched.config import CONFIG_FIELDS, POLICIES, SchedulerConfig
from kvsched.vllm import RULES, UnsupportedFeatureError
from kvsched.vllm._policy import ADAPTER_FIXED, ENGINE_FIELDS, TenantLog, tenant_counts
from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_driver import compare

pytestmark = pytest.mark.vllm

CORE_KEYWORDS = set(inspect.signature(kvsched.Scheduler().add_request).parameters)
FIELD_NAMES = {f.name for f in CONFIG_FIELDS}


def needs_policy(name: str) -> Any:
    return pytest.mark.skipif(name not in POLICIES, reason=f"the core has no policy {name!r} yet")


def needs_field(name: str) -> Any:
    return pytest.mark.skipif(name not in FIELD_NAMES, reason=f"SchedulerConfig has no field {name!r} yet")


def needs_keyword(name: str) -> Any:
    return pytest.mark.skipif(name not in CORE_KEYWORDS, reason=f"the core's add_request takes no {name!r} yet")


# vLLM 0.32's EngineCoreOutput has no `error`: a request that fails there ends with FinishReason.ERROR only.
needs_output_error = pytest.mark.skipif(
    not RULES.output_error, reason=f"vLLM {RULES.version}: no EngineCoreOutput.error"
)


def _sched(kvsched_settings: Any = None, **fields: Any) -> Any:
    cfg = make_vllm_config(**fields)
    if kvsched_settings is not None:
        cfg.additional_config = {"kvsched": kvsched_settings}
    return make_scheduler("kvsched", cfg)


def _req(rid: str, prompt: list[int], extra_args: dict[str, Any] | None = None, **kw: Any) -> Any:
    req = make_request(rid, prompt, **kw)
    req.sampling_params.extra_args = extra_args
    return req


def _step(s: Any, token: int = 9) -> tuple[Any, dict[int, Any]]:
    """One synchronous engine step: schedule, a model output of ``token`` per decode, update."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[] if s.requests[r].is_prefill_chunk else [token] for r in ids]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    return so, s.update_from_output(so, mro)


class _Records(logging.Handler):
    """The messages logged to ``vllm.kvsched`` (whether or not vLLM's logging config lets them propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.logger = logging.getLogger("vllm.kvsched")

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> list[str]:
        self._level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self.messages

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)


def _outputs(eco: dict[int, Any]) -> dict[str, Any]:
    return {o.request_id: o for e in eco.values() for o in e.outputs}


# ---- engine-wide knobs ------------------------------------------------------------------------------------


def test_knobs_from_additional_config_reach_the_core() -> None:
    s = _sched(
        {"policy": "fair", "tenant_weights": {"a": 3, "b": 0.5}, "fair_prefill_weight": 0.5, "fair_decode_weight": 4}
    )
    c = s.core.config
    assert (c.policy, c.tenant_weights, c.fair_prefill_weight, c.fair_decode_weight) == (
        "fair",
        {"a": 3.0, "b": 0.5},
        0.5,
        4.0,
    )
    s = _sched({"cache_aware_admission_window": 8, "cache_aware_admission_threshold": 0.25})
    assert (s.core.config.cache_aware_admission_window, s.core.config.cache_aware_admission_threshold) == (8, 0.25)
    # vLLM's own fields still come from vLLM.
    assert (s.core.config.block_size, s.core.config.max_num_seqs) == (16, 64)
    s = _sched({"priority_aging_steps": 50}, policy="priority")
    assert (s.core.config.policy, s.core.config.priority_aging_steps) == ("priority", 50)


def test_without_kvsched_settings_the_config_is_vllms() -> None:
    plain = _sched().core.config
    assert _sched({}).core.config == plain
    cfg = make_vllm_config()
    cfg.additional_config = {"some_platform_key": 1}  # other keys of additional_config are not ours
    assert make_scheduler("kvsched", cfg).core.config == plain


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("polcy", "policy"), ("tenant_weight", "tenant_weights"), ("fair_prefil_weight", "fair_prefill_weight")],
)
def test_an_unknown_knob_is_refused_with_the_closest_names(key: str, suggestion: str) -> None:
    with pytest.raises(kvsched.InvalidConfigError, match=f"unknown setting '{key}'.*did you mean '{suggestion}'"):
        _sched({key: 1})


@pytest.mark.parametrize(("key", "flag"), sorted(ENGINE_FIELDS.items()))
def test_a_knob_that_vllm_decides_is_refused_with_vllms_flag(key: str, flag: str) -> None:
    value = dict((f.name, f.default) for f in CONFIG_FIELDS)[key]
    with pytest.raises(kvsched.InvalidConfigError, match=f"'{key}' is decided by vLLM's own configuration") as e:
        _sched({key: value})
    assert flag in str(e.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"policy": "fastest"}, "policy must be one of"),
        ({"policy": 1}, "policy must be one of"),
        ({"tenant_weights": {"a": 0}}, "weight of tenant 'a' must be finite and > 0"),
        ({"tenant_weights": {"": 1}}, "non-empty"),
        ({"tenant_weights": [1, 2]}, "tenant_weights must be a mapping"),
        ({"fair_decode_weight": -1}, "fair_decode_weight must be finite and >= 0"),
        ({"fair_prefill_weight": "1"}, "fair_prefill_weight must be a float"),
        ({"cache_aware_admission_threshold": 2}, r"cache_aware_admission_threshold must be in \[0, 1\]"),
        ({"cache_aware_admission_window": -1}, "cache_aware_admission_window must be in"),
        ({"cache_aware_admission_window": 1.5}, "cache_aware_admission_window must be an int"),
        ({"cache_aware_admission_window": 4, "policy": "fair"}, "needs policy 'fcfs'"),
        ({"priority_aging_steps": 10}, "priority_aging_steps > 0 needs policy 'priority'"),
        ({"tenant_stats_interval_s": -1}, "tenant_stats_interval_s must be finite and >= 0"),
        ({"tenant_stats_interval_s": 10**400}, "tenant_stats_interval_s must be finite and >= 0"),
    ],
)
def test_a_bad_knob_value_is_refused_at_construction_naming_it(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(kvsched.InvalidConfigError, match=message) as e:
        _sched(settings)
    assert str(e.value).startswith("--additional-config kvsched")


def test_the_kvsched_settings_must_be_a_mapping() -> None:
    with pytest.raises(kvsched.InvalidConfigError, match="must be a JSON object"):
        _sched(["policy", "fair"])


def test_the_policies_of_vllm_and_kvsched_must_not_contradict_each_other() -> None:
    # vLLM's default fcfs gives way to the kvsched policy; vLLM's priority alone stays priority; naming the same
    # policy twice is fine; priority against another kvsched policy is an error naming both.
    assert _sched({"policy": "fair"}).core.config.policy == "fair"
    assert _sched({"policy": "priority"}).core.config.policy == "priority"
    assert _sched(policy="priority").core.config.policy == "priority"
    assert _sched({"policy": "priority"}, policy="priority").core.config.policy == "priority"
    with pytest.raises(kvsched.InvalidConfigError, match="policy 'fair' contradicts vLLM's --scheduling-policy"):
        _sched({"policy": "fair"}, policy="priority")
    with pytest.raises(kvsched.InvalidConfigError, match="policy 'fcfs' contradicts"):
        _sched({"policy": "fcfs"}, policy="priority")


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_and_auto_preemption_are_refused_by_name_with_the_reason(mode: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=f"only preemption_mode='recompute', got '{mode}'") as e:
        _sched({"preemption_mode": mode, "num_cpu_blocks": 64})
    assert "SchedulerOutput carries no swap-out/swap-in lists" in str(e.value)
    with pytest.raises(UnsupportedFeatureError, match="only num_cpu_blocks=0"):
        _sched({"num_cpu_blocks": 64})
    # The value the adapter uses anyway is accepted (a no-op).
    assert _sched({"preemption_mode": "recompute"}).core.config.preemption_mode == "recompute"


def test_every_config_field_is_a_knob_or_classified() -> None:
    """Each SchedulerConfig field is vLLM's (refused, with its flag), fixed by the adapter, or a knob. A field
    added to the config must be placed here consciously: a knob that vLLM should decide would otherwise override
    vLLM's setting."""
    assert set(ENGINE_FIELDS) <= FIELD_NAMES and set(ADAPTER_FIXED) <= FIELD_NAMES
    assert not set(ENGINE_FIELDS) & set(ADAPTER_FIXED)
    knobs = FIELD_NAMES - set(ENGINE_FIELDS) - set(ADAPTER_FIXED)
    documented = {
        "policy",
        "cache_aware_admission_window",
        "cache_aware_admission_threshold",
        "tenant_weights",
        "fair_prefill_weight",
        "fair_decode_weight",
        "priority_aging_steps",
        # The policy axes (docs/vllm.md lists them; they are knobs as soon as the config has them).
        "max_wait_steps",
        "default_ttft_slo_s",
        "session_ttl_steps",
        "preemption_victim",
        # Tenant isolation and limits (docs/vllm.md, docs/security.md).
        "isolate_tenant_cache",
        "max_running_per_tenant",
        "tenant_max_running",
        "max_waiting_per_tenant",
        "tenant_max_waiting",
    }
    assert knobs <= documented, f"classify the new fields {sorted(knobs - documented)} in kvsched/vllm/_policy.py"
    # The adapter's fixed values are the ones kvsched_config_from_vllm uses, and valid defaults of the config.
    c = _sched().core.config
    for name, (value, _why) in ADAPTER_FIXED.items():
        assert getattr(c, name) == value, name
    text = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text(encoding="utf-8")
    for name in knobs:
        assert f"`{name}`" in text, f"docs/vllm.md does not mention the knob {name}"


@pytest.mark.skipif(not RULES.skip_drafts, reason=f"vLLM {RULES.version} has no skip_drafts")
@pytest.mark.parametrize("settings", [{"policy": "fair"}, {"policy": "priority"}])
def test_eagle_on_runner_v2_is_refused_with_a_victim_that_can_be_already_scheduled(settings: dict[str, Any]) -> None:
    """vLLM's skip_drafts needs the requests preempted after being scheduled in the same step, which the core does
    not report: every victim rule but FCFS's tail can pick one, so those are refused with EAGLE on runner V2."""
    cfg = make_vllm_config(num_speculative_tokens=2, speculative_method="eagle")
    cfg.additional_config = {"kvsched": settings}
    with pytest.raises(UnsupportedFeatureError, match="victim rule that can preempt a request already scheduled"):
        make_scheduler("kvsched", cfg, use_v2_model_runner=True)
    assert make_scheduler("kvsched", cfg).core.config.policy == settings["policy"]  # runner V1: fine
    cfg.additional_config = {}
    assert make_scheduler("kvsched", cfg, use_v2_model_runner=True).core.config.policy == "fcfs"


@needs_policy("sjf")
def test_sjf_is_a_knob() -> None:
    assert _sched({"policy": "sjf"}).core.config.policy == "sjf"


@needs_policy("slo")
@needs_field("default_ttft_slo_s")
def test_slo_and_its_default_target_are_knobs() -> None:
    c = _sched({"policy": "slo", "default_ttft_slo_s": 2}).core.config
    assert (c.policy, c.default_ttft_slo_s) == ("slo", 2.0)
    with pytest.raises(kvsched.InvalidConfigError, match="default_ttft_slo_s"):
        _sched({"policy": "slo", "default_ttft_slo_s": 0})


@needs_field("max_wait_steps")
def test_max_wait_steps_is_a_knob() -> None:
    assert _sched({"max_wait_steps": 100}).core.config.max_wait_steps == 100
    with pytest.raises(kvsched.InvalidConfigError, match="max_wait_steps"):
        _sched({"max_wait_steps": 0})


@needs_field("session_ttl_steps")
def test_session_ttl_steps_is_a_knob() -> None:
    assert _sched({"session_ttl_steps": 7}).core.config.session_ttl_steps == 7
    with pytest.raises(kvsched.InvalidConfigError, match="session_ttl_steps"):
        _sched({"session_ttl_steps": 0})


@needs_field("preemption_victim")
@pytest.mark.parametrize("victim", ["lcf", "cost"])
def test_preemption_victim_is_a_knob(victim: str) -> None:
    assert _sched({"preemption_victim": victim}).core.config.preemption_victim == victim
    with pytest.raises(kvsched.InvalidConfigError, match="preemption_victim"):
        _sched({"preemption_victim": "youngest"})


# ---- fair share inside vLLM -------------------------------------------------------------------------------


def _admission_order(policy_settings: Any) -> list[str]:
    """Tenant a queues 12 requests, one step runs, then tenant b sends one: the order in which requests are
    first scheduled (2 run at a time, each generating 4 tokens)."""
    s = _sched(policy_settings, max_num_seqs=2, num_blocks=256, max_model_len=256)
    for i in range(12):
        s.add_request(_req(f"a{i}", [100 + i] * 20, {"tenant": "a"}, max_tokens=4, arrival_time=float(i)))
    order: list[str] = []
    so, _ = _step(s)
    order += [r.req_id for r in so.scheduled_new_reqs]
    s.add_request(_req("b0", [7] * 20, {"tenant": "b"}, max_tokens=4, arrival_time=100.0))
    while s.get_num_unfinished_requests():
        so, _ = _step(s)
        order += [r.req_id for r in so.scheduled_new_reqs]
    return order


def test_fair_serves_a_late_tenant_before_the_busy_tenants_backlog() -> None:
    """The repro: with policy fair and extra_args tenants, a tenant arriving late is admitted at the next free
    slot, not after the 10 requests tenant a still has waiting. Without the knob (vLLM's FCFS) it waits for all."""
    fcfs = _admission_order(None)
    fair = _admission_order({"policy": "fair"})
    assert fcfs.index("b0") == 12  # last: behind the whole backlog
    assert fair.index("b0") == 2  # the first admission after it arrived
    assert sorted(fair) == sorted(fcfs)  # everyone is served


def test_tenant_weights_set_the_shares_inside_vllm() -> None:
    """Two backlogged tenants, b weighted 3: b gets about three quarters of the admissions while both wait."""
    s = _sched({"policy": "fair", "tenant_weights": {"b": 3}}, max_num_seqs=1, num_blocks=256, max_model_len=256)
    for i in range(16):
        for t in "ab":
            s.add_request(_req(f"{t}{i}", [ord(t), i] * 8, {"tenant": t}, max_tokens=2, arrival_time=float(i)))
    admitted: list[str] = []
    while len(admitted) < 16:
        so, _ = _step(s)
        admitted += [r.req_id[0] for r in so.scheduled_new_reqs]
    assert 11 <= admitted.count("b") <= 13, admitted


def test_tenant_attributes_under_vllms_policies_schedule_exactly_as_vllm() -> None:
    """kvsched's attributes do not change vLLM's own policies: with tenants in extra_args, fcfs and priority
    produce every output field for field as vLLM's scheduler (which ignores them)."""
    for policy in ("fcfs", "priority"):
        cfg = make_vllm_config(policy=policy, num_blocks=40, max_num_seqs=4, max_model_len=256)
        pair = (make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg))
        for i in range(10):
            for s in pair:
                s.add_request(
                    _req(f"r{i}", [i + 1] * (10 + 7 * i), {"tenant": "ab"[i % 2]}, max_tokens=12, priority=i % 3)
                )
        for _ in range(60):
            outs = [_step(s) for s in pair]
            compare("SchedulerOutput", outs[0][0], outs[1][0])
            compare("EngineCoreOutputs", outs[0][1], outs[1][1])
        assert not any(s.get_num_unfinished_requests() for s in pair)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fair_with_preemptions_completes_every_request_and_mirrors_the_core(async_scheduling: bool) -> None:
    """A tight pool under fair: victims are picked by the tenant rule (possibly already scheduled in the step);
    the adapter's Request objects keep mirroring the core, and every request gets exactly its tokens."""
    s = _sched({"policy": "fair"}, num_blocks=24, max_num_seqs=6, max_model_len=256, async_scheduling=async_scheduling)
    reqs = [_req(f"r{i}", [i + 1] * (16 + 9 * i), {"tenant": "abc"[i % 3]}, max_tokens=20) for i in range(9)]
    for r in reqs:
        s.add_request(r)
    pending: list[Any] = []
    for _ in range(400):
        so = s.schedule()
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            assert r.num_computed_tokens == s.core.get_num_computed_tokens(rid)
        pending.append(so)
        if async_scheduling and len(pending) < 2 and s.get_num_unfinished_requests():
            continue
        so = pending.pop(0)
        ids = list(so.num_scheduled_tokens)
        sampled = [[] if s.requests[r].is_prefill_chunk else [5] for r in ids]
        s.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[],
            ),
        )
        if not s.get_num_unfinished_requests() and not pending:
            break
    assert not s.get_num_unfinished_requests()
    assert s.core.stats().num_preemptions > 0
    assert all(r.num_output_tokens == 20 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)


# ---- per-request attributes ---------------------------------------------------------------------------------


def test_the_tenant_reaches_the_core_flat_or_in_the_kvsched_mapping() -> None:
    s = _sched({"policy": "fair"})
    s.add_request(_req("r0", [1, 2, 3], {"tenant": "a", "some_other_library": {"x": 1}}))
    s.add_request(_req("r1", [1, 2, 3], {"kvsched": {"tenant": "b"}}))
    s.add_request(_req("r2", [1, 2, 3]))
    stats = s.core.tenant_stats()
    assert {name: t.num_waiting_reqs for name, t in stats.items()} == {"a": 1, "b": 1, "default": 1}


def _rejected_once(s: Any, req: Any, good_extra_args: Any = None) -> Any:
    """Adds ``req`` (with a bad attribute) beside a good request (of tenant ``a`` unless ``good_extra_args`` are
    given) and runs steps until it finished; returns its error output after checking that it finished with an
    error, took no part in any step, and that the good request went on."""
    s.add_request(_req("good", [1, 2, 3, 4], good_extra_args or {"tenant": "a"}, max_tokens=2))
    s.add_request(req)  # never raises: an exception here would kill vLLM's engine core
    assert s.has_request(req.request_id) and s.has_requests()
    so, eco = _step(s)
    assert req.request_id not in so.num_scheduled_tokens and "good" in so.num_scheduled_tokens
    out = _outputs(eco)[req.request_id]
    assert out.finish_reason == FinishReason.ERROR and out.new_token_ids == []
    if RULES.output_error:
        assert out.error is not None and out.error.code == "validation_error"
    assert req.status == RequestStatus.FINISHED_ERROR and not s.has_request(req.request_id)
    assert req.request_id in s.finished_req_ids
    _step(s)
    assert s.get_num_unfinished_requests() == 0  # the good request finished normally
    assert s.requests == {}
    return out


@needs_output_error
@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"tenant": ""}, r"extra_args\['tenant'\] must be a non-empty str"),
        ({"tenant": 7}, r"extra_args\['tenant'\] must be a str, got 7"),
        ({"tenant": "\ud800"}, r"extra_args\['tenant'\] must be valid unicode"),
        ({"kvsched": {"tenant": ["a"]}}, r"extra_args\['kvsched'\]\['tenant'\] must be a str"),
        ({"kvsched": {"tennant": "a"}}, r"unknown kvsched attribute extra_args\['kvsched'\]\['tennant'\].*'tenant'"),
        ({"kvsched": "a"}, r"extra_args\['kvsched'\] must be a mapping"),
        ({"tenant": "a", "kvsched": {"tenant": "a"}}, "'tenant' is given twice"),
        ({"ttft_slo_s": 0}, r"extra_args\['ttft_slo_s'\] must be finite and > 0"),
        ({"ttft_slo_s": "1s"}, r"extra_args\['ttft_slo_s'\] must be a number of seconds"),
        ({"ttft_slo_s": float("nan")}, "must be finite and > 0"),
        ({"order_key": 1.5}, r"extra_args\['order_key'\] must be an int"),
        ({"order_key": True}, r"extra_args\['order_key'\] must be an int"),
        ({"order_key": 2**63}, "must fit in int64"),
        ({"session_id": 5}, r"extra_args\['session_id'\] must be a str"),
    ],
)
def test_a_bad_attribute_fails_that_request_only_with_an_error_naming_it(
    extra_args: dict[str, Any], message: str
) -> None:
    s = _sched({"policy": "fair"})
    out = _rejected_once(s, _req("bad", [5, 6, 7], extra_args))
    assert "request 'bad'" in out.error.message
    assert re.search(message, out.error.message), out.error.message


@needs_output_error
def test_an_attribute_the_core_refuses_fails_the_request_with_the_cores_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rule only the core knows: the adapter's own check passes, the core refuses; the request is added without
    its attributes and fails alone, with the core's message."""
    s = _sched({"policy": "fair"})
    read = s._request_attrs.read
    monkeypatch.setattr(
        s._request_attrs, "read", lambda request: {"tenant": ""} if request.request_id == "bad" else read(request)
    )
    out = _rejected_once(s, _req("bad", [5, 6, 7], {"tenant": "x"}))
    assert out.error.message == 'request "bad": a tenant name must be a non-empty string'
    assert "" not in s.core.tenant_stats()


def _engine(kvsched_settings: dict[str, Any], **fields: Any) -> tuple[Any, Any]:
    """vLLM's own EngineCore (only what ``step()`` reads; no workers, no model) around the adapter, with a model
    executor that returns one token (9) per decode; returns (engine, scheduler)."""
    import queue
    from concurrent.futures import Future

    from vllm.v1.engine.core import EngineCore

    class Executor:
        def execute_model(self, so: Any, non_block: bool = False) -> Future[Any]:
            ids = list(so.num_scheduled_tokens)
            done: Future[Any] = Future()
            done.set_result(
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[] if sched.requests[r].is_prefill_chunk else [9] for r in ids],
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=[],
                )
            )
            return done

    cfg = make_vllm_config(**fields)
    cfg.additional_config = {"kvsched": kvsched_settings}
    sched = make_scheduler("kvsched", cfg)
    engine = EngineCore.__new__(EngineCore)
    engine.scheduler, engine.model_executor, engine.vllm_config = sched, Executor(), cfg
    engine.log_stats, engine.aborts_queue, engine._weight_version = True, queue.Queue(), None
    return engine, sched


def test_vllms_engine_core_keeps_running_past_a_bad_attribute() -> None:
    """vLLM's own EngineCore.add_request and EngineCore.step (the synchronous engine loop) around the adapter:
    the request with a bad attribute comes back as an error output, the engine and the other request go on.
    (The core's model executor is a stand-in that returns one token per decode.)"""
    engine, sched = _engine({"policy": "fair"})
    engine.add_request(_req("good", [1, 2, 3], {"tenant": "a"}, max_tokens=3))
    with _Records() as logged:
        engine.add_request(_req("bad", [4, 5, 6], {"tenant": "a", "ttft_slo_s": -1}, max_tokens=3))
    assert logged == [
        "Request failed validation: request 'bad': extra_args['ttft_slo_s'] must be finite and > 0, got -1"
    ]
    outputs: dict[str, list[Any]] = {}
    for _ in range(10):
        eco, _executed = engine.step()
        for rid, out in _outputs(eco).items():
            outputs.setdefault(rid, []).append(out)
    (bad,) = outputs["bad"]
    assert bad.finish_reason == FinishReason.ERROR
    if RULES.output_error:
        assert "extra_args['ttft_slo_s']" in bad.error.message
    assert [t for o in outputs["good"] for t in o.new_token_ids] == [9, 9, 9]
    assert not sched.has_requests()


def _never_fits(req: Any) -> tuple[Any, str]:
    """A prompt longer than the whole KV cache (8 blocks of 16 tokens here) but within max_model_len."""
    req = _req(req.request_id, list(range(10, 210)), req.sampling_params.extra_args, max_tokens=3)
    return req, "do not fit the KV cache"


def _repetition_detection(req: Any) -> tuple[Any, str]:
    from vllm.sampling_params import RepetitionDetectionParams

    req.sampling_params.repetition_detection = RepetitionDetectionParams(max_pattern_size=4, min_count=3)
    return req, "does not support repetition detection"


def _prompt_embeds(req: Any) -> tuple[Any, str]:
    req.prompt_embeds = object()
    return req, "does not support prompt embeddings"


@pytest.mark.parametrize("spoil", [_never_fits, _repetition_detection, _prompt_embeds])
def test_vllms_engine_core_keeps_running_past_a_request_kvsched_refuses(spoil: Any) -> None:
    """A request kvsched cannot take (a prompt that never fits the KV cache, a vLLM feature it does not support)
    fails alone, with an error output naming why, through vLLM's own EngineCore.add_request and step: one hostile
    request cannot kill a shared engine. The other requests complete and nothing leaks."""
    engine, sched = _engine({"policy": "fair"}, num_blocks=9, block_size=16)
    engine.add_request(_req("good", [1, 2, 3], {"tenant": "a"}, max_tokens=3))
    bad, message = spoil(_req("bad", [4, 5, 6], {"tenant": "b"}, max_tokens=3))
    with _Records() as logged:
        engine.add_request(bad)
    assert any(message in m and ("request 'bad'" in m or 'request "bad"' in m) for m in logged), logged
    engine.add_request(_req("after", [7, 8, 9], {"tenant": "b"}, max_tokens=3))
    outputs: dict[str, list[Any]] = {}
    for _ in range(10):
        eco, _executed = engine.step()
        for rid, out in _outputs(eco).items():
            outputs.setdefault(rid, []).append(out)
    (out,) = outputs["bad"]
    assert out.finish_reason == FinishReason.ERROR and out.new_token_ids == []
    if RULES.output_error:
        assert out.error.code == "validation_error" and message in out.error.message
    assert bad.status == RequestStatus.FINISHED_ERROR
    for rid in ("good", "after"):
        assert [t for o in outputs[rid] for t in o.new_token_ids] == [9, 9, 9]
    assert not sched.has_requests() and sched.requests == {} and not sched._refused
    assert sched.core.num_free_blocks == sched.core.config.num_usable_blocks
    assert "b" not in sched.core.tenant_stats() or sched.core.tenant_stats()["b"].num_waiting_reqs == 0


@needs_output_error
@pytest.mark.parametrize("name", ["ttft_slo_s", "order_key"])
def test_an_attribute_the_core_does_not_take_yet_fails_the_request(name: str) -> None:
    if name in CORE_KEYWORDS:
        pytest.skip(f"the core takes {name!r}")
    out = _rejected_once(_sched(), _req("bad", [5, 6, 7], {name: 1}))
    assert f"does not take the attribute(s) {name}" in out.error.message


def test_a_session_id_is_ignored_by_a_core_without_session_affinity() -> None:
    if "session_id" in CORE_KEYWORDS:
        pytest.skip("the core takes session_id")
    s = _sched()
    req = _req("r0", [1, 2, 3], {"session_id": "chat-1"}, max_tokens=1)
    req.session_id = "chat-1"  # vLLM sets it from the body, the X-Session-ID header or vllm_xargs
    s.add_request(req)
    _step(s)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_request_aborted_before_its_error_is_reported_just_ends() -> None:
    s = _sched()
    s.add_request(_req("bad", [1, 2, 3], {"tenant": ""}))
    assert [r.request_id for r in s.finish_requests(["bad"], RequestStatus.FINISHED_ABORTED)] == ["bad"]
    _so, eco = _step(s)
    assert "bad" not in _outputs(eco)
    assert s.get_num_unfinished_requests() == 0 and s.requests == {}


def test_other_libraries_keys_are_ignored_and_near_misses_are_logged() -> None:
    s = _sched({"policy": "fair"})
    with _Records() as warnings:
        s.add_request(_req("r0", [1, 2, 3], {"tennant": "a", "kv_transfer_params": None, "logits_x": [1]}))
        s.add_request(_req("r1", [1, 2, 3], {"tennant": "b"}))  # logged once per key
    assert len(warnings) == 1 and "'tennant' is not a kvsched attribute" in warnings[0], warnings
    assert "did you mean 'tenant'" in warnings[0]
    assert set(s.core.tenant_stats()) == {"default"}
    _so, eco = _step(s)
    assert all(getattr(o, "error", None) is None for o in _outputs(eco).values())  # vLLM 0.32 has no `error`


@needs_keyword("order_key")
def test_order_key_reaches_the_core() -> None:
    s = _sched(max_num_seqs=1)
    s.add_request(_req("late_tier", [1, 2, 3], {"order_key": 5}, max_tokens=1, arrival_time=0.0))
    s.add_request(_req("early_tier", [4, 5, 6], {"order_key": -1}, max_tokens=1, arrival_time=1.0))
    so, _ = _step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["early_tier"]


@needs_policy("slo")
@needs_keyword("ttft_slo_s")
def test_ttft_slo_s_reaches_the_core_under_slo() -> None:
    s = _sched({"policy": "slo"}, max_num_seqs=1)
    s.add_request(_req("relaxed", [1, 2, 3], {"ttft_slo_s": 30}, max_tokens=1, arrival_time=0.0))
    s.add_request(_req("urgent", [4, 5, 6], {"ttft_slo_s": 0.5}, max_tokens=1, arrival_time=1.0))
    so, _ = _step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["urgent"]


@needs_output_error
@needs_keyword("session_id")
def test_session_id_reaches_the_core() -> None:
    s = _sched()
    req = _req("r0", [1, 2, 3], {"session_id": "chat-1"}, max_tokens=1)
    s.add_request(req)
    _step(s)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    req = _req("r1", [1, 2, 3], {"session_id": ""}, max_tokens=1)
    out = _rejected_once(s, req)
    assert "session_id" in out.error.message


# ---- per-tenant counts --------------------------------------------------------------------------------------


def test_per_tenant_counts_and_the_periodic_log_line() -> None:
    s = _sched({"policy": "fair", "tenant_weights": {"a": 2}}, max_num_seqs=1)
    now = [0.0]
    s._tenant_log = TenantLog(10.0, clock=lambda: now[0])
    s.add_request(_req("a0", [1] * 8, {"tenant": "a"}, max_tokens=3))
    s.add_request(_req("a1", [2] * 8, {"tenant": "a"}, max_tokens=3))
    s.add_request(_req("b0", [3] * 8, {"tenant": "b"}, max_tokens=3))
    _step(s)
    counts = tenant_counts(s)
    assert counts["a"]["running"] + counts["b"]["running"] == 1
    assert counts["a"]["waiting"] + counts["b"]["waiting"] == 2
    assert counts["a"]["prefill_tokens"] + counts["b"]["prefill_tokens"] == 8
    assert counts["a"]["weight"] == 2.0
    with _Records() as lines:
        _step(s)  # make_stats runs with each update: before the interval, nothing
        assert lines == []
        now[0] = 10.0
        _step(s)
    assert len(lines) == 1 and lines[0].startswith("kvsched tenants: a: running ")
    assert "; b: running " in lines[0] and "weight 2" in lines[0]


def test_no_tenant_line_without_tenants_or_when_turned_off() -> None:
    now = [100.0]
    s = _sched()
    s.add_request(_req("r0", [1, 2, 3], max_tokens=2))
    _step(s)
    log = TenantLog(1.0, clock=lambda: now[0])
    now[0] = 200.0
    assert log.maybe_log(s) is None  # only the default tenant
    s = _sched({"tenant_stats_interval_s": 0})
    assert s._tenant_log.interval_s == 0
    s.add_request(_req("r0", [1, 2, 3], {"tenant": "a"}, max_tokens=2))
    assert s._tenant_log.maybe_log(s) is None


def test_the_settings_do_not_leak_into_the_config_object() -> None:
    # SchedulerConfig keeps its own copy of tenant_weights: changing the vLLM config afterwards changes nothing.
    weights = {"a": 2.0}
    cfg = make_vllm_config()
    cfg.additional_config = {"kvsched": {"policy": "fair", "tenant_weights": weights}}
    s = make_scheduler("kvsched", cfg)
    weights["a"] = 5.0
    assert s.core.config.tenant_weights == {"a": 2.0}
    assert isinstance(s.core.config, SchedulerConfig)


# ---- trust boundary, tenant cache isolation, per-tenant limits (docs/security.md) -------------------------


@needs_output_error
@pytest.mark.parametrize(
    ("settings", "kw", "extra_args", "attribute", "message"),
    [
        ({"client_attributes": ["ttft_slo_s"]}, {}, {"tenant": "b"}, "tenant", "may not be set by clients"),
        ({"client_attributes": []}, {}, {"kvsched": {"order_key": 1}}, "order_key", "may not be set by clients"),
        ({"client_attributes": ["tenant"]}, {"priority": 3}, None, "priority", "may not be set by clients"),
        ({"min_ttft_slo_s": 2.0}, {}, {"ttft_slo_s": 0.5}, "ttft_slo_s", "below min_ttft_slo_s 2.0"),
        ({"order_key_range": [0, 9]}, {}, {"order_key": -1}, "order_key", r"out of order_key_range \[0, 9\]"),
        ({"priority_range": [-1, 1]}, {"priority": 5}, None, "priority", r"out of priority_range \[-1, 1\]"),
    ],
)
def test_an_attribute_outside_the_trust_boundary_fails_that_request_naming_it(
    settings: dict[str, Any], kw: dict[str, Any], extra_args: Any, attribute: str, message: str
) -> None:
    if attribute in ("ttft_slo_s", "order_key") and attribute not in CORE_KEYWORDS:
        pytest.skip(f"the core takes no {attribute!r}")
    s = _sched({"policy": "fair", **settings})
    read = s._request_attrs.read
    with pytest.raises(kvsched.ClientAttributeError) as e:
        read(_req("x", [5, 6, 7], extra_args, **kw))
    assert e.value.attribute == attribute
    out = _rejected_once(s, _req("bad", [5, 6, 7], extra_args, **kw), {"some_other_library": 1})
    assert attribute in out.error.message
    assert re.search(message, out.error.message), out.error.message
    assert "b" not in s.core.tenant_stats()


def test_the_trust_boundary_lets_allowed_attributes_and_bounded_values_through() -> None:
    s = _sched({"policy": "fair", "client_attributes": ["tenant"], "priority_range": [0, 0]})
    s.add_request(_req("r0", [1, 2, 3], {"tenant": "a"}, max_tokens=1))
    _step(s)
    assert s.core.tenant_stats()["a"].num_prefill_tokens == 3
    assert s.get_num_unfinished_requests() == 0


@needs_output_error
def test_a_gateway_token_lets_the_gateway_set_what_clients_may_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCHED_TEST_GATEWAY_TOKEN", "s3cret")
    s = _sched({"policy": "fair", "client_attributes": [], "gateway_token_env": "KVSCHED_TEST_GATEWAY_TOKEN"})
    s.add_request(_req("g", [1, 2, 3], {"tenant": "a", "kvsched_gateway_token": "s3cret"}, max_tokens=1))
    assert s.core.tenant_stats()["a"].num_waiting_reqs == 1
    gateway = {"tenant": "a", "kvsched_gateway_token": "s3cret"}
    out = _rejected_once(s, _req("forged", [1, 2, 3], {"tenant": "a", "kvsched_gateway_token": "guess"}), gateway)
    assert "wrong kvsched_gateway_token" in out.error.message
    out = _rejected_once(s, _req("client", [1, 2, 3], {"tenant": "a"}), gateway)
    assert "'tenant' may not be set by clients" in out.error.message


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"client_attributes": "tenant"}, "client_attributes must be a list"),
        ({"client_attributes": ["tennant"]}, "unknown attribute 'tennant' .*'tenant'"),
        ({"min_ttft_slo_s": 0}, "min_ttft_slo_s must be finite and > 0"),
        ({"order_key_range": [3, 1]}, "order_key_range must be a list"),
        ({"priority_range": [0, 1.5]}, "priority_range must be a list"),
        ({"gateway_token_env": "KVSCHED_NO_SUCH_VARIABLE"}, "unset or empty"),
        ({"max_waiting_per_tenant": 0}, "max_waiting_per_tenant"),
        ({"tenant_max_running": {"a": 0}}, "tenant_max_running of tenant 'a'"),
    ],
)
def test_a_bad_trust_or_limit_setting_is_refused_at_construction(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(kvsched.InvalidConfigError, match=message):
        _sched(settings)


def test_isolation_salts_vllms_hashes_as_cache_salt_and_no_tenant_hits_anothers_prefix() -> None:
    from kvsched.config import tenant_cache_salt

    prompt = list(range(1, 40))
    s = _sched({"isolate_tenant_cache": True})
    a = _req("a", prompt, {"tenant": "a"}, max_tokens=1)
    unsalted = list(a.block_hashes)
    s.add_request(a)
    # vLLM's own hashes, keyed by the tenant the way cache_salt keys block 0.
    assert a.cache_salt == tenant_cache_salt("a", None)
    assert a.block_hashes == _req("x", prompt, cache_salt=a.cache_salt).block_hashes
    assert a.block_hashes[0] != unsalted[0] and len(a.block_hashes) == len(unsalted)
    _step(s)
    b = _req("b", prompt, {"tenant": "b"}, max_tokens=1)
    a2 = _req("a2", prompt, {"tenant": "a"}, max_tokens=1)
    s.add_request(b)
    s.add_request(a2)
    so, _eco = _step(s)
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert computed == {"b": 0, "a2": 32}  # the tenant's own prefix hits; another tenant's does not
    assert b.block_hashes[0] != a2.block_hashes[0]


def test_without_isolation_the_hashes_are_vllms() -> None:
    s = _sched()
    r = _req("a", list(range(1, 40)), {"tenant": "a"}, cache_salt="c")
    before = list(r.block_hashes)
    s.add_request(r)
    assert r.cache_salt == "c" and r.block_hashes == before


def test_a_tenant_at_its_running_limit_waits_inside_vllm() -> None:
    s = _sched({"tenant_max_running": {"a": 2}})
    for i in range(4):
        s.add_request(_req(f"a{i}", [1, 2, 3], {"tenant": "a"}, max_tokens=3))
    s.add_request(_req("b0", [4, 5, 6], {"tenant": "b"}, max_tokens=3))
    so, _eco = _step(s)
    assert sorted(so.num_scheduled_tokens) == ["a0", "a1", "b0"]
    assert s.core.tenant_stats()["a"].num_running_reqs == 2
    for _ in range(20):
        _step(s)
    assert s.get_num_unfinished_requests() == 0 and s.requests == {}


@needs_output_error
@pytest.mark.parametrize("limit", [{"max_waiting_per_tenant": 2}, {"tenant_max_waiting": {"a": 2, "default": 1}}])
def test_a_full_waiting_queue_finishes_the_request_with_a_retryable_error(limit: dict[str, Any]) -> None:
    s = _sched(limit)
    for i in range(2):
        s.add_request(_req(f"a{i}", [1, 2, 3], {"tenant": "a"}, max_tokens=2))
    s.add_request(_req("default0", [1, 2], max_tokens=2))
    with _Records() as logged:
        s.add_request(_req("flood", [1, 2, 3], {"tenant": "a"}, max_tokens=2))  # never raises
        # A bad attribute falls back to the default tenant, whose queue is full too: refused all the same.
        s.add_request(_req("bad", [1, 2, 3], {"tenant": ""}, max_tokens=2))
    assert any("waiting queue of tenant 'a' is full" in m for m in logged)
    assert s.has_request("flood") and s.get_num_unfinished_requests() == 5
    assert s.core.tenant_stats()["a"].num_waiting_reqs == 2  # the core never saw it
    so, eco = _step(s)
    assert "flood" not in so.num_scheduled_tokens
    out = _outputs(eco)
    assert out["flood"].finish_reason == FinishReason.ERROR
    assert out["flood"].error.code == "queue_full" and out["flood"].error.retryable
    assert out["bad"].finish_reason == FinishReason.ERROR
    for _ in range(10):
        _step(s)
    assert s.get_num_unfinished_requests() == 0 and s.requests == {} and not s._refused
    assert s.core.num_free_blocks == s.core.config.num_usable_blocks


def test_a_refused_request_aborted_before_its_error_is_reported_just_ends() -> None:
    s = _sched({"max_waiting_per_tenant": 1})
    s.add_request(_req("r0", [1, 2, 3]))
    s.add_request(_req("r1", [1, 2, 3]))
    assert [r.request_id for r in s.finish_requests(None, RequestStatus.FINISHED_ABORTED)] == ["r0", "r1"]
    _so, eco = _step(s)
    assert _outputs(eco) == {} and s.requests == {} and not s._refused


def test_vllms_engine_core_survives_a_hostile_client() -> None:
    """vLLM's engine loop with an honest tenant and a hostile client that claims another tenant, asks for an out
    of bounds TTFT target and order key, and floods 10x its waiting limit: every hostile request comes back as an
    error output naming why, the honest requests all complete, nothing leaks."""
    limit = 4
    engine, sched = _engine(
        {
            "policy": "fair",
            "isolate_tenant_cache": True,
            "client_attributes": ["tenant", "ttft_slo_s", "order_key"],
            "min_ttft_slo_s": 1.0,
            "order_key_range": [0, 9],
            "max_waiting_per_tenant": limit,
        }
    )
    for i in range(3):
        engine.add_request(_req(f"honest{i}", [1, 2, 3, 4, 5], {"tenant": "a"}, max_tokens=3))
    engine.add_request(_req("slo", [6, 7], {"tenant": "evil", "ttft_slo_s": 0.01}, max_tokens=3))
    engine.add_request(_req("key", [6, 7], {"tenant": "evil", "order_key": -5}, max_tokens=3))
    for i in range(10 * limit):
        engine.add_request(_req(f"flood{i}", [6, 7, 8], {"tenant": "evil"}, max_tokens=3))
    outputs: dict[str, list[Any]] = {}
    for _ in range(40):
        eco, _executed = engine.step()
        for rid, out in _outputs(eco).items():
            outputs.setdefault(rid, []).append(out)

    def failed(rid: str) -> bool:
        return bool(outputs[rid][-1].finish_reason == FinishReason.ERROR)

    assert failed("slo") and failed("key")
    refused = [r for r in outputs if r.startswith("flood") and failed(r)]
    assert len(refused) == 10 * limit - limit
    if RULES.output_error:  # vLLM 0.32's outputs carry no error, only the finish reason
        assert "below min_ttft_slo_s" in outputs["slo"][-1].error.message
        assert "out of order_key_range" in outputs["key"][-1].error.message
        assert all(outputs[r][-1].error.code == "queue_full" for r in refused)
    served = [r for r in outputs if r.startswith("flood") and not failed(r)]
    assert len(served) == limit and all(len([t for o in outputs[r] for t in o.new_token_ids]) == 3 for r in served)
    for i in range(3):
        assert [t for o in outputs[f"honest{i}"] for t in o.new_token_ids] == [9, 9, 9]
    assert not sched.has_requests() and sched.requests == {} and not sched._refused
    assert sched.core.num_free_blocks == sched.core.config.num_usable_blocks
