"""The Python examples in README.md and docs/*.md run as written.

Every fenced ``python`` block runs on its own in a fresh interpreter (so an example cannot lean on names another
one defined), from an empty directory. A block that cannot run here (it needs a model directory, vLLM or a
download) says so with an HTML comment on the line before its fence, which renders as nothing:
``<!-- not run: needs a local Hugging Face model directory -->``, and must give a reason."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import rust_available

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.*?) -->\s*\Z")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int
    code: str
    not_run: str | None  # the reason given on the line before the fence, if any

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples(path: Path) -> list[Example]:
    """The ``python`` blocks of one Markdown file, with the line of their opening fence."""
    text = path.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()]
        marker = NOT_RUN.search(before.rsplit("\n\n", 1)[-1])
        found.append(Example(path, before.count("\n") + 1, m.group(1), marker.group(1) if marker else None))
    return found


ALL = [e for p in DOCS for e in examples(p)]


def test_the_docs_have_examples_and_the_collector_reads_markers(tmp_path: Path) -> None:
    assert len([e for e in ALL if e.not_run is None]) >= 6
    md = tmp_path / "x.md"
    md.write_text("Intro\n\n```python\nprint(1)\n```\n\n<!-- not run: needs a GPU -->\n```python\nboom()\n```\n")
    got = examples(md)
    assert [(e.line, e.code, e.not_run) for e in got] == [(3, "print(1)\n", None), (8, "boom()\n", "needs a GPU")]


@pytest.mark.parametrize("example", ALL, ids=lambda e: e.name)
def test_example_runs(example: Example, tmp_path: Path) -> None:
    if example.not_run is not None:
        assert example.not_run.strip(), f"{example.name}: a block that is not run must say why"
        pytest.skip(f"not run: {example.not_run}")
    if not rust_available():
        pytest.skip("kvsched._core is not built")
    needs_torch = "kvsched.runner" in example.code or "LLM(" in example.code
    if needs_torch and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (the runner)")
    proc = subprocess.run(
        [sys.executable, "-c", example.code], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"{example.name} failed:\n{proc.stderr[-3000:]}"


BASH_FENCE = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.S | re.M)


def cli_commands(path: Path) -> list[tuple[str, list[str]]]:
    """The ``kvsched ...`` command lines of the shell blocks of one Markdown file (continuations joined, comments
    dropped), each with its line; commands with a ``...`` placeholder are left out."""
    text = path.read_text(encoding="utf-8")
    found = []
    for m in BASH_FENCE.finditer(text):
        line_no = text[: m.start()].count("\n") + 2  # the block's first line
        start, command = line_no, ""
        for line in m.group(1).splitlines():
            command += line.removesuffix("\\") + " "
            line_no += 1
            if line.endswith("\\"):
                continue  # continued on the next line
            words = shlex.split(command, comments=True)
            if words[:1] == ["kvsched"] and "..." not in words:
                found.append((f"{path.relative_to(ROOT)}:{start}", words[1:]))
            start, command = line_no, ""
    return found


COMMANDS = [c for p in DOCS for c in cli_commands(p)]


def test_the_docs_show_cli_commands() -> None:
    assert {argv[0] for _, argv in COMMANDS} >= {"bench", "simulate", "generate"}


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_cli_command_in_the_docs_parses(where: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Only parsed, not run: every flag exists and every value passes its argparse type.
    from kvsched.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvsched {shlex.join(argv)}` does not parse ({exc}): {capsys.readouterr().err}")


@pytest.mark.skipif(not rust_available(), reason="kvsched._core is not built")
def test_every_public_scheduler_member_is_in_the_api_table() -> None:
    from kvsched import Scheduler

    table = (ROOT / "docs" / "api.md").read_text(encoding="utf-8").split("## `Scheduler`", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)", table, re.M))
    public = {name for name in dir(Scheduler) if not name.startswith("_")}
    assert public - documented == set(), "members of Scheduler missing from docs/api.md's table"
    assert documented - public - {"Scheduler"} == set(), "rows of docs/api.md's table that Scheduler lacks"
