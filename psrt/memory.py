"""Process memory tuning for moving large tensors."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["tune_allocator", "advise_huge_pages"]

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


#: ``madvise`` advice (Linux): back the range with transparent huge pages, and (Linux 6.1+) do so now, in place.
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
#: An x86-64 (and arm64 with 4 KiB pages) transparent huge page.
HUGE_PAGE_BYTES = 2 << 20
_madvise: Any = None


def advise_huge_pages(array: Any) -> bool:
    """Ask Linux to back the huge-page-aligned part of ``array``'s buffer with transparent huge pages, now.

    An embedding table's rows are touched at random, a few per 4 KiB page, so with small pages nearly every row
    a batch touches is a TLB miss whose page walk misses the cache too; with 2 MiB pages the walks of a whole
    batch stay cached (a push of 8,192 rows of 256 float32 into a 1M-row AdaGrad table takes a third of the
    time). ``MADV_HUGEPAGE`` makes the pages faulted from now on huge (where the system's ``enabled`` setting is
    ``madvise`` or ``always``); ``MADV_COLLAPSE`` turns those already there into huge pages in place (no second
    copy of the array), which a kernel before 6.1 or a full memory declines: this is a hint, and values never
    change. Returns whether the advice was taken (False off Linux, for a buffer under two huge pages, or where
    the kernel refused ``MADV_HUGEPAGE``).

    Parameters
    ----------
    array : numpy.ndarray
        A C-contiguous array (its whole buffer is advised).
    """
    global _madvise
    nbytes = int(array.nbytes)
    if not sys.platform.startswith("linux") or nbytes < 2 * HUGE_PAGE_BYTES:
        return False
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            _madvise = False
            return False
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _madvise = fn
    if _madvise is False:
        return False
    addr = int(array.ctypes.data)
    start = (addr + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
    end = (addr + nbytes) & ~(HUGE_PAGE_BYTES - 1)
    if end <= start:
        return False
    if _madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return False
    _madvise(start, end - start, _MADV_COLLAPSE)  # (declined: the pages faulted from now on are huge still)
    return True
