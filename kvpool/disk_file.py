"""The disk tier's files: the directory's identity, the preallocated slot file, headers.

DIR/kvpool-disk.json holds the format version, the node id, the layout fingerprint and the
slot size; a directory made for another node or layout is refused (`DiskLayoutError`), never
reused. DIR/slots.bin holds the slots (`kvpool.disk`): slot i at i * slot_bytes, each a
`kvpool.layout.SlotHeader` and its payload, rounded up to DISK_ALIGN for O_DIRECT.

Threading: `AlignedBuffers` is thread-safe; the functions share nothing.
"""
from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvpool.layout import HEADER_BYTES, SlotHeader

FORMAT_VERSION = 1
DISK_ALIGN = 4096          # O_DIRECT: offsets, lengths and buffers aligned to this
META_FILE = "kvpool-disk.json"
DATA_FILE = "slots.bin"


class DiskError(Exception):
    """The disk tier cannot start (the pool then runs with DRAM only)."""


class DiskLayoutError(DiskError):
    """The directory holds another node's or another layout's blocks."""


def disk_slot_bytes(block_bytes: int) -> int:
    """Bytes of one disk slot: header and payload, rounded up to DISK_ALIGN."""
    return (HEADER_BYTES + block_bytes + DISK_ALIGN - 1) // DISK_ALIGN * DISK_ALIGN


@dataclass(frozen=True, slots=True)
class DiskIdentity:
    """What a disk directory must have been made for to be reused."""
    node_id: str
    layout_fingerprint: str
    block_bytes: int

    def meta(self) -> dict[str, object]:
        return {"format": FORMAT_VERSION, "node_id": self.node_id, "layout_fingerprint": self.layout_fingerprint,
                "block_bytes": self.block_bytes, "slot_bytes": disk_slot_bytes(self.block_bytes)}


class AlignedBuffers:
    """Page-aligned slot-sized buffers (one mmap), handed out and given back."""

    def __init__(self, num: int, slot_bytes: int) -> None:
        self._mem = mmap.mmap(-1, num * slot_bytes)
        self.slot_bytes = slot_bytes
        self._base = view_addr(self._mem)
        self._free = list(range(num))
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)

    def take(self, wait_s: float = 0.0) -> int | None:
        """A free buffer, waiting up to `wait_s` for one; None if none came."""
        with self._lock:
            if wait_s > 0:
                self._freed.wait_for(lambda: bool(self._free), wait_s)
            return self._free.pop() if self._free else None

    def give(self, i: int) -> None:
        with self._lock:
            self._free.append(i)
            self._freed.notify()

    def addr(self, i: int) -> int:
        return self._base + i * self.slot_bytes

    def mv(self, i: int, nbytes: int | None = None) -> memoryview:
        return memoryview(self._mem)[i * self.slot_bytes:i * self.slot_bytes + (nbytes or self.slot_bytes)]


def view_addr(mem: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mem))




def open_slots(path: Path, identity: DiskIdentity, num_slots: int) -> tuple[int, bool]:
    """Open (or create) the slot file of `num_slots` slots in directory `path`, preallocated;
    returns the descriptor and whether it is O_DIRECT (a file system that refuses it gets
    buffered I/O). DiskLayoutError for a directory of another node or layout, DiskError for
    any other failure (ENOSPC while preallocating, a bad metadata file, ...)."""
    want = identity.meta()
    meta_path, data_path = path / META_FILE, path / DATA_FILE
    try:
        path.mkdir(parents=True, exist_ok=True)
        if meta_path.exists():
            have = json.loads(meta_path.read_text())
            if have != want:
                raise DiskLayoutError(
                    f"disk tier {path} was made for {have}, not for {want}: give this node another "
                    f"directory (or empty this one)")
        size = num_slots * disk_slot_bytes(identity.block_bytes)
        try:
            fd, direct = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            fd, direct = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o644), False
        try:
            os.posix_fallocate(fd, 0, size)
            if os.fstat(fd).st_size > size:  # a smaller tier than last time: drop the tail
                os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        if not meta_path.exists():
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(want, sort_keys=True))
            os.replace(tmp, meta_path)
    except (OSError, ValueError) as err:
        raise DiskError(f"disk tier {path}: {err}") from err
    return fd, direct


def read_headers(fd: int, num_slots: int, slot_bytes: int, page: memoryview) -> Iterator[tuple[int, SlotHeader]]:
    """Each slot's header, read through `page` (DISK_ALIGN bytes, aligned); OSError on a
    failed or short read."""
    for i in range(num_slots):
        n = os.preadv(fd, [page], i * slot_bytes)
        if n != DISK_ALIGN:
            raise OSError(errno.EIO, f"short read of slot {i}'s header ({n} bytes)")
        yield i, SlotHeader.unpack(page[:HEADER_BYTES])
