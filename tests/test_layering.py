"""The package's layering, checked from the source (AST), not by importing anything.

Layers, lowest first: the scheduler, the runner (``kvsched.runner``), the engine (``kvsched.engine``), and on top
the command line, the benchmarks and the simulator. A module may import what is below it, never what is above:
nothing under ``python/kvsched/runner/`` imports the engine, the CLI, the benchmarks or the simulator, in any
form (absolute, relative, lazily inside a function, under ``TYPE_CHECKING``, or through a lazy name of
``kvsched/__init__``).

And no two modules of the package import each other, directly or through others. Every import counts, wherever it
stands: at module level, under ``TYPE_CHECKING``, or inside a function. A lazy import changes when the import
runs, not that the two modules depend on each other, so it does not break a cycle; the package's lazy imports are
there for optional dependencies (triton, vLLM) or to keep ``import kvsched`` from importing torch. A package counts
as its ``__init__``; importing a submodule is not counted as importing its parent package (Python runs the
parent's ``__init__`` first, but that only closes a cycle if the ``__init__`` imports back, which is counted). Names
a package loads lazily through its ``_LAZY`` table count as imports of the module that defines them. Imports done
with ``importlib`` at run time (the lazy tables' loader) are not seen.
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


# ---- no import cycles in the package --------------------------------------------------------------------------


def package_modules(root: Path, package: str = "kvsched") -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name: each ``.py`` file (a package is its
    ``__init__.py``) and each ``.pyi`` stub with no ``.py`` beside it (a native module such as ``_core``)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py*")):
        if path.suffix == ".py" or (path.suffix == ".pyi" and not path.with_suffix(".py").exists()):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def lazy_tables(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Each package's ``_LAZY`` table (public name -> submodule that defines it), read from its ``__init__``."""
    tables: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
                tables[name] = ast.literal_eval(value)
    return tables


def module_imports(
    source: str, module: str, is_package: bool, modules: dict[str, Path], lazy: dict[str, dict[str, str]]
) -> set[str]:
    """The modules of the package that ``source`` (the text of ``module``) imports, anywhere in the file.

    ``import a.b.c`` is the deepest of ``a.b.c``, ``a.b``, ``a`` that is a module of the package; ``from X import
    n`` is ``X.n`` when that is a module (a submodule), else ``X`` (a name defined in ``X``), plus the submodule
    that ``X``'s ``_LAZY`` table names for ``n``."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(m for alias in node.names if (m := deepest(alias.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - (node.level - 1)], *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                    continue
                if (m := deepest(base)) is not None:
                    found.add(m)
                if alias.name in lazy.get(base, {}):
                    found.add(f"{base}.{lazy[base][alias.name]}")
    found.discard(module)
    return found


def import_graph(root: Path, package: str = "kvsched") -> dict[str, set[str]]:
    modules = package_modules(root, package)
    lazy = lazy_tables(modules)
    return {
        name: module_imports(path.read_text(), name, path.name == "__init__.py", modules, lazy)
        for name, path in modules.items()
    }


def test_the_import_graph_sees_every_form_of_an_import(tmp_path: Path) -> None:
    files = {
        "__init__.py": "import typing\nif typing.TYPE_CHECKING:\n    from .a import A\n_LAZY = {'A': 'a'}\n",
        "_native.pyi": "def f() -> int: ...\n",
        "a.py": "import pkg.sub.deep as d\nfrom . import _native\n",
        "b.py": "def f():\n    from pkg import A\n",
        "sub/__init__.py": "from .. import b\n",
        "sub/deep.py": "from pkg.sub import thing\nimport os\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg._native": set(),
        "pkg.a": {"pkg.sub.deep", "pkg._native"},
        "pkg.b": {"pkg", "pkg.a"},  # a function-level import, of a lazy name
        "pkg.sub": {"pkg.b"},
        "pkg.sub.deep": {"pkg.sub"},
    }
    assert find_cycle(graph) == ["pkg", "pkg.a", "pkg.sub.deep", "pkg.sub", "pkg.b", "pkg"]
    # Without the function-level import there is none.
    (tmp_path / "b.py").write_text("def f():\n    pass\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph(PKG_DIR)
    # The graph is the real one: the stubbed native module, subpackages and their edges are in it.
    assert "kvsched._core" in graph["kvsched.scheduler"]
    assert "kvsched.runner.attention" in graph["kvsched.runner.triton_attention"]
    assert "kvsched.vllm._connector" in graph["kvsched.vllm.scheduler"]
    assert find_cycle(graph) is None
