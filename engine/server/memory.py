"""Process memory figures for /stats and /metrics: resident set size, and glibc malloc's own
accounting (bytes handed out and still in use, bytes freed but kept in its arenas).

RSS alone cannot tell a leak from fragmentation: a leak grows `malloc_in_use_bytes`, while
memory freed into many threads' arenas and not returned to the kernel grows
`malloc_free_bytes` (and RSS) with the bytes in use flat. `trim()` hands free arena pages
back (glibc's malloc_trim). Off glibc the malloc figures are absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or a glibc older than 2.33
        return None


_LIBC = _libc()
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of this process, or of process `pid` (OSError if it is gone)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def memory_stats() -> dict[str, int]:
    """rss_bytes, and with glibc malloc_in_use_bytes (small blocks in use + mmapped blocks)
    and malloc_free_bytes (free bytes kept in the arenas)."""
    out = {"rss_bytes": rss_bytes()}
    if _LIBC is not None:
        mi = _LIBC.mallinfo2()
        out["malloc_in_use_bytes"] = mi.uordblks + mi.hblkhd
        out["malloc_free_bytes"] = mi.fordblks
    return out


def trim() -> bool:
    """Return free arena memory to the kernel; True if glibc released any."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False
