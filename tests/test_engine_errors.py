"""Errors stay with the request that caused them in ``kvsched.LLM``, and every bad input gets a typed error.

A prompt ``generate()`` cannot run (a token outside the vocabulary, a float, str or bool token, an empty prompt,
one too long for ``max_model_len``, a stop id outside the vocabulary, text without a tokenizer) comes back alone
with ``finish_reason="error"`` and the reason in ``error``; the prompts beside it still give transformers' greedy
tokens and nothing leaks. ``SamplingParams`` and ``LLM(...)`` refuse bad values naming the field;
``LLM(scheduler_config=...)`` and the keywords agree or raise; ``abort_requests`` answers as
``Scheduler.abort_requests`` does; ``kvsched generate`` reports failed requests and exits 1, and answers bad
options with one line and exit 2; ``python -m kvsched.runner.testing DIR`` writes a model it can run; the progress
bar is drawn only on a terminal and only when asked for."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead on small CI machines
pytest.importorskip("transformers")

from conftest import default_scheduler_cls, hf_greedy  # noqa: E402
from kvsched import (  # noqa: E402
    InvalidConfigError,
    InvalidRequestError,
    SchedulerConfig,
    SchedulerError,
    SchedulerTypeError,
    UnknownRequestError,
)
from kvsched.engine import LLM, SamplingParams  # noqa: E402

SCHEDULER_CLS = default_scheduler_cls()
ROOT = Path(__file__).resolve().parent.parent
VOCAB = 300  # save_tiny_hf_model's vocabulary
MAX_MODEL_LEN = 64
NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
GOOD = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(scope="module")
def llm(tiny_llama: tuple[Path, Any]) -> LLM:
    path, _ = tiny_llama
    return LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        scheduler_cls=SCHEDULER_CLS,
    )


@pytest.fixture(scope="module")
def expected(tiny_llama: tuple[Path, Any]) -> list[list[int]]:
    return hf_greedy(tiny_llama[1], GOOD, GREEDY.max_tokens)


def assert_clean(llm: LLM) -> None:
    """Nothing left behind: no request in the scheduler or the runner, every block free, invariants hold."""
    assert not llm.has_unfinished_requests()
    assert llm.runner.num_requests == 0
    assert llm.scheduler.num_free_blocks == NUM_BLOCKS - 1
    llm.scheduler.check_invariants()


# (id, prompt, params or None, error class, a piece of the message)
BAD_PROMPTS: list[tuple[str, Any, SamplingParams | None, type[Exception], str]] = [
    ("token-at-vocab-size", [5, VOCAB], None, InvalidRequestError, f"prompt token 1 is {VOCAB}, outside"),
    ("token-100000", [1, 100000], None, InvalidRequestError, "vocabulary [0, 300)"),
    ("token-2**31+7", [5, 2**31 + 7], None, InvalidRequestError, str(2**31 + 7)),
    ("token-2**70", [5, 2**70], None, InvalidRequestError, str(2**70)),
    ("negative-token", [5, -1], None, InvalidRequestError, "prompt token 1 is -1"),
    ("numpy-array-beyond-vocab", np.array([5, 400], np.int64), None, InvalidRequestError, "is 400"),
    ("float-tokens", [1.7, 2.0], None, SchedulerTypeError, "prompt token 0 must be an int, got 1.7"),
    ("float-after-ints", [5, 6, 7.0], None, SchedulerTypeError, "prompt token 2 must be an int"),
    ("str-tokens", [["5", "6"]], None, SchedulerTypeError, "got '5' (str)"),
    ("bool-token", [5, True], None, SchedulerTypeError, "got True (bool)"),
    ("numpy-bool-token", [np.int64(5), np.bool_(True)], None, SchedulerTypeError, "bool"),
    ("float-array", np.array([5.0, 6.0]), None, SchedulerTypeError, "integer dtype"),
    ("bool-array", np.array([True, False]), None, SchedulerTypeError, "integer dtype"),
    ("2d-array-row", [np.array([[5, 6]])], None, SchedulerTypeError, "1-D"),
    ("int-as-a-prompt", [7], None, SchedulerTypeError, "got int"),
    ("bytes-prompt", [b"\x05\x06"], None, SchedulerTypeError, "got bytes"),
    ("empty-prompt", [[]], None, InvalidRequestError, "the prompt is empty"),
    ("too-long", list(range(3, 3 + MAX_MODEL_LEN)), None, InvalidRequestError, f"max_model_len={MAX_MODEL_LEN}"),
    (
        "stop-id-beyond-vocab",
        [5, 6],
        SamplingParams(stop_token_ids=(VOCAB,), min_tokens=1),
        InvalidRequestError,
        "stop_token_ids holds 300",
    ),
    ("text-without-tokenizer", "hello", None, InvalidRequestError, "tokenizer.json"),
]


def _single(prompt: Any) -> Any:
    """``prompt`` as one element of a prompt list (the cases above that already are one are given wrapped)."""
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt


@pytest.mark.parametrize(
    ("prompt", "params", "error", "text"), [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS]
)
def test_a_bad_prompt_fails_alone_and_the_others_give_transformers_tokens(
    llm: LLM, expected: list[list[int]], prompt: Any, params: Any, error: type[Exception], text: str
) -> None:
    bad = _single(prompt)
    outs = llm.generate([GOOD[0], bad, GOOD[1]], [GREEDY, params or GREEDY, GREEDY], use_tqdm=False)
    first, refused, last = outs
    assert refused.finish_reason == "error" and refused.outputs[0].finish_reason == "error"
    assert refused.error is not None and refused.error.startswith(f"{error.__name__}: ")
    assert text in refused.error, refused.error
    assert refused.output_token_ids == [] and refused.finished
    assert refused.metrics.finish_time is not None
    assert len({o.request_id for o in outs}) == 3
    assert [first.output_token_ids, last.output_token_ids] == expected
    assert first.error is None and last.error is None
    assert first.finish_reason == last.finish_reason == "length"
    assert_clean(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "text"), [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS]
)
def test_add_request_raises_the_same_typed_error_and_adds_nothing(
    llm: LLM, prompt: Any, params: Any, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)) as info:
        llm.add_request(_single(prompt), params)
    assert isinstance(info.value, SchedulerError)
    assert_clean(llm)


def test_numpy_integer_tokens_are_ints(llm: LLM, expected: list[list[int]]) -> None:
    prompts: list[Any] = [
        [np.int64(5), np.int32(6), np.uint16(7), 8, np.int8(9)],
        np.array(GOOD[1], dtype=np.uint32),
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    assert [type(t) for t in outs[0].prompt_token_ids] == [int] * 5
    assert_clean(llm)


def test_a_request_past_max_model_len_in_outputs_is_capped_not_refused(llm: LLM) -> None:
    """Prompt + max_tokens beyond max_model_len runs, and stops at max_model_len with "length" (as in vLLM)."""
    prompt = list(range(3, 3 + MAX_MODEL_LEN - 4))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out.error is None and out.finish_reason == "length"
    assert len(out.output_token_ids) == 4
    assert_clean(llm)


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        (lambda llm: llm.generate(5), SchedulerTypeError, "prompts must be"),
        (lambda llm: llm.generate(None), SchedulerTypeError, "got NoneType"),
        (lambda llm: llm.generate(b"abc"), SchedulerTypeError, "got bytes"),
        (lambda llm: llm.generate({"a": [1]}), SchedulerTypeError, "got dict"),
        (lambda llm: llm.generate(np.int64(5)), SchedulerTypeError, "prompts must be"),
        (lambda llm: llm.generate(GOOD, "greedy"), SchedulerTypeError, "sampling_params must be"),
        (lambda llm: llm.generate(GOOD, [GREEDY, None]), SchedulerTypeError, "sampling_params[1]"),
        (lambda llm: llm.generate(GOOD, [GREEDY]), InvalidRequestError, "1 sampling params for 2 prompts"),
        (lambda llm: llm.add_request(GOOD[0], "greedy"), SchedulerTypeError, "params must be a SamplingParams"),
    ],
    ids=[
        "int",
        "none",
        "bytes",
        "dict",
        "numpy-scalar",
        "params-str",
        "params-none-entry",
        "params-count",
        "add-params-str",
    ],
)
def test_a_wrong_call_raises_and_adds_nothing(
    llm: LLM, call: Callable[[LLM], Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)):
        call(llm)
    assert_clean(llm)


def test_generate_leaves_an_earlier_request_with_the_id_it_would_pick_alone(llm: LLM) -> None:
    llm.add_request(GOOD[0], GREEDY, request_id=str(llm._next_id))
    outs = llm.generate([GOOD[1]], GREEDY, use_tqdm=False)
    assert outs[0].error is None and outs[0].finish_reason == "length"
    assert_clean(llm)


def test_an_id_reused_right_after_its_request_finished_runs_normally(llm: LLM, expected: list[list[int]]) -> None:
    """The scheduler reports a finish in the next step's output; by then the id belongs to the new request, and
    the runner must keep it."""
    for prompt, want in zip(GOOD, expected, strict=True):
        llm.add_request(prompt, GREEDY, request_id="again")
        finished = []
        while llm.has_unfinished_requests():
            finished += llm.step()
        assert [(o.request_id, o.output_token_ids, o.error) for o in finished] == [("again", want, None)]
    assert_clean(llm)


# ---- SamplingParams ------------------------------------------------------------------------------------------

BAD_PARAMS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"top_k": 2.5}, SchedulerTypeError, "top_k must be an int, got 2.5"),
    ({"top_k": -1}, InvalidRequestError, "top_k"),
    ({"top_k": 2**40}, InvalidRequestError, "top_k"),
    ({"max_tokens": "8"}, SchedulerTypeError, "max_tokens must be an int, got '8'"),
    ({"max_tokens": math.nan}, SchedulerTypeError, "max_tokens must be an int, got nan"),
    ({"max_tokens": 8.0}, SchedulerTypeError, "max_tokens"),
    ({"max_tokens": True}, SchedulerTypeError, "max_tokens"),
    ({"max_tokens": 0}, InvalidRequestError, "max_tokens must be >= 1, got 0"),
    ({"min_tokens": -1}, InvalidRequestError, "min_tokens"),
    ({"min_tokens": 1.5}, SchedulerTypeError, "min_tokens"),
    ({"max_tokens": 2, "min_tokens": 3}, InvalidRequestError, "min_tokens"),
    ({"temperature": "x"}, SchedulerTypeError, "temperature must be a number"),
    ({"temperature": None}, SchedulerTypeError, "temperature"),
    ({"temperature": -1.0}, InvalidRequestError, "temperature"),
    ({"temperature": math.nan}, InvalidRequestError, "temperature"),
    ({"temperature": math.inf}, InvalidRequestError, "temperature"),
    ({"temperature": 10**400}, InvalidRequestError, "temperature"),
    ({"temperature": False}, SchedulerTypeError, "temperature"),
    ({"top_p": 0.0}, InvalidRequestError, "top_p"),
    ({"top_p": 1.5}, InvalidRequestError, "top_p"),
    ({"top_p": math.nan}, InvalidRequestError, "top_p"),
    ({"top_p": "1"}, SchedulerTypeError, "top_p"),
    ({"seed": 1.5}, SchedulerTypeError, "seed must be an int"),
    ({"seed": "7"}, SchedulerTypeError, "seed"),
    ({"seed": 2**64}, InvalidRequestError, "seed"),
    ({"stop_token_ids": "ab"}, SchedulerTypeError, "stop_token_ids must be a sequence"),
    ({"stop_token_ids": 5}, SchedulerTypeError, "stop_token_ids must be a sequence"),
    ({"stop_token_ids": [1.5]}, SchedulerTypeError, "stop_token_ids[0] must be an int"),
    ({"stop_token_ids": [3, True]}, SchedulerTypeError, "stop_token_ids[1]"),
    ({"stop_token_ids": [-1]}, InvalidRequestError, "stop_token_ids[0]"),
    ({"stop_token_ids": [2**31]}, InvalidRequestError, "stop_token_ids[0]"),
    ({"ignore_eos": "yes"}, SchedulerTypeError, "ignore_eos must be a bool"),
    ({"ignore_eos": 1}, SchedulerTypeError, "ignore_eos"),
]


@pytest.mark.parametrize(("kwargs", "error", "text"), BAD_PARAMS, ids=[repr(c[0]) for c in BAD_PARAMS])
def test_sampling_params_refuse_bad_values_naming_the_field(
    kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, SchedulerError)


def test_sampling_params_take_numpy_scalars_as_plain_values() -> None:
    p = SamplingParams(
        max_tokens=np.int64(4),
        min_tokens=np.int32(1),
        temperature=np.float32(0.5),
        top_k=np.uint8(3),
        top_p=np.float64(0.9),
        seed=np.int64(7),
        stop_token_ids=np.array([2, 3]),
        ignore_eos=np.bool_(True),
    )
    assert (p.max_tokens, p.min_tokens, p.top_k, p.seed, p.stop_token_ids) == (4, 1, 3, 7, (2, 3))
    assert [type(v) for v in (p.max_tokens, p.min_tokens, p.top_k, p.seed, *p.stop_token_ids)] == [int] * 6
    assert type(p.temperature) is float and type(p.top_p) is float and p.ignore_eos is True
    assert SamplingParams(temperature=0, top_p=1) == SamplingParams(temperature=0.0, top_p=1.0)


# ---- LLM(...) options -------------------------------------------------------------------------------------

BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"max_model_len": -5}, InvalidConfigError, "max_model_len must be in [2,"),
    ({"max_model_len": 0}, InvalidConfigError, "max_model_len"),
    ({"max_model_len": 2000}, InvalidConfigError, "max_model_len=2000 is beyond the model's positions"),
    ({"max_model_len": 513}, InvalidConfigError, "max_position_embeddings=512"),
    ({"max_model_len": 64.0}, InvalidConfigError, "max_model_len must be an int"),
    ({"block_size": 8192}, InvalidConfigError, "block_size must be in [1, 4096]"),
    ({"block_size": "16"}, InvalidConfigError, "block_size"),
    ({"num_blocks": "x"}, InvalidConfigError, "num_blocks must be an int"),
    ({"num_blocks": 1}, InvalidConfigError, "num_blocks"),
    ({"max_num_seqs": 0}, InvalidConfigError, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, InvalidConfigError, "max_num_batched_tokens"),
    ({"enable_prefix_caching": 1}, InvalidConfigError, "enable_prefix_caching"),
    ({"preemption_mode": "bogus"}, InvalidConfigError, "preemption_mode"),
    ({"policy": "bogus"}, InvalidConfigError, "policy"),
    ({"gpu_memory_fraction": 0}, InvalidConfigError, "gpu_memory_fraction"),
    ({"gpu_memory_fraction": "0.5"}, InvalidConfigError, "gpu_memory_fraction"),
    ({"cpu_kv_cache_gib": math.nan}, InvalidConfigError, "cpu_kv_cache_gib"),
    ({"swap_space_gib": -1.0}, InvalidConfigError, "swap_space_gib"),
    ({"attention_backend": "flash"}, InvalidConfigError, "attention_backend"),
    ({"enable_cuda_graphs": "yes"}, InvalidConfigError, "enable_cuda_graphs"),
    ({"seed": 1.5}, InvalidConfigError, "seed"),
    ({"dtype": "int8"}, InvalidConfigError, "dtype"),
    ({"dtype": 16}, InvalidConfigError, "dtype"),
    ({"device": "tpu"}, InvalidConfigError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ({"device": "mps"}, InvalidConfigError, "device"),
    ({"device": 0}, InvalidConfigError, "device"),
    ({"scheduler_cls": 5}, InvalidConfigError, "scheduler_cls"),
    ({"no_such_option": 1}, SchedulerTypeError, "unexpected keyword argument 'no_such_option'"),
]


@pytest.mark.parametrize(("kwargs", "error", "text"), BAD_OPTIONS, ids=[repr(c[0]) for c in BAD_OPTIONS])
def test_llm_refuses_bad_options_naming_the_field(
    tiny_llama: tuple[Path, Any], kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    path, _ = tiny_llama
    with pytest.raises(error, match=re.escape(text)) as info:
        LLM(path, **{"device": "cpu", "num_blocks": NUM_BLOCKS, **kwargs})
    assert isinstance(info.value, SchedulerError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_llm_on_cuda_without_a_gpu_is_a_typed_error(tiny_llama: tuple[Path, Any], device: str) -> None:
    with pytest.raises(InvalidConfigError, match="torch finds no CUDA device"):
        LLM(tiny_llama[0], device=device)


def _model_dirs(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    (bad_json / "model.safetensors").write_bytes(b"")
    no_key = tmp_path / "no-key"
    no_key.mkdir()
    cfg = json.loads((good / "config.json").read_text())
    del cfg["hidden_size"]
    (no_key / "config.json").write_text(json.dumps(cfg))
    (no_key / "model.safetensors").write_bytes(b"")
    return {
        "missing": (tmp_path / "nonexistent", "does not exist"),
        "a-file": (tmp_path / "a-file", "is not a directory"),
        "empty": (tmp_path / "empty", "no config.json"),
        "no-weights": (no_weights, "no *.safetensors"),
        "bad-json": (bad_json, "config.json"),
        "no-key": (no_key, "lacks 'hidden_size'"),
    }


@pytest.mark.parametrize("case", ["missing", "a-file", "empty", "no-weights", "bad-json", "no-key"])
def test_llm_refuses_a_bad_model_directory(tiny_llama: tuple[Path, Any], tmp_path: Path, case: str) -> None:
    path, text = _model_dirs(tmp_path, tiny_llama[0])[case]
    with pytest.raises(InvalidConfigError, match=re.escape(text)):
        LLM(path, device="cpu")
    with pytest.raises(InvalidConfigError, match="model must be"):
        LLM(42, device="cpu")  # type: ignore[arg-type]


# ---- scheduler_config= ------------------------------------------------------------------------------------

CONFIG = SchedulerConfig(block_size=8, num_blocks=NUM_BLOCKS, max_model_len=256, max_num_seqs=2)


def test_scheduler_config_is_used_as_given_and_matches_the_keywords(
    tiny_llama: tuple[Path, Any], expected: list[list[int]]
) -> None:
    path, _ = tiny_llama
    llm = LLM(path, device="cpu", scheduler_config=CONFIG, scheduler_cls=SCHEDULER_CLS)
    assert llm.scheduler_config is CONFIG
    assert llm.runner.block_size == 8 and llm.runner.num_blocks == NUM_BLOCKS and llm.runner.max_model_len == 256
    assert [o.output_token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)] == expected
    by_keywords = LLM(path, device="cpu", block_size=8, num_blocks=NUM_BLOCKS, max_model_len=256, max_num_seqs=2)
    assert by_keywords.scheduler_config == CONFIG
    # A keyword that says the same as the config is accepted.
    same = LLM(path, device="cpu", scheduler_config=CONFIG, block_size=8, max_num_seqs=2, policy="fcfs")
    assert same.scheduler_config is CONFIG


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"block_size": 16}, InvalidConfigError, "block_size=16 conflicts with scheduler_config.block_size=8"),
        ({"max_num_seqs": 4}, InvalidConfigError, "max_num_seqs=4 conflicts"),
        ({"num_blocks": 32}, InvalidConfigError, "num_blocks=32 conflicts"),
        ({"max_model_len": 128}, InvalidConfigError, "max_model_len=128 conflicts"),
        ({"policy": "priority"}, InvalidConfigError, "policy='priority' conflicts"),
        ({"enable_prefix_caching": False}, InvalidConfigError, "enable_prefix_caching=False conflicts"),
        ({"scheduler_config": {"block_size": 8}}, SchedulerTypeError, "scheduler_config must be a SchedulerConfig"),
        ({"scheduler_config": SchedulerConfig()}, InvalidConfigError, "scheduler_config.max_model_len=8192 is beyond"),
    ],
    ids=[
        "block_size",
        "max_num_seqs",
        "num_blocks",
        "max_model_len",
        "policy",
        "prefix-caching",
        "a-dict",
        "longer-than-the-model",
    ],
)
def test_scheduler_config_and_keywords_that_disagree_are_a_typed_error(
    tiny_llama: tuple[Path, Any], kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)):
        LLM(tiny_llama[0], device="cpu", **{"scheduler_config": CONFIG, **kwargs})


def test_keywords_not_given_take_scheduler_configs_defaults(tiny_llama: tuple[Path, Any]) -> None:
    llm = LLM(tiny_llama[0], device="cpu", num_blocks=NUM_BLOCKS)
    defaults = SchedulerConfig()
    cfg = llm.scheduler_config
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "policy"):
        assert getattr(cfg, name) == getattr(defaults, name), name
    # max_model_len: the model's positions (512), within SchedulerConfig's default and the KV cache.
    assert cfg.max_model_len == min(512, defaults.max_model_len, (NUM_BLOCKS - 1) * defaults.block_size)


# ---- abort_requests ---------------------------------------------------------------------------------------

ABORT_FORMS: list[tuple[str, Any]] = [
    ("bare-str", "a"),
    ("bare-str-unknown", "job42"),
    ("int", 5),
    ("none", None),
    ("unknown-id", ["job42"]),
    ("known-and-unknown", ["a", "job42"]),
    ("int-id", ["a", 5]),
    ("bytes-id", [b"a"]),
]


@pytest.mark.skipif(SCHEDULER_CLS.__name__ != "Scheduler", reason="compares with the Rust scheduler")
@pytest.mark.parametrize("req_ids", [f[1] for f in ABORT_FORMS], ids=[f[0] for f in ABORT_FORMS])
def test_abort_requests_answers_as_the_scheduler_does(llm: LLM, req_ids: Any) -> None:
    sched = SCHEDULER_CLS(CONFIG)
    sched.add_request("a", np.array(GOOD[0], np.int32), max_tokens=5)
    llm.add_request(GOOD[0], GREEDY, request_id="a")
    with pytest.raises(SchedulerError) as want:
        sched.abort_requests(req_ids)
    with pytest.raises(SchedulerError) as got:
        llm.abort_requests(req_ids)
    assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))
    assert isinstance(got.value, (SchedulerTypeError, UnknownRequestError))
    # Nothing was aborted: "a" still runs to its end.
    finished = []
    while llm.has_unfinished_requests():
        finished += llm.step()
    assert [(o.request_id, o.finish_reason) for o in finished] == [("a", "length")]
    assert_clean(llm)


@pytest.mark.parametrize("form", [list, tuple, iter], ids=["list", "tuple", "iterator"])
def test_abort_requests_takes_any_iterable_of_ids(llm: LLM, form: Callable[[list[str]], Any]) -> None:
    llm.add_request(GOOD[0], GREEDY, request_id="a")
    llm.add_request(GOOD[1], GREEDY, request_id="b")
    llm.step()
    llm.abort_requests(form(["a", "b"]))
    assert_clean(llm)
    with pytest.raises(UnknownRequestError, match="a"):
        llm.abort_requests(["a"])  # already aborted


# ---- the progress bar -------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@contextlib.contextmanager
def _stderr(stream: io.StringIO) -> Iterator[io.StringIO]:
    saved = sys.stderr
    sys.stderr = stream
    try:
        yield stream
    finally:
        sys.stderr = saved


def test_generate_draws_a_progress_bar_on_a_terminal_only_when_asked(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts: list[Any] = [*GOOD, [5, VOCAB]]  # the refused one counts as done too
    with _stderr(_Tty()) as tty:
        llm.generate(prompts, GREEDY)
    assert "Processed prompts" in tty.getvalue() and "3/3" in tty.getvalue()
    assert "output" in tty.getvalue() and "tok/s" in tty.getvalue()
    with _stderr(_Tty()) as off:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert off.getvalue() == ""
    llm.generate(prompts, GREEDY)  # stderr is pytest's capture here: not a terminal
    assert capsys.readouterr() == ("", "")
    assert_clean(llm)


# ---- kvsched generate -------------------------------------------------------------------------------------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from kvsched.cli import main

    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_reports_a_failed_request_and_exits_1(
    tiny_llama: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path, hf = tiny_llama
    base = ["--model", str(path), "--device", "cpu", "--num-blocks", "32", "--max-tokens", "4", "--temperature", "0"]
    rc, out, err = _cli([*base, "--prompt-ids", "1,2,3", "--prompt-ids", "1,100000", "--json"], capsys)
    assert rc == 1
    good, bad = (json.loads(line) for line in out.splitlines())
    assert good["error"] is None and good["finish_reason"] == "length"
    assert good["output_token_ids"] == hf_greedy(hf, [[1, 2, 3]], 4)[0]
    assert bad["finish_reason"] == "error" and bad["output_token_ids"] == []
    assert "prompt token 1 is 100000" in bad["error"]
    assert err.strip() == f"kvsched generate: request 1 failed: {bad['error']}"

    rc, out, err = _cli([*base, "--prompt-ids", "1,2,3", "--prompt-ids", "1,-4"], capsys)
    assert rc == 1 and "[error, 0 tokens" in out and "prompt token 1 is -4" in err
    rc, out, err = _cli([*base, "--prompt-ids", "1,2,3"], capsys)
    assert rc == 0 and err == "" and "[length, 4 tokens" in out


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--device", "tpu"], "device must be"),
        (["--dtype", "int8"], "dtype"),
        (["--max-model-len", "-5"], "max_model_len must be in [2,"),
        (["--max-model-len", "4096"], "max_position_embeddings=512"),
        (["--block-size", "8192"], "block_size must be in [1, 4096]"),
        (["--num-blocks", "1"], "num_blocks"),
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
    ids=[
        "device",
        "dtype",
        "negative-max-model-len",
        "max-model-len-beyond-positions",
        "block-size",
        "num-blocks",
        "top-p",
        "max-tokens",
    ],
)
def test_cli_bad_options_exit_2_with_one_line(
    tiny_llama: tuple[Path, Any], capsys: pytest.CaptureFixture[str], argv: list[str], text: str
) -> None:
    rc, out, err = _cli(["--model", str(tiny_llama[0]), "--prompt-ids", "1,2", *argv], capsys)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("kvsched generate: ") and text in err, err


@pytest.mark.parametrize("case", ["missing", "a-file", "empty", "no-weights", "bad-json", "no-key"])
def test_cli_bad_model_directory_exits_2_with_one_line(
    tiny_llama: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    path, text = _model_dirs(tmp_path, tiny_llama[0])[case]
    rc, out, err = _cli(["--model", str(path), "--prompt-ids", "1,2", "--device", "cpu"], capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and text in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_on_cuda_without_a_gpu_exits_2_with_one_line(
    tiny_llama: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _cli(["--model", str(tiny_llama[0]), "--prompt-ids", "1,2", "--device", "cuda"], capsys)
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        "kvsched generate: device='cuda', but torch finds no CUDA device on this machine "
        "(torch.cuda.is_available() is False); use device='cpu'"
    ]


# ---- the tiny model directory -----------------------------------------------------------------------------


def test_the_tiny_model_command_writes_a_model_generate_runs_the_same_way_each_time(
    tiny_llama: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvsched.runner.testing import main

    first, second = tmp_path / "tiny-a", tmp_path / "tiny-b"
    assert main([str(first)]) == 0
    assert f"kvsched generate --model {first} --prompt 'w5 w6 w7'" in capsys.readouterr().out
    assert main([str(second)]) == 0
    capsys.readouterr()
    assert {p.name for p in first.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    records = []
    for path in (first, second):
        argv = ["--model", str(path), "--prompt", "w5 w6 w7", "--max-tokens", "6", "--temperature", "0", "--json"]
        rc, out, _ = _cli([*argv, "--device", "cpu", "--num-blocks", "32"], capsys)
        assert rc == 0
        records.append(json.loads(out))
    assert records[0]["output_token_ids"] == records[1]["output_token_ids"]
    assert records[0]["prompt_token_ids"] == [5, 6, 7]
    assert records[0]["text"] == " ".join(f"w{t}" for t in records[0]["output_token_ids"])
    # The tests' tiny model (save_tiny_hf_model, seed 0): the same weights, and transformers' tokens.
    path, hf = tiny_llama
    assert (first / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert records[0]["output_token_ids"] == hf_greedy(hf, [[5, 6, 7]], 6)[0]

    assert main([str(tmp_path / "tiny-a" / "config.json")]) == 2  # a file, not a directory
    assert "not a directory" in capsys.readouterr().err


def test_the_tiny_model_command_without_transformers_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvsched.runner.testing import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main([str(tmp_path / "m")]) == 2
    assert "needs transformers" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_docs_tiny_example_gives_the_same_tokens_on_every_run() -> None:
    text = (ROOT / "docs" / "runner.md").read_text(encoding="utf-8")
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "tiny_config()" in block]
    assert "seed=" in code
    printed = []
    for _ in range(2):
        torch.manual_seed(len(printed) + 123)  # the global generator differs before each run
        stream = io.StringIO()
        with contextlib.redirect_stdout(stream):
            exec(compile(code, "docs/runner.md", "exec"), {})
        printed.append(stream.getvalue())
    assert printed[0] == printed[1] and printed[0].startswith("[[")
