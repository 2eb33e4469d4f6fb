"""Large CPU tensors without page faults: glibc's malloc asked to keep freed memory for the next allocation.

glibc serves an allocation above its mmap threshold (which grows to at most 32 MB) with fresh pages from the kernel
and hands them back on free. A long prompt's prefill allocates such blocks in every layer (an 8,120-token prefill of
SmolLM2-135M: 8,120 × 1,536 floats, 50 MB, for each MLP activation), and the kernel zero-fills each new page on first
touch: about 2 million minor page faults and 2–3 s of a 30 s prefill on 2 cores (docs/long_context.md, "Page faults
in a long prefill"). With mmap off (M_MMAP_MAX = 0) and a high trim threshold, every block comes from the heap and a
freed one is reused as it is.

`keep_freed_memory()` sets both for the rest of the process, so the process keeps the memory of its largest forward
(its resident size stays at its peak). The `dspark-hf` commands call it at start: that process is ours. A library
does not change its user's allocator, so `generate()` never calls it; users who want the same in their own process
call it themselves, or start Python with
`GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647` (or preload jemalloc or tcmalloc).
`DSPARK_SYSTEM_MALLOC=1` keeps the C library's defaults in the commands too.
"""

import ctypes
import os
import sys

from transformers.utils import logging


logger = logging.get_logger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # the largest an int holds: freed memory at the heap's top is kept up to 2 GiB
_applied = False


def _glibc():
    """The process's C library where it is glibc (it has `gnu_get_libc_version` and `mallopt`), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version, libc.mallopt  # noqa: B018 (musl and others lack one of them)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve large blocks from the heap and keep freed memory, for the rest of the process
    (see the module docstring). True where it took effect (or already had), False where the C library is not glibc
    or `DSPARK_SYSTEM_MALLOC=1`: nothing changed then."""
    global _applied
    if _applied:
        return True
    if os.environ.get("DSPARK_SYSTEM_MALLOC", "").strip() not in ("", "0"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    _applied = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if _applied:
        logger.info("glibc malloc: large blocks from the heap, freed memory kept (kernels.allocator).")
    return _applied


__all__ = ["keep_freed_memory"]
