"""Shared test helpers: a driver that plays the model runner for either scheduler implementation."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run by default, so a red run always reproduces;
# `pytest --hypothesis-profile=explore` draws new ones (and keeps failures in the example database).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


def rust_available() -> bool:
    """True when the native extension is built and importable."""
    try:
        return importlib.util.find_spec("kvsched._core") is not None
    except ImportError:
        return False


requires_rust = pytest.mark.skipif(not rust_available(), reason="kvsched._core is not built")


def default_scheduler_cls() -> Any:
    """The Rust scheduler when its extension is built, else the pure-Python reference (same semantics)."""
    if rust_available():
        from kvsched import Scheduler

        return Scheduler
    from kvsched.reference import ReferenceScheduler

    return ReferenceScheduler


def all_scheduler_classes() -> list[Any]:
    """Every implementation present (the Rust core when built, and the reference), in a stable order."""
    from kvsched.reference import ReferenceScheduler

    return sorted({default_scheduler_cls(), ReferenceScheduler}, key=lambda c: c.__name__)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random-weight Llama saved once per test session (engine tests): its directory and the HF model."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvsched.runner.testing import save_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny_llama")
    return path, save_tiny_hf_model(path, "llama")


def hf_greedy(hf: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Transformers' greedy ``generate`` continuation of each prompt, one at a time (no padding)."""
    import torch

    outs = []
    for p in prompts:
        with torch.no_grad():
            seq = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        outs.append(seq[0, len(p) :].tolist())
    return outs


def entry_sizes(sched: Any, out: Any, prompt_lens: dict[str, int]) -> list[int | None]:
    """For each entry of ``out`` (called right after ``schedule()``, before any update): None if it was a
    prefill chunk (the entry must be empty), else the most tokens it may carry (1 + scheduled drafts)."""
    sizes: list[int | None] = []
    nsched = out.num_scheduled_tokens.tolist()
    ncomp = out.num_computed_tokens.tolist()
    spec = out.spec_token_ids_indptr.tolist()
    for k, rid in enumerate(out.req_ids):
        num_drafts = spec[k + 1] - spec[k]
        num_tokens = prompt_lens[rid] + len(sched.get_output_token_ids(rid))
        if ncomp[k] + nsched[k] - num_drafts < num_tokens:
            sizes.append(None)
        else:
            sizes.append(1 + num_drafts)
    return sizes


def run_to_completion(sched: Any, prompt_lens: dict[str, int], token: int = 7, max_steps: int = 10_000) -> list[Any]:
    """Schedule/update until nothing is left, sampling ``token`` for each non-chunk entry; the outputs."""
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out = sched.schedule()
        sched.check_invariants()
        sizes = entry_sizes(sched, out, prompt_lens)
        sched.update_from_output(out, [[] if s is None else [token] for s in sizes])
        sched.check_invariants()
        outs.append(out)
    raise AssertionError("requests did not finish")


def pytest_configure(config: pytest.Config) -> None:
    # hypothesis' pytest plugin touches a deprecated mypy_extensions name while reporting a failure; with
    # filterwarnings=error that would turn a clear failure report into an INTERNALERROR.
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")
