"""Process memory tuning for moving large tensors."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["tune_allocator"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_allocator() -> bool:
    """Keep freed message buffers in this process's heap (glibc only); returns whether it applied.

    ZeroMQ allocates and frees a multi-megabyte buffer for every large message it receives. By default glibc
    serves such sizes with fresh ``mmap`` pages and hands them back on free, so every message pays for page
    faults and zeroing. Raising the mmap and trim thresholds lets freed buffers be reused. ``psrt server``
    calls it; a worker moving large tensors can call it at start-up too. Never called at import: it changes
    the whole process.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 256 << 20) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, 512 << 20) == 1 and ok
    ok = mallopt(_M_TOP_PAD, 64 << 20) == 1 and ok
    return ok
