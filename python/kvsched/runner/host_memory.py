"""Keep freed host memory in the process (glibc malloc), for steady step times of a model on the CPU.

By default glibc's malloc returns freed memory to the operating system: blocks of 128 KiB and more (the
threshold grows with use, up to 32 MiB) are mapped and unmapped one by one, and the top of the heap is trimmed
once more than 128 KiB of it is free. A CPU engine alternates long runs of small decode steps with prefills whose
activations and attention scores take megabytes, so each prefill after a decode run faults its memory in
again, and runs slower than the same step right after another prefill, by an amount that varies from run to
run. :func:`keep_freed_memory` raises both thresholds so that the memory stays
mapped. It changes the whole process's allocator, so kvsched calls it only where steady timing is the point
(``kvsched simulate --calibrate`` and ``--validate`` on the CPU); call it yourself for a CPU engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(trim_threshold: int = 1 << 30, mmap_threshold: int = 32 << 20) -> bool:
    """Set glibc's ``M_TRIM_THRESHOLD`` (free heap top kept before trimming) and ``M_MMAP_THRESHOLD`` (blocks
    this large or larger are mapped on their own; 32 MiB is glibc's maximum on 64-bit). Returns True when both
    were applied, False where the C library is not glibc (nothing is changed then)."""
    for name, value in (("trim_threshold", trim_threshold), ("mmap_threshold", mmap_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise ValueError(f"{name} must be an int in [0, 2**31), got {value!r}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1)
