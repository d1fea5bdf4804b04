"""The repository speaks to its users: no work-log history in the tracked text files.

Docs, scripts and code comments say what is measured, the results and how to reproduce them. The history of how
the code got there belongs in git and in CHANGELOG.md. This test greps every tracked text file (CHANGELOG.md and
this file excepted) for the marks such history leaves:

- a work period: "stop 23", "stops 23 and 24", "this stop";
- a work session: "this session", "the last two sessions", "earlier sessions" (a pytest session, a streaming-input
  session and code names such as ``CalibrationSession`` are not history);
- our own tracker: "issue 13", "(issue #11)", "#12". A number of an upstream project's tracker is a reference,
  not history, when the project is named right before it: "vLLM PR #40459", "PyO3 issue #1234";
- a commit hash as narrative: a backticked hash (`` `124aaed` ``) or one after "at", "since", "main", "->", ...;
- a timestamp of a measurement: "10:40 UTC", "(2026-12-01, ...)" in prose;
- a path on one machine: ``/work/...``, ``/root/...``, ``/home/<user>/...``, ``/tmp/<name>``;
- a "before ... now" narrative: a paragraph with a sentence opening "Before" and one opening "Now", a table with a
  "before" and an "after" column, "tried and dropped";
- the work log's own words: "this change", "this commit", "the lead", "the issue's goal".
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"CHANGELOG.md", "tests/test_repo_hygiene.py"}

# Projects whose tracker numbers may be cited ("vLLM PR #40459", "PyO3 issue 1234").
UPSTREAM = (
    r"vLLM|vllm|SGLang|sglang|PyO3|pyo3|maturin|NumPy|numpy|PyTorch|pytorch|torch|CPython|cpython|Python|Triton|"
    r"triton|transformers|hashbrown|mimalloc|polars|tokenizers|pydantic-core|pydantic|Rust|rust-lang|rustc|cargo|"
    r"LLVM|llvm|xxhash|criterion|hypothesis|pytest|tqdm|glibc|Linux|valgrind|FlashInfer|flash-attention"
)
_UPSTREAM_BEFORE = re.compile(rf"(?:{UPSTREAM})(?:'s)?(?:\s+(?:PR|RFC|issue|pull request|pull|bug))?\s*$")

# A hexadecimal word of commit-hash length (at least one digit and one letter, checked below).
_HASH = r"[0-9a-f]{7,12}"
_DETERMINERS = r"this|that|the|last|earlier|previous|next|same|each|every|one|a|an|our|whole|later"
# Where a sentence starts: after its end mark, or at the start of a line (past a comment or list marker).
_SENTENCE = r"(?:(?<=[.!?:])(?:[ \t]+|[ \t]*\n[ \t]*(?:(?:#|//[/!]?)[ \t]*)?)|^[ \t]*(?:(?:#|//[/!]?|\*|-)[ \t]*)?)"
_SESSION_NOT_HISTORY = r"pytest|test|streaming-input|streaming|input|interactive|HTTP|http|SSH|ssh|tmux|Ray|ray"

RULES: dict[str, re.Pattern[str]] = {
    "work period": re.compile(
        r"\b[Ss]tops?[ -]\d+\b"
        r"|\b(?:[Tt]his|[Tt]hat|[Pp]revious|[Ll]ast|[Nn]ext|[Ee]arlier) stop\b"
        r"(?!\s+(?:check|condition|token|string|id|reason|sequence|list|set|rule)s?\b)(?!-)"
    ),
    "work session": re.compile(
        rf"\b(?:{_DETERMINERS})\s+(?:(?!(?:{_SESSION_NOT_HISTORY})\b)[\w-]+\s+)?sessions?\b(?!\.\w|\(|_|\s*=)",
        re.I,
    ),
    "issue number": re.compile(r"\bissues?\s+#?\d+\b|(?<![\w&#/'\"])#\d+\b(?![\w-])", re.I),
    "commit hash": re.compile(
        rf"`{_HASH}`"
        rf"|(?:\b(?:at|since|before|after|from|main|build|commit|against|of)\s+|(?:->|→)\s*)(?<![\w/.-]){_HASH}(?![\w/.-])"
    ),
    "timestamp": re.compile(r"\b\d{1,2}:\d\d(?:-\d{1,2}:\d\d)? UTC\b|\(20\d\d-\d\d-\d\d\b"),
    "machine path": re.compile(r"(?<![\w.~-])/(?:work|root)/|(?<![\w.~-])/home/\w+/|(?<![\w.~-])/tmp/\w"),
    "before/now narrative": re.compile(
        # A sentence opening with "Before" and, within the paragraph, one opening with "Now"; a table comparing
        # a "before" column with an "after" or "now" one; an attempt's fate.
        rf"{_SENTENCE}Before\b(?:(?!\n[ \t]*\n).){{0,400}}?{_SENTENCE}Now\b"
        r"|^\|[^\n]*\|[ \t]*before\b[^\n]*\|[ \t]*(?:after|now)\b"
        r"|\b(?:tried|measured) and (?:dropped|not kept)\b",
        re.M | re.S,
    ),
    "work log": re.compile(
        r"\b[Tt]his (?:change|commit)\b|\bthe lead(?:'s)?\b(?!-)|\b[Tt]he issue(?:'s| asks| quoted)\b"
    ),
}


def _allowed(rule: str, text: str, m: re.Match[str]) -> bool:
    """Matches that look like history but are not."""
    found = m.group(0)
    if rule == "issue number":
        return _UPSTREAM_BEFORE.search(text[: m.start()]) is not None
    if rule == "commit hash":
        word = re.search(_HASH, found.strip("`"))
        assert word is not None
        digits_and_letters = re.search(r"\d", word.group(0)) and re.search(r"[a-f]", word.group(0))
        return not digits_and_letters
    return False


def history_marks(text: str) -> Iterator[tuple[int, str, str]]:
    """``(line, rule, matched text)`` for every history mark in ``text``."""
    for rule, pattern in RULES.items():
        for m in pattern.finditer(text):
            if not _allowed(rule, text, m):
                found = " ".join(m.group(0).split())
                yield text.count("\n", 0, m.start()) + 1, rule, found if len(found) <= 80 else found[:77] + "..."


def tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    names = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or name in SKIP or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        names.append(name)
    return names


def test_tracked_files_carry_no_work_log_history() -> None:
    files = tracked_text_files()
    if not files:
        pytest.skip("not a git checkout")
    hits = [
        f"{name}:{line}: {rule}: {found!r}"
        for name in files
        for line, rule, found in history_marks((ROOT / name).read_text(encoding="utf-8"))
    ]
    assert hits == [], "history in tracked files (it belongs in git and CHANGELOG.md):\n" + "\n".join(hits)


# Each rule catches what it is for ...
FLAGGED = [
    ("Stop 26 (AMD EPYC VM): where the step's time goes", "work period"),
    ("within the range stops 23 and 24 read", "work period"),
    ("the stop-24 build", "work period"),
    ("Also tried and dropped in this stop:", "work period"),
    ("in the runs of the last two sessions", "work session"),
    ("stopped when the session ended", "work session"),
    ("Earlier sessions measured on a 2-core Intel Xeon VM", "work session"),
    ("for a session with a lent CUDA machine", "work session"),
    ("(issue 11: step cost unchanged for recompute)", "issue number"),
    ("Not reached (issue 13's targets)", "issue number"),
    ("see #12 for the plan", "issue number"),
    ("against `7a6c2dc` this one takes 0.823 of the step", "commit hash"),
    ("main at 691f397 (nothing else running)", "commit hash"),
    ("main e7310ff → this change", "commit hash"),
    ("Before `f0432a2` the bindings gave each output its own vector", "commit hash"),
    ("main at `691f397` (2026-12-01, 10:40 UTC), nothing else running", "timestamp"),
    ("(2026-12-01, quiet VM, current build)", "timestamp"),
    ("four runs between 21:36 and 22:09 UTC", "timestamp"),
    ("build the extension first with bash /work/kvdev.sh", "machine path"),
    ("python3 tests/vllm_suite/run.py --python /tmp/vllm-venv/bin/python", "machine path"),
    ("--json /tmp/swapbench/g.json", "machine path"),
    ("cd /root/kvsched", "machine path"),
    ("Before, the ~430-byte output was copied five times. Now it is built in place.", "before/now narrative"),
    (
        "//! reused. Before, each output built its own vector (~5 ns an id: 1.3 µs at 256).\n//! Now an output keeps",
        "before/now narrative",
    ),
    ("| form | before (general conversion) min / median | now min / median |", "before/now narrative"),
    ("| call | before | after |", "before/now narrative"),
    ("Two attempts were measured and dropped:", "before/now narrative"),
    ("main e7310ff → this change: a 23,293 → 22,309", "work log"),
    ("xfail: str | None = None  # a known bug, reported to the lead", "work log"),
    ("/// untimed. The issue's goal is boundary steps costing little more than plain ones.", "work log"),
]

# ... and lets legitimate text pass.
CLEAN = [
    "the stop check takes the token just appended",
    "this stop token ends the request; the stop strings are the engine's",
    "a request stops at max_tokens, EOS or a stop id",
    "A tiny random-weight Llama saved once per test session (engine tests)",
    '@pytest.fixture(scope="session")',
    "writes them as JSON at the end of the pytest session",
    "streaming-input sessions are not supported by kvsched.vllm",
    "session = CalibrationSession(llm, quick=quick)",
    "while session.run_next():",
    "vLLM PR #40459 changed the order of the checks",
    "see vLLM's issue #12345 for the upstream bug",
    "PyO3 issue 1234 describes the same panic",
    "#[derive(Debug, Clone)]",
    "plt.plot(x, y, color='#333333')",
    "SHA-256 digest 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "the constant 0x9e3779b97f4a7c15 mixes the bits",
    "at deadbeef the id is rejected",
    "at 1234567 tokens the pool is full",
    "Time it with `python -m timeit`; results at 12:00 local time vary",
    "the same path under $TMPDIR or tempfile.gettempdir()",
    "relative to the repository root: ./dist, build/, python/kvsched",
    "a victim's blocks are freed before it is requeued",
    "the stats vLLM reads before a stop frees them: read them now, for the requests that have not emitted yet",
    'print(f"FAIL: passed before ({status}), not now")',
    "Before the first step, add the requests.\n\nNow and then a request is aborted.",
    "| step | schedule | update |",
    "usual case: none of this changes anything",
    "which the lead-in gives the calibration's prefills too",
]


@pytest.mark.parametrize(("line", "rule"), FLAGGED, ids=[r + ": " + t[:40] for t, r in FLAGGED])
def test_each_history_mark_is_caught(line: str, rule: str) -> None:
    assert rule in {r for _, r, _ in history_marks(line)}


@pytest.mark.parametrize("line", CLEAN, ids=lambda t: t[:40])
def test_legitimate_text_passes(line: str) -> None:
    assert list(history_marks(line)) == []


def test_a_reference_to_an_upstream_tracker_needs_the_project_named() -> None:
    assert [r for _, r, _ in history_marks("see PR #40459")] == ["issue number"]
    assert list(history_marks("see vLLM PR #40459")) == []


def test_before_and_now_make_a_narrative_only_as_sentence_openings() -> None:
    assert [r for _, r, _ in history_marks("Before, it copied the output. Now it builds it in place.")] == [
        "before/now narrative"
    ]
    assert list(history_marks("Read them before the step frees them, and use them now.")) == []
