"""One engine of a prefill/decode (P/D) run on vLLM's CPU build, in its own process: ``python vllm_e2e_pd.py SPEC OUT``.

``SPEC`` is a JSON file: ``model``, ``scheduler_cls`` (null: vLLM's own), ``role`` (``plain``: no connector,
``prefill``: ``kv_producer``, ``decode``: ``kv_consumer``), ``storage`` (the directory vLLM's ``ExampleConnector``
keeps KV in), ``async_scheduling``, ``engine`` (engine arguments) and ``requests`` (``req_id``,
``prompt_token_ids``, ``max_tokens``). The engine is vLLM's ``LLMEngine`` with its engine core in this process,
stepped until every request is done (greedy, EOS ignored). ``OUT`` gets JSON: per request its output tokens and
``num_cached_tokens``, the prompt tokens by source (computed here, local prefix-cache hits, loaded from the
connector) and the scheduler's module.

Each engine runs in a process of its own: vLLM keeps the worker-side KV connector in a module-level global
(``vllm.distributed.kv_transfer``), so a second engine with a connector in the same process would find the first
one's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm_e2e import engine_env, engine_scheduler, make_engine, shutdown


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    engine_kwargs = dict(spec["engine"])
    role = spec["role"]
    if role != "plain":
        engine_kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role],
            "kv_connector_extra_config": {"shared_storage_path": spec["storage"]},
        }
    with engine_env():
        engine = make_engine(
            spec["model"], spec["scheduler_cls"], async_scheduling=spec["async_scheduling"], **engine_kwargs
        )
        try:
            core = engine.engine_core.engine_core
            assert (core.batch_queue is not None) == spec["async_scheduling"]
            sched = engine_scheduler(engine)
            assert (sched.connector is not None) == (role != "plain")
            for r in spec["requests"]:
                params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
                engine.add_request(r["req_id"], {"prompt_token_ids": r["prompt_token_ids"]}, params)
            tokens: dict[str, list[int]] = {}
            cached: dict[str, int] = {}
            for _ in range(10_000):
                for out in engine.step():
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                    if out.finished:
                        cached[out.request_id] = int(out.num_cached_tokens or 0)
                if not engine.has_unfinished_requests():
                    break
            else:
                raise AssertionError("the requests did not finish in 10000 engine steps")
            by_source = {
                m.labels["source"]: int(m.value)
                for m in engine.get_metrics()
                if m.name == "vllm:prompt_tokens_by_source"
            }
            return {
                "tokens": tokens,
                "num_cached_tokens": cached,
                "prompt_tokens_by_source": by_source,
                "scheduler": type(sched).__module__,
                "num_requests_left": sched.get_num_unfinished_requests(),
                "kv_cache_usage": sched.get_kv_cache_usage(),
            }
        finally:
            shutdown(engine)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
