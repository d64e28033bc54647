"""Large CPU tensors on transparent huge pages (2 MiB) where the kernel allows it.

Why: a decode step reads the K/V of every sequence in the batch, in blocks scattered over a
cache of gigabytes, and every weight; with 4 KiB pages nearly every block read also misses the
TLB (the decode attention kernel ran faster on huge pages: docs/journal/benchmarks-history.md, "A C
prefill attention kernel, huge pages, and where the throughput run's time goes"). Linux's
THP in "madvise" mode (Debian's default) backs only regions that ask, so `empty` asks with
madvise(MADV_HUGEPAGE) before the tensor is first touched. Where THP is off, or madvise is not
there (not Linux), the tensor is the same, on small pages: nothing else changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages inside `t`'s storage; True if asked and
    accepted (pages already touched stay small until the kernel collapses them)."""
    if _madvise is None or t.device.type != "cpu":
        return False
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = end & ~(HUGE_PAGE - 1)
    return hi > lo and _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, advised onto huge pages before anything is written to it."""
    t = torch.empty(shape, dtype=dtype)
    advise(t)
    return t
