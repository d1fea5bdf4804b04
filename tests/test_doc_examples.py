"""The examples in README.md and docs/*.md run as written.

Every fenced ``python`` block runs on its own in a fresh interpreter (so an example cannot lean on names another
one defined), from an empty directory. Every ``kvsched ...`` line of a shell block (``bash``, ``sh``, ``console``)
parses, and runs: the commands of one block in order, in one empty directory (so one may read what an earlier one
wrote; a ``python -m kvsched...`` line of the block, such as the one that writes a tiny model, runs too, as
written), at a reduced size where the documented one is long (``REDUCTIONS`` below), and must exit with status 0
without a traceback.

A block that cannot run here (it needs a model directory, a GPU or the network) says so with an HTML comment on
the line before its fence, which renders as nothing: ``<!-- not run: needs a local Hugging Face model directory
-->``, and must give a reason. Optional Python packages are found out instead: a block or command that needs
torch (the runner, ``kvsched generate``, ``--calibrate``, ``--validate``) or vLLM (``--impl vllm...``) is skipped
where they are not installed, and runs where they are."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
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


SHELL_FENCE = re.compile(r"^( *)```(?:bash|sh|console)\n(.*?)^\1```", re.S | re.M)


@dataclass(frozen=True)
class ShellBlock:
    path: Path
    line: int  # the line of its opening fence
    commands: tuple[tuple[int, tuple[str, ...]], ...]  # (line, argv after "kvsched") of each kvsched command
    not_run: str | None
    # (line, module, argv after it) of each `python -m kvsched...` line, with the index of the kvsched command it
    # runs before: set-up steps of the block (a tiny model directory, say).
    modules: tuple[tuple[int, int, str, tuple[str, ...]], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def shell_blocks(path: Path) -> list[ShellBlock]:
    """The shell blocks of one Markdown file that hold ``kvsched ...`` commands (continuation lines joined,
    comments dropped; a command with a ``...`` placeholder is left out), with the marker before each fence."""
    text = path.read_text(encoding="utf-8")
    found = []
    for m in SHELL_FENCE.finditer(text):
        before = text[: m.start()]
        marker = NOT_RUN.search(before.rsplit("\n\n", 1)[-1])
        line_no = before.count("\n") + 2  # the block's first line
        indent = len(m.group(1))
        commands = []
        modules = []
        start, command = line_no, ""
        for line in m.group(2).splitlines():
            line = line[indent:] if line[:indent].isspace() else line.lstrip()
            command += line.removesuffix("\\") + " "
            line_no += 1
            if line.endswith("\\"):
                continue  # continued on the next line
            words = shlex.split(command.removeprefix("$ "), comments=True)
            if words[:1] == ["kvsched"] and "..." not in words:
                commands.append((start, tuple(words[1:])))
            elif words[:2] in (["python", "-m"], ["python3", "-m"]) and words[2:3] and words[2].startswith("kvsched."):
                modules.append((start, len(commands), words[2], tuple(words[3:])))
            start, command = line_no, ""
        if commands:
            marked = marker.group(1) if marker else None
            found.append(ShellBlock(path, before.count("\n") + 1, tuple(commands), marked, tuple(modules)))
    return found


def cli_commands(path: Path) -> list[tuple[str, list[str]]]:
    """The ``kvsched ...`` command lines of the shell blocks of one Markdown file, each with its ``file:line``."""
    return [(f"{b.path.relative_to(ROOT)}:{line}", list(argv)) for b in shell_blocks(path) for line, argv in b.commands]


BLOCKS = [b for p in DOCS for b in shell_blocks(p)]
COMMANDS = [c for p in DOCS for c in cli_commands(p)]


def test_the_docs_show_cli_commands() -> None:
    assert {argv[0] for _, argv in COMMANDS} >= {"bench", "simulate", "generate"}


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_cli_command_in_the_docs_parses(where: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Every command, the ones that are not run included: every flag exists and every value passes its type.
    from kvsched.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvsched {shlex.join(argv)}` does not parse ({exc}): {capsys.readouterr().err}")


# ---- Running the documented commands at test size ------------------------------------------------------------
# How a documented command is cut down: (subcommand, flag) -> what its value becomes. Every other flag runs as
# written. ADDED flags are appended when the command does not give them itself.


def _at_most(limit: float) -> Callable[[str], str]:
    return lambda value: f"{min(float(value), limit):g}"


def _first_and_last(value: str) -> str:
    items = [v for v in value.split(",") if v.strip()]
    return ",".join(items if len(items) <= 2 else [items[0], items[-1]])


REDUCTIONS: dict[tuple[str, str], Callable[[str], str]] = {
    ("simulate", "--duration"): _at_most(10),  # seconds of arrivals
    ("simulate", "--num-requests"): _at_most(100),
    ("simulate", "--rates"): _first_and_last,  # the sweep keeps its lowest and highest rate
    ("bench", "--scale"): _at_most(0.05),  # the --quick scale
    ("bench", "--repeat"): _at_most(1),
    ("bench", "--max-steps"): _at_most(100),
    ("bench", "--scaling-steps"): _at_most(50),
    ("bench", "--scaling-sizes"): lambda v: ",".join(x for x in v.split(",") if int(x) <= 256) or "16",
}
ADDED: dict[str, tuple[str, ...]] = {
    "simulate": ("--duration", "10"),
    "bench": ("--quick", "--max-steps", "100"),
}
# Output paths go to the test's directory (relative ones already do: the commands run there).
OUTPUT_FLAGS = {"--out", "--json", "--markdown", "--plot", "--dump-trace", "--calibrate-out"}


def reduced(argv: Sequence[str], tmp: Path) -> list[str]:
    """``argv`` at test size (see ``REDUCTIONS`` and ``ADDED``), absolute output paths moved under ``tmp``."""
    words: list[str] = []
    for word in argv:  # --flag=value -> --flag value
        words.extend(word.split("=", 1) if word.startswith("--") and "=" in word else [word])
    sub = words[0]
    out = [sub]
    i = 1
    while i < len(words):
        word = words[i]
        out.append(word)
        has_value = i + 1 < len(words) and not words[i + 1].startswith("-")
        if has_value and (sub, word) in REDUCTIONS:
            out.append(REDUCTIONS[(sub, word)](words[i + 1]))
            i += 1
        elif has_value and word in OUTPUT_FLAGS and Path(words[i + 1]).is_absolute():
            out.append(str(tmp / Path(words[i + 1]).name))
            i += 1
        i += 1
    added = ADDED.get(sub, ())
    j = 0
    while j < len(added):
        flag = added[j]
        value = added[j + 1] if j + 1 < len(added) and not added[j + 1].startswith("-") else None
        if flag not in out:
            out += [flag] if value is None else [flag, value]
        j += 1 if value is None else 2
    return out


def _option(argv: Sequence[str], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def missing_package(argv: Sequence[str]) -> str | None:
    """The optional package ``kvsched <argv>`` needs and this environment lacks, or None."""
    if "vllm" in (_option(argv, "--impl") or "") and importlib.util.find_spec("vllm") is None:
        return "needs vLLM"
    uses_torch = argv[0] == "generate" or "--calibrate" in argv or "--validate" in argv
    if uses_torch and importlib.util.find_spec("torch") is None:
        return "needs torch"
    return None


def test_the_shell_block_collector_reads_markers_indents_and_continuations(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text(
        "```bash\nmaturin develop\nkvsched bench --quick   # fast\nkvsched simulate --step-model x.json ...\n```\n\n"
        "- item\n\n  <!-- not run: needs a GPU -->\n  ```bash\n  kvsched simulate --rate 4 \\\n"
        "      --out o\n  ```\n\n```sh\necho no kvsched here\n```\n\n"
        "```bash\npython -m kvsched.runner.testing tiny   # set-up\nkvsched generate --model tiny\n```\n"
    )
    got = shell_blocks(md)
    assert [(b.line, b.commands, b.not_run, b.modules) for b in got] == [
        (1, ((3, ("bench", "--quick")),), None, ()),
        (10, ((11, ("simulate", "--rate", "4", "--out", "o")),), "needs a GPU", ()),
        (19, ((21, ("generate", "--model", "tiny")),), None, ((20, 0, "kvsched.runner.testing", ("tiny",)),)),
    ]


def test_reduced_commands_are_test_sized(tmp_path: Path) -> None:
    argv = ["simulate", "--rates", "4,8,12,16,20", "--duration", "600", "--out", "/abs/sim", "--plot"]
    assert reduced(argv, tmp_path) == [
        "simulate", "--rates", "4,20", "--duration", "10", "--out", str(tmp_path / "sim"), "--plot",
    ]  # fmt: skip
    assert reduced(["simulate", "--num-requests=500"], tmp_path) == [
        "simulate", "--num-requests", "100", "--duration", "10",
    ]  # fmt: skip
    assert reduced(["bench", "--repeat", "5", "--scaling-sizes", "64,512"], tmp_path) == [
        "bench", "--repeat", "1", "--scaling-sizes", "64", "--quick", "--max-steps", "100",
    ]  # fmt: skip
    assert reduced(["bench", "--quick", "--max-steps", "20"], tmp_path) == ["bench", "--quick", "--max-steps", "20"]
    assert missing_package(["bench", "--impl", "rust"]) is None


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_cli_commands_in_the_docs_run(block: ShellBlock, tmp_path: Path) -> None:
    if block.not_run is not None:
        assert block.not_run.strip(), f"{block.name}: a block that is not run must say why"
        pytest.skip(f"not run: {block.not_run}")
    if not rust_available():
        pytest.skip("kvsched._core is not built")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    ran, skipped = 0, []
    setup_missing: str | None = None  # a set-up line that could not run here: the commands after it are skipped
    for index, (line, argv) in enumerate(block.commands):
        for m_line, before, module, m_argv in block.modules:
            if before != index or setup_missing is not None:
                continue
            m_where = f"{block.path.relative_to(ROOT)}:{m_line}"
            if module.startswith("kvsched.runner") and not all(
                map(importlib.util.find_spec, ("torch", "transformers"))
            ):
                setup_missing = f"{m_where} needs torch and transformers"
                continue
            proc = subprocess.run(
                [sys.executable, "-m", module, *m_argv],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
                f"{m_where}: `python -m {module} {shlex.join(m_argv)}` exited with {proc.returncode}:\n"
                f"{proc.stderr[-3000:]}"
            )
        if setup_missing is not None:
            skipped.append(setup_missing)
            continue
        where = f"{block.path.relative_to(ROOT)}:{line}"
        shown = f"`kvsched {shlex.join(argv)}`"
        reason = missing_package(argv)
        if reason is not None:
            skipped.append(f"{where} {reason}")
            continue
        model = _option(argv, "--model")
        hint = ""
        if model is not None and not (tmp_path / model).is_dir():
            hint = (
                f"\n(the model directory {model} does not exist here: if the command needs one, mark its block "
                "<!-- not run: needs a local Hugging Face model directory --> or make it in an earlier command)"
            )
        cmd = reduced(argv, tmp_path)
        proc = subprocess.run(
            [sys.executable, "-m", "kvsched.cli", *cmd],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
            f"{where}: {shown}, run as `kvsched {shlex.join(cmd)}`, exited with {proc.returncode}:\n"
            f"{proc.stderr[-3000:]}{hint}"
        )
        ran += 1
    if not ran:
        pytest.skip("; ".join(skipped))


@pytest.mark.skipif(not rust_available(), reason="kvsched._core is not built")
def test_every_public_scheduler_member_is_in_the_api_table() -> None:
    from kvsched import Scheduler

    table = (ROOT / "docs" / "api.md").read_text(encoding="utf-8").split("## `Scheduler`", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)", table, re.M))
    public = {name for name in dir(Scheduler) if not name.startswith("_")}
    assert public - documented == set(), "members of Scheduler missing from docs/api.md's table"
    assert documented - public - {"Scheduler"} == set(), "rows of docs/api.md's table that Scheduler lacks"
