"""``kvsched.runner.keep_freed_memory``: freed memory stays mapped in the process (glibc), so a CPU engine does not
fault its prefill activations in again after a run of decode steps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from kvsched.runner import keep_freed_memory

CHILD = textwrap.dedent(
    """
    import os, sys
    from kvsched.runner import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    before = rss()
    buf = bytearray(16 << 20)
    for i in range(0, len(buf), page):
        buf[i] = 1
    del buf
    print((rss() - before) >> 20)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_mapped_only_when_asked() -> None:
    def kept_mib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    if not keep_freed_memory():
        pytest.skip("not glibc")
    assert kept_mib("default") < 4  # 16 MiB mapped on its own and unmapped when freed
    assert kept_mib("keep") >= 15  # taken from the heap and kept there


def test_bad_thresholds_are_rejected() -> None:
    for bad in (-1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="must be an int"):
            keep_freed_memory(trim_threshold=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mmap_threshold"):
        keep_freed_memory(mmap_threshold=-5)
