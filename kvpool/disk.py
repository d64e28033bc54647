"""The node pool's disk tier: one preallocated file of fixed block slots under the DRAM slots.

Where it sits: `NodePool` offers each block it evicts from DRAM (`offer`, on the thread that
evicts: the saver thread in async mode); the bytes are copied into a staging buffer owned by
this tier before the DRAM slot is freed (a memcpy: no caller ever waits on the disk). A
stage thread claims a disk slot for each, writes its header and copies it into one of
HOT_BUFFERS buffers; a device writer thread writes each hot buffer to its slot, in order, while
the stage thread fills the other. A read of a block held only here
(`read_into`, on a pool thread: `kvpool.tier_reads`) is validated and then promoted back
into DRAM by the pool.

Why write-on-evict (not write-through): the disk then takes exactly the blocks DRAM cannot
hold, once per stay in DRAM, and a block saved and hit while it is hot in DRAM costs no disk
write at all; write-through would put every save on the disk (at save rate, not eviction
rate). The price: a node killed with blocks that never left DRAM loses those on restart
(its disk keeps every block it evicted); a clean shutdown writes them (`NodePool.close`).

Why O_DIRECT from page-aligned (mmap) buffers, buffered I/O as fallback: measured against
buffered writes and reads and `fio` on the same directory (`kvpool bench disk`; figures in
docs/BENCHMARKS.md, "Disk tier"), O_DIRECT wrote several times faster than buffered writes
with fdatasync and read at least as fast, and it keeps the tier out of the page cache, which
the DRAM pool already is. A file system that refuses O_DIRECT gets buffered I/O.

On-disk layout (`kvpool.disk_file`): one slot file, each slot the DRAM slot's 64-byte header
(`kvpool.layout.SlotHeader`) and its payload, rounded up to 4 KiB (O_DIRECT alignment); a
directory made for another node or layout is refused (`DiskLayoutError`). The header's
generation is this tier's write sequence number (increasing across all slots), so a restart
rebuilds the LRU order from the headers.

A slot is written with one pwrite: its final header (magic, generation, size, the payload's
xxh3 checksum, the hash) and its payload, from the staging buffer. Why one write, not the
payload with an invalid header and then the header's page (the first design): that second,
4 KiB write cost a round trip to the device per slot, which kept the tier's writes under 80% of
fio's (`kvpool bench disk`, docs/BENCHMARKS.md), and what it guarded against is caught anyway,
because no byte of a slot is used before its read checks magic, hash, generation, size and the
payload checksum. A process killed (SIGKILL) while writing: an O_DIRECT write is not cut short
by a signal once submitted, so the slot is either written or not (an old slot, still whole). A
buffered write (the fallback) or a power loss may leave a slot torn: new header with part of
the old payload, or the reverse, in any order on the device. Warm restart reads headers only
(`scan`), so it may publish such a slot; its first read fails the checksum (or the hash or
generation), the tier drops it, the pool unpublishes it and the reader recomputes it: one miss,
never wrong bytes.

Invariant as in DRAM: a disk slot leaves the index (`on_evicted`: the pool unpublishes it)
before it is reused. Errors (ENOSPC, EIO, the file or directory removed): logged once,
counted, the tier turns itself off (its blocks are reported evicted) and the pool goes on
with DRAM only.

Threading: every public method is thread-safe; `self._lock` guards the slot tables. Disk
I/O runs outside the lock: writes on the device writer thread, reads on the caller's thread.
A slot claimed by the stage thread is in neither the free list nor the index until the device
writer's write ended (`_in_stage` holds its hash meanwhile, so a block is staged once).
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpool.disk_file import (DATA_FILE, DISK_ALIGN, AlignedBuffers, DiskError, DiskIdentity, DiskLayoutError,
                              disk_slot_bytes, open_slots, read_headers)
from kvpool.layout import HEADER_BYTES, HOST_MEMORY, MAGIC, CallerMemory, SlotHeader, Payload, memcpy, valid_block, view
from kvpool.stats import PoolStats
from metaserver.types import BlockHash

__all__ = ["DATA_FILE", "HOT_BUFFERS", "DiskBlock", "DiskError", "DiskIdentity", "DiskLayoutError", "DiskTier", "disk_slot_bytes"]

log = logging.getLogger(__name__)

# Buffers the device writer writes from. Why a copy from the staging ring into a few hot
# buffers: O_DIRECT writes from a rotating set of 64 buffers reached ~65% of the rate of the
# same writes from one or two (measured on this machine kind's virtual disk; fio writes from
# one buffer), and the copy for the next write overlaps the device's current one.
HOT_BUFFERS = 2


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """A block held on disk, as the pool publishes it (offset: the disk slot's)."""
    block_hash: BlockHash
    offset: int
    generation: int


@dataclass(slots=True)
class _Slot:
    index: int
    generation: int = 0
    block_hash: BlockHash | None = None
    readers: int = 0          # reads in flight (the slot is not reused meanwhile)
    orphan: bool = False      # dropped while read: freed by the last reader


@dataclass(frozen=True, slots=True)
class _Write:
    """A staged block on its way to the device: its claimed slot and its hot buffer."""
    slot: _Slot
    block_hash: BlockHash
    generation: int
    hot: int


class DiskTier:
    def __init__(self, directory: str, size_bytes: int, identity: DiskIdentity, stats: PoolStats,
                 queue_blocks: int = 32, read_buffers: int = 8,
                 on_written: Callable[[DiskBlock], None] = lambda b: None,
                 on_evicted: Callable[[list[BlockHash]], None] = lambda hs: None) -> None:
        """Open (or create) the tier in `directory`; raises DiskError (DiskLayoutError for a
        directory of another node or layout) if it cannot. Existing valid slots are kept
        (`scan`); `on_written` is called (writer thread) for each block written, `on_evicted`
        (any thread, never under the lock) with blocks that left the tier."""
        self.identity = identity
        self.block_bytes = identity.block_bytes
        self.slot_bytes = disk_slot_bytes(identity.block_bytes)
        self.num_slots = size_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise DiskError(f"disk size {size_bytes} cannot hold one {self.slot_bytes}-byte slot")
        self.path = Path(directory)
        self._stats = stats
        self._on_written = on_written
        self._on_evicted = on_evicted
        self._fd, self.direct = open_slots(self.path, identity, self.num_slots)
        self._lock = threading.Lock()
        self._slots = [_Slot(i) for i in range(self.num_slots)]
        self._index: dict[BlockHash, _Slot] = {}
        self._lru: OrderedDict[BlockHash, _Slot] = OrderedDict()  # oldest first
        self._free: list[int] = []
        self._seq = 0
        self.enabled = True
        self._staging = AlignedBuffers(queue_blocks, self.slot_bytes)
        self._hot = AlignedBuffers(HOT_BUFFERS, self.slot_bytes)  # what the device writes from (module doc)
        self._reading = AlignedBuffers(read_buffers, self.slot_bytes)
        self._queue: queue.Queue[tuple[BlockHash, int] | None] = queue.Queue()
        self._device: queue.Queue[_Write | None] = queue.Queue()
        self._in_stage: set[BlockHash] = set()  # staged for the device, not in the index yet
        self._idle = threading.Condition(self._lock)
        self._queued = 0  # offers not written (or dropped) yet
        try:
            self.scan()
        except DiskError:
            os.close(self._fd)
            raise
        self._writer = threading.Thread(target=self._run, name=f"disk-stage-{identity.node_id}", daemon=True)
        self._device_writer = threading.Thread(target=self._run_device, name=f"disk-writer-{identity.node_id}",
                                               daemon=True)
        self._writer.start()
        self._device_writer.start()

    # ---- opening --------------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the tables from the slot headers on disk (header check only: every later
        read validates the payload too); returns the blocks kept. Called at start."""
        found: dict[BlockHash, tuple[int, int]] = {}  # hash -> (generation, slot)
        buf = self._reading.take()
        assert buf is not None
        try:
            for i, header in read_headers(self._fd, self.num_slots, self.slot_bytes, self._reading.mv(buf, DISK_ALIGN)):
                if header.magic != MAGIC or header.payload_bytes != self.block_bytes:
                    continue
                h = BlockHash(header.block_hash)
                if h not in found or found[h][0] < header.generation:
                    found[h] = (header.generation, i)
        except OSError as err:
            self._reading.give(buf)
            raise DiskError(f"disk tier {self.path}: reading slot headers failed: {err}") from err
        self._reading.give(buf)
        with self._lock:
            used = set()
            for h, (gen, i) in sorted(found.items(), key=lambda kv: kv[1][0]):
                slot = self._slots[i]
                slot.block_hash, slot.generation = h, gen
                self._index[h] = self._lru[h] = slot
                used.add(i)
            self._free = [i for i in range(self.num_slots - 1, -1, -1) if i not in used]
            self._seq = max((g for g, _ in found.values()), default=0)
            self._stats.disk_blocks = len(self._index)
            self._stats.disk_enabled = True
        return len(found)

    # ---- state ----------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def blocks(self) -> list[DiskBlock]:
        """Every block held, least recently used first."""
        with self._lock:
            return [self._block(s) for s in self._lru.values()]

    def touch(self, hashes: list[bytes]) -> int:
        """Mark the blocks of `hashes` held here as recently used; returns how many are."""
        n = 0
        with self._lock:
            for h in hashes:
                if h in self._index:
                    self._lru.move_to_end(BlockHash(h))
                    n += 1
        return n

    def holds(self, block_hash: bytes, generation: int) -> bool:
        with self._lock:
            slot = self._index.get(BlockHash(block_hash))
            return slot is not None and slot.generation == generation

    def block(self, block_hash: bytes) -> DiskBlock | None:
        with self._lock:
            slot = self._index.get(BlockHash(block_hash))
            return None if slot is None else self._block(slot)

    def _block(self, slot: _Slot) -> DiskBlock:
        assert slot.block_hash is not None
        return DiskBlock(slot.block_hash, slot.index * self.slot_bytes, slot.generation)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every offer so far is written or dropped (tests, shutdown)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def close(self) -> None:
        """Stop the writer and close the file; offers not written yet are dropped (`flush`
        first to keep them). Idempotent. A writer stuck in a write keeps the file open (its
        descriptor must not be reused under it)."""
        with self._lock:
            self.enabled = False  # the writer skips what is still queued
        if self._writer.is_alive() or self._device_writer.is_alive():
            self._queue.put(None)  # the stage thread passes it on to the device writer
            self._writer.join(30)
            self._device_writer.join(30)
            if self._writer.is_alive() or self._device_writer.is_alive():
                log.error("disk tier %s: the writer is stuck in a write; its file stays open", self.path)
                return
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    # ---- writes ---------------------------------------------------------------------

    def offer(self, block_hash: bytes, slot_addr: int, wait_s: float = 0.0) -> bool:
        """Queue the DRAM slot at `slot_addr` (header + payload of `block_hash`) for a disk
        write. Copies its payload before it returns (the caller may then reuse the slot) and
        does not block on the disk (unless `wait_s`, for a free staging buffer: shutdown's
        save): with no staging buffer free the block is dropped (counted). A block already on
        disk is only marked recently used. Returns True if queued."""
        h = BlockHash(bytes(block_hash))
        header = SlotHeader.unpack(view(slot_addr, HEADER_BYTES))
        if header.magic != MAGIC or header.block_hash != h or header.payload_bytes != self.block_bytes:
            return False
        with self._lock:
            if not self.enabled:
                return False
            slot = self._index.get(h)
            if slot is not None:
                self._lru.move_to_end(h)
                on_disk = self._block(slot)
            else:
                on_disk = None
        if on_disk is not None:
            self._on_written(on_disk)  # evicted from DRAM again: the disk copy is what the node holds
            return False
        buf = self._staging.take(wait_s)
        if buf is None:
            with self._lock:
                self._stats.disk_dropped_writes += 1
            return False
        base = self._staging.addr(buf)
        memcpy(base + HEADER_BYTES, slot_addr + HEADER_BYTES, self.block_bytes)
        view(base, HEADER_BYTES)[:] = header.pack()  # generation set by the writer (`_write`)
        with self._lock:
            self._queued += 1
        self._queue.put((h, buf))
        return True

    def _run(self) -> None:
        """The stage thread: a slot for each queued block, its header, and its bytes copied
        from the staging ring into a free hot buffer for the device writer."""
        while True:
            item = self._queue.get()
            if item is None:
                self._device.put(None)
                return
            h, buf = item
            write = None
            try:
                write = self._stage(h, buf)
            except OSError as err:
                self.fail(err)
            finally:
                self._staging.give(buf)
                if write is None:
                    self._done()
                else:
                    self._device.put(write)

    def _run_device(self) -> None:
        """The device writer: one pwrite per slot, from a hot buffer, in stage order."""
        while True:
            write = self._device.get()
            if write is None:
                return
            try:
                self._commit(write)
            except OSError as err:
                self.fail(err)
            finally:
                self._hot.give(write.hot)
                self._done()

    def _done(self) -> None:
        """One offer written or dropped."""
        with self._lock:
            self._queued -= 1
            if self._queued == 0:
                self._idle.notify_all()

    def _stage(self, h: BlockHash, buf: int) -> _Write | None:
        """Claim a slot for the staged block (unpublishing its victim first) and copy header and
        payload into a hot buffer; None if it is not to be written (tier off, already held, no
        slot free of readers)."""
        with self._lock:
            if not self.enabled or h in self._index or h in self._in_stage:
                return None
            slot, victim = self._claim()
            if slot is None:  # every slot is being read: no room now
                self._stats.disk_dropped_writes += 1
                return None
            self._seq += 1
            gen = self._seq
            self._in_stage.add(h)
        try:
            if victim is not None:
                self._on_evicted([victim])  # unpublished before the slot is reused
            self._check_file()
            base = self._staging.addr(buf)
            staged = SlotHeader.unpack(view(base, HEADER_BYTES))
            view(base, HEADER_BYTES)[:] = SlotHeader(MAGIC, gen, self.block_bytes, staged.checksum, h).pack()
            hot = None
            while hot is None:  # the device writer gives one back after each write
                hot = self._hot.take(60.0)
            memcpy(self._hot.addr(hot), base, self.slot_bytes)
        except BaseException:
            self._unclaim(slot, h)
            raise
        return _Write(slot, h, gen, hot)

    def _unclaim(self, slot: _Slot, h: BlockHash) -> None:
        with self._lock:
            self._free.append(slot.index)
            self._in_stage.discard(h)

    def _commit(self, w: _Write) -> None:
        try:
            self._pwrite(self._hot.mv(w.hot), w.slot.index * self.slot_bytes)  # header and payload at once
        except OSError:
            self._unclaim(w.slot, w.block_hash)
            raise
        with self._lock:
            self._in_stage.discard(w.block_hash)
            if not self.enabled:
                return
            w.slot.block_hash, w.slot.generation = w.block_hash, w.generation
            self._index[w.block_hash] = self._lru[w.block_hash] = w.slot
            self._stats.disk_writes += 1
            self._stats.disk_blocks = len(self._index)
            block = self._block(w.slot)
        self._on_written(block)

    def _claim(self) -> tuple[_Slot | None, BlockHash | None]:
        """Under the lock: a slot to write, and the block evicted for it (None if it was free).
        The slot is in neither the free list nor the index until the write ends."""
        if self._free:
            return self._slots[self._free.pop()], None
        for h, slot in self._lru.items():
            if slot.readers == 0:
                del self._lru[h], self._index[h]
                slot.block_hash = None
                self._stats.disk_evictions += 1
                self._stats.disk_blocks = len(self._index)
                return slot, h
        return None, None

    def _pwrite(self, data: memoryview, offset: int) -> None:
        n = os.pwritev(self._fd, [data], offset)
        if n != len(data):
            raise OSError(errno.EIO, f"short write ({n} of {len(data)} bytes)")

    def _check_file(self) -> None:
        """The file is still where the tier keeps it: writes to an unlinked file would vanish."""
        if os.fstat(self._fd).st_nlink == 0:
            raise OSError(errno.ENOENT, f"{self.path / DATA_FILE} was removed")

    # ---- reads ----------------------------------------------------------------------

    def read_into(self, block_hash: bytes, dest: Payload, memory: CallerMemory = HOST_MEMORY) -> bool:
        """Read `block_hash` from disk, validate it, and copy its payload to `dest` (one
        address, or equal segments in order, in the caller's `memory`). False (nothing written to `dest`) if it is not
        held, the tier is off, or the slot does not validate (then it is dropped)."""
        h = BlockHash(bytes(block_hash))
        with self._lock:
            slot = self._index.get(h) if self.enabled else None
            if slot is None:
                return False
            slot.readers += 1
            gen = slot.generation
            self._lru.move_to_end(h)
        buf = self._reading.take()
        ok = False
        try:
            if buf is None:
                return False  # more reads in flight than buffers: a miss, recomputed
            self._check_file()
            n = os.preadv(self._fd, [self._reading.mv(buf)], slot.index * self.slot_bytes)
            if n != self.slot_bytes:
                raise OSError(errno.EIO, f"short read ({n} of {self.slot_bytes} bytes)")
            base = self._reading.addr(buf)
            ok = valid_block(base, base + HEADER_BYTES, self.block_bytes, h, gen)
            if ok:
                memory.write(dest, base + HEADER_BYTES, self.block_bytes)
            return ok
        except OSError as err:
            self.fail(err)
            return False
        finally:
            if buf is not None:
                self._reading.give(buf)
            self._after_read(slot, h, ok)

    def _after_read(self, slot: _Slot, h: BlockHash, ok: bool) -> None:
        dropped = False
        with self._lock:
            slot.readers -= 1
            if ok:
                self._stats.disk_hits += 1
            else:
                self._stats.disk_failed_reads += 1
                if self._index.get(h) is slot:  # torn or overwritten on disk: never offered again
                    del self._index[h], self._lru[h]
                    slot.block_hash = None
                    slot.orphan = dropped = True
                    self._stats.disk_blocks = len(self._index)
            if slot.orphan and slot.readers == 0:
                slot.orphan = False
                if self.enabled:
                    self._free.append(slot.index)
        if dropped:
            log.warning("disk tier %s: block %s in slot %d did not validate; dropped", self.path, h[:8].hex(),
                        slot.index)
            self._on_evicted([h])

    # ---- errors ---------------------------------------------------------------------

    def fail(self, err: OSError) -> None:
        """Turn the tier off after an I/O error: logged once, counted; its blocks are reported
        evicted. Reads and offers after this find nothing."""
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            lost = list(self._index)
            self._index.clear()
            self._lru.clear()
            self._stats.disk_errors += 1
            self._stats.disk_enabled = False
            self._stats.disk_blocks = 0
        log.error("disk tier %s off after an I/O error (%s); node %s goes on with DRAM only", self.path, err,
                  self.identity.node_id)
        if lost:
            self._on_evicted(lost)
