"""Shared pieces of the ``kvsched`` command line: the user-error type, argument parsers that name their flag,
and checks that an output path can be written before a run starts (so a bad ``--out`` fails at once, not after
minutes of work). Nothing here imports numpy."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = [
    "OneLineArgumentParser",
    "UsageError",
    "check_output_dir",
    "check_output_file",
    "int_at_least",
    "one_line",
    "parse_csv_numbers",
    "print_error",
]


class UsageError(ValueError):
    """A command-line argument is wrong; the CLI prints the message on one line and exits with status 2."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``kvsched bench: argument --max-steps: ...``) that points
    to ``--help``, instead of the whole usage text followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def one_line(text: str) -> str:
    """``text`` with its lines joined by "; " (an error message printed on one line)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse calls the type in its messages
    return parse


def parse_csv_numbers(text: str, flag: str, *, integer: bool = False, minimum: float = 0.0,
                      inclusive: bool = False) -> list[float] | list[int]:  # fmt: skip
    """The comma-separated numbers of ``flag``'s value ``text``, each ``> minimum`` (``>= minimum`` with
    ``inclusive``) and finite; :class:`UsageError` naming ``flag`` and the bad item otherwise."""
    kind = "an integer" if integer else "a number"
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"
    out: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value: float = int(part) if integer else float(part)
        except ValueError:
            raise UsageError(f"{flag}: {part!r} is not {kind}") from None
        if not (math.isfinite(value) and (value >= minimum if inclusive else value > minimum)):
            raise UsageError(f"{flag}: each value must be {bound}, got {part}")
        out.append(value)
    if not out:
        raise UsageError(f"{flag} is empty")
    if integer:
        return [int(v) for v in out]
    return out


def check_output_dir(path: Path, flag: str) -> None:
    """Create the directory ``path`` (and its parents) and check that a file can be written in it; raise
    :class:`UsageError` naming ``flag`` otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{flag} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create the directory ({exc.strerror or exc})") from None
    probe = path / f".kvsched-write-test-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in the directory ({exc.strerror or exc})") from None


def check_output_file(path: Path, flag: str) -> None:
    """Check that the file ``path`` can be written (creating its parent directories); a file that did not exist
    is not left behind. Raise :class:`UsageError` naming ``flag`` otherwise."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, not a file")
    try:
        check_output_dir(path.parent, "its directory")
    except UsageError as exc:
        raise UsageError(f"{flag} {path}: {exc}") from None
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write the file ({exc.strerror or exc})") from None
    if not existed:
        path.unlink(missing_ok=True)


def print_error(command: str, message: str) -> int:
    """Print ``kvsched <command>: <message>`` on one line on stderr; return the exit status 2."""
    print(f"kvsched {command}: {one_line(message)}", file=sys.stderr)
    return 2
