"""pytest plugin loaded by ``tests/vllm_suite/run.py`` into a run of vLLM 0.33's own scheduler tests.

With ``KVSCHED_SUITE_IMPL=kvsched`` it puts ``kvsched.vllm.Scheduler`` where vLLM's tests name vLLM's
``Scheduler``/``AsyncScheduler``: every module global of vLLM's test tree (modules ``tests.*``) bound to one of
those two classes, e.g. in ``tests/v1/core/utils.py`` (read by ``create_scheduler``),
``tests/v1/kv_connector/unit/utils.py``, ``tests/v1/core/test_scheduler.py`` (``create_scheduler_with_priority``)
and the test files that import vLLM's class themselves. vLLM's test code itself is not changed. With
``KVSCHED_SUITE_IMPL=vllm`` nothing is substituted (the baseline run).

Either way it records, per test case, the outcome, the failure's one-line crash message, and which scheduler
classes the test constructed (a test that never built kvsched's class does not count as passing against it), and
writes them as JSON to ``KVSCHED_SUITE_RESULTS`` at the end of the pytest run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Generator
from typing import Any

import pytest

_IMPL = os.environ.get("KVSCHED_SUITE_IMPL", "kvsched")
_RESULTS_PATH = os.environ.get("KVSCHED_SUITE_RESULTS")
# Which scheduler classes the current test constructed (kvsched's, vLLM's sync/async/other).
_built: set[str] = set()
_results: dict[str, dict[str, Any]] = {}


def _record_vllm_constructions() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    original = VllmScheduler.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _built.add(f"vllm:{type(self).__name__}")
        original(self, *args, **kwargs)

    VllmScheduler.__init__ = __init__


def _kvsched_class(force_async: bool = False) -> type:
    import kvsched.vllm

    class Scheduler(kvsched.vllm.Scheduler):  # type: ignore[misc,name-defined]
        """kvsched.vllm.Scheduler, noting that the current test built it. In place of vLLM's ``AsyncScheduler``
        (``force_async``) it schedules asynchronously whatever the config says, as that class does (the CPU
        platform turns the config's ``async_scheduling`` off)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _built.add("kvsched")
            if force_async:
                config = kwargs.get("vllm_config", args[0] if args else None)
                if config is not None:
                    config.scheduler_config.async_scheduling = True
            super().__init__(*args, **kwargs)

    Scheduler.__qualname__ = Scheduler.__name__ = "Scheduler"
    Scheduler.__module__ = "kvsched.vllm.scheduler"
    return Scheduler


_SUBSTITUTE: type | None = None
_ASYNC_SUBSTITUTE: type | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _SUBSTITUTE, _ASYNC_SUBSTITUTE
    root = os.environ["KVSCHED_SUITE_ROOT"]
    if root not in sys.path:
        sys.path.insert(0, root)
    _record_vllm_constructions()
    if _IMPL != "kvsched":
        return
    _SUBSTITUTE = _kvsched_class()
    _ASYNC_SUBSTITUTE = _kvsched_class(force_async=True)
    import importlib

    for name in ("tests.v1.core.utils", "tests.v1.kv_connector.unit.utils"):
        _substitute(importlib.import_module(name))


def _substitute(module: Any) -> None:
    """Rebinds the module's globals that name vLLM's ``Scheduler`` or ``AsyncScheduler`` to kvsched's class."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    for name, value in list(vars(module).items()):
        if value is VllmScheduler:
            setattr(module, name, _SUBSTITUTE)
        elif value is VllmAsyncScheduler:
            setattr(module, name, _ASYNC_SUBSTITUTE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _SUBSTITUTE is None:
        return
    # Every module of vLLM's test tree imported by now: the collected test files and what they import (e.g.
    # test_scheduler.py's create_scheduler_with_priority, used by other files).
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "tests" or name.startswith("tests.")):
            _substitute(module)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _built.clear()


_TIMEOUT_S = int(os.environ.get("KVSCHED_SUITE_TIMEOUT", "120"))


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the test ran longer than {_TIMEOUT_S} s (KVSCHED_SUITE_TIMEOUT)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    text = str(longrepr)
    missing = re.search(r"fixture '\w+' not found", text)  # a setup error has no crash line
    return missing.group(0) if missing else text[-500:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": "", "built": []})
    if report.failed:
        if entry["outcome"] != "failed":
            entry["outcome"] = "failed"
            entry["message"] = _message(report)
            entry["when"] = report.when
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["message"] = _message(report)
    if report.when == "teardown":
        entry["built"] = sorted(_built)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _RESULTS_PATH:
        with open(_RESULTS_PATH, "w", encoding="utf-8") as f:
            json.dump({"impl": _IMPL, "results": _results}, f, indent=1, sort_keys=True)
