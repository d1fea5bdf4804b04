"""The package's layering, checked from the source (AST), not by importing anything.

Layers, lowest first: the scheduler, the runner (``kvsched.runner``), the engine (``kvsched.engine``), and on top
the command line, the benchmarks and the simulator. A module may import what is below it, never what is above:
nothing under ``python/kvsched/runner/`` imports the engine, the CLI, the benchmarks or the simulator, in any
form (absolute, relative, lazily inside a function, under ``TYPE_CHECKING``, or through a lazy name of
``kvsched/__init__``). And the benchmark modules import each other without cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvsched

PKG_DIR = Path(__file__).resolve().parent.parent / "python" / "kvsched"

# Above the runner: a module under kvsched/runner/ may import none of these (nor their submodules).
ABOVE_RUNNER = ("kvsched.engine", "kvsched.cli", "kvsched.cli_generate", "kvsched.bench", "kvsched.sim")


def module_name(path: Path) -> str:
    parts = ["kvsched", *path.relative_to(PKG_DIR).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module that ``source`` (the text of ``module``) may import, anywhere in the file.

    ``from X import n`` counts as importing ``X`` and ``X.n`` (``n`` may be a submodule); ``from kvsched import
    LLM`` counts as importing the module that ``kvsched.__getattr__`` loads for it."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            found.add(base)
            for alias in node.names:
                found.add(f"{base}.{alias.name}")
                if base == "kvsched" and alias.name in kvsched._LAZY:
                    found.add(f"kvsched.{kvsched._LAZY[alias.name]}")
    return found


def is_within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def runner_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    return sorted(m for m in imported_modules(source, module, is_package) if is_within(m, ABOVE_RUNNER))


def test_the_scanner_finds_every_form_of_an_upward_import() -> None:
    source = """
from kvsched.engine import LLM
def f():
    from ..cli_generate import run_generate
    import kvsched.bench.harness
from kvsched import SamplingParams
from .. import sim
"""
    assert runner_violations(source, "kvsched.runner.model") == [
        "kvsched.bench.harness",
        "kvsched.cli_generate",
        "kvsched.cli_generate.run_generate",
        "kvsched.engine",
        "kvsched.engine.LLM",
        "kvsched.sim",
    ]
    fine = "from kvsched.scheduler import Scheduler\nfrom .config import ModelConfig\nfrom kvsched import Scheduler\n"
    assert runner_violations(fine, "kvsched.runner.model") == []
    # In a package's __init__, "." is the package itself.
    assert runner_violations("from ..engine import LLM", "kvsched.runner", is_package=True) == [
        "kvsched.engine",
        "kvsched.engine.LLM",
    ]


def test_nothing_under_runner_imports_the_engine_the_cli_or_the_benchmarks() -> None:
    files = sorted((PKG_DIR / "runner").rglob("*.py"))
    assert len(files) >= 5
    bad = {
        str(path.relative_to(PKG_DIR)): found
        for path in files
        if (found := runner_violations(path.read_text(), module_name(path), path.name == "__init__.py"))
    }
    assert bad == {}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_benchmark_modules_import_each_other_without_cycles() -> None:
    modules = {module_name(p): p for p in (PKG_DIR / "bench").glob("*.py") if p.name != "__init__.py"}
    graph = {
        name: {m for m in imported_modules(path.read_text(), name) if m in modules and m != name}
        for name, path in modules.items()
    }
    assert "kvsched.bench.harness" in graph
    assert find_cycle(graph) is None
