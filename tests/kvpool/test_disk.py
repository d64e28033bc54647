"""The pool's disk tier on real files: eviction to disk and hits back, validation of every
disk read, a refused foreign directory, and the tier turning itself off on errors."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import NodePool, PoolConfig
from kvpool.disk import DATA_FILE, HOT_BUFFERS, DiskIdentity, DiskTier, disk_slot_bytes
from kvpool.layout import HEADER_BYTES, slot_bytes_for
from kvpool.stats import PoolStats
from metaserver.types import BlockHash, BlockLocation, NodeId
from tests.kvpool.hooks import put_bytes
from tests.kvpool.pool_node import block_content, block_hash

NS = "test-ns"
BB = 64 * 1024
DRAM_BLOCKS = 4


def make_pool(disk_dir: Path | str, disk_blocks: int = 64, node_id: str = "A", ns: str = NS, **kw) -> NodePool:
    cfg = PoolConfig(node_id, DRAM_BLOCKS * slot_bytes_for(BB), BB, ns, evict_batch=1, disk_dir=str(disk_dir),
                     disk_size_bytes=disk_blocks * disk_slot_bytes(BB), **kw)
    return NodePool(cfg)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[NodePool]:
    p = make_pool(tmp_path / "disk")
    yield p
    p.close()


def put_chain(pool: NodePool, n: int, seed: str = "chain") -> list[bytes]:
    hashes = [block_hash(seed, i) for i in range(n)]
    for h in hashes:
        assert put_bytes(pool, h, block_content(h, BB))
    assert pool.disk is None or pool.disk.flush()
    return hashes


def read_local(pool: NodePool, hashes: list[bytes]) -> tuple[tuple[int, ...], np.ndarray]:
    """get() of this node's own blocks: at their DRAM slot if in DRAM, else by hash alone
    (generation 0: a location whose DRAM slot is gone)."""
    dest = np.zeros(len(hashes) * BB, dtype=np.uint8)
    gens = [pool.locate([h])[0].generation if h in pool else 0 for h in hashes]
    locs = [BlockLocation(BlockHash(h), NodeId(pool.config.node_id), 0, HEADER_BYTES + BB, g)
            for h, g in zip(hashes, gens)]
    res = pool.get(locs, {}, [dest.ctypes.data + i * BB for i in range(len(hashes))]).wait(timeout_s=30)
    assert len(res.ok) + len(res.failed) == len(hashes)
    return res.ok, dest


def flip_on_disk(pool: NodePool, h: bytes, at: int) -> None:
    assert pool.disk is not None
    block = pool.disk.block(h)
    assert block is not None
    with open(pool.disk.path / DATA_FILE, "r+b") as f:
        f.seek(block.offset + at)
        b = f.read(1)
        f.seek(block.offset + at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_evicted_blocks_go_to_disk_and_come_back(pool: NodePool) -> None:
    hashes = put_chain(pool, 10)
    assert pool.disk is not None and pool.stats.disk_enabled
    evicted = hashes[:10 - DRAM_BLOCKS]
    assert [h in pool for h in hashes] == [False] * len(evicted) + [True] * DRAM_BLOCKS
    assert all(h in pool.disk for h in evicted) and len(pool.disk) == len(evicted)
    assert pool.stats.disk_writes == len(evicted) == pool.stats.disk_blocks
    ok, dest = read_local(pool, evicted[:2])
    assert ok == (0, 1)
    for i, h in enumerate(evicted[:2]):
        assert np.array_equal(dest[i * BB:(i + 1) * BB], block_content(h, BB))
    assert pool.stats.disk_hits == 2
    assert evicted[0] in pool and evicted[1] in pool  # promoted back into DRAM


def test_locate_promotes_from_disk(pool: NodePool) -> None:
    hashes = put_chain(pool, 8)
    records = pool.locate(hashes[:3])
    assert [r.block_hash for r in records] == hashes[:3]
    assert pool.stats.disk_hits == 3 and all(h in pool for h in hashes[:3])
    assert pool.locate([block_hash("other", 0)]) == []


def test_a_block_evicted_again_is_not_written_twice(pool: NodePool) -> None:
    hashes = put_chain(pool, 8)
    assert read_local(pool, hashes[:1])[0] == (0,)  # promoted...
    put_chain(pool, 8, seed="more")                 # ...and evicted again
    assert hashes[0] in pool.disk  # type: ignore[operator]
    assert pool.stats.disk_writes == 4 + 8  # the first 4 of the chain, then 8 more blocks


def test_a_flipped_byte_on_disk_fails_validation(pool: NodePool) -> None:
    hashes = put_chain(pool, 8)
    flip_on_disk(pool, hashes[0], HEADER_BYTES + BB - 1)  # last payload byte
    flip_on_disk(pool, hashes[1], 40)                     # inside the stored hash
    ok, dest = read_local(pool, hashes[:3])
    assert ok == (2,)
    assert not dest[:2 * BB].any()  # nothing of a failed block reached its destination
    assert pool.stats.disk_failed_reads == 2 and pool.stats.disk_hits == 1
    assert hashes[0] not in pool.disk and hashes[0] not in pool  # type: ignore[operator]
    assert read_local(pool, hashes[:1])[0] == ()  # dropped: a miss from now on


def test_the_slot_is_reused_after_eviction_and_validates(tmp_path: Path) -> None:
    p = make_pool(tmp_path / "disk", disk_blocks=3)
    try:
        hashes = put_chain(p, 10)  # 6 to disk, 3 slots: the first 3 were evicted from disk
        assert p.stats.disk_evictions == 3 and len(p.disk) == 3  # type: ignore[arg-type]
        assert read_local(p, hashes[:3])[0] == ()
        ok, dest = read_local(p, hashes[4:5])  # (one: its promotion evicts from DRAM to disk again)
        assert ok == (0,)
        assert np.array_equal(dest, block_content(hashes[4], BB))
    finally:
        p.close()


def test_a_full_writer_queue_drops_writes_without_blocking_put(tmp_path: Path) -> None:
    p = make_pool(tmp_path / "disk", disk_queue_blocks=1)
    assert p.disk is not None
    release = threading.Event()
    write = p.disk._pwrite

    def slow(data, offset):  # a disk that does not answer until released
        release.wait(30)
        write(data, offset)

    p.disk._pwrite = slow  # type: ignore[method-assign]
    try:
        hashes = [block_hash("q", i) for i in range(10)]
        for h in hashes:
            assert put_bytes(p, h, block_content(h, BB))
        # 6 evicted; held at most: the one staging buffer and the device writer's hot buffers
        assert p.stats.disk_dropped_writes >= 6 - (1 + HOT_BUFFERS)
        release.set()
        assert p.disk.flush()
        assert p.stats.disk_writes + p.stats.disk_dropped_writes == 6
        assert read_local(p, hashes[:1])[0] == (0,)  # the block that got the buffer
    finally:
        release.set()
        p.close()


def test_a_directory_of_another_layout_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "disk"
    make_pool(d, ns="layout-one").close()
    with caplog.at_level(logging.ERROR, logger="kvpool.pool"):
        p = make_pool(d, ns="layout-two")
    try:
        assert p.disk is None and not p.stats.disk_enabled
        assert any("no disk tier" in r.getMessage() and "layout-one" in r.getMessage() for r in caplog.records)
        hashes = put_chain(p, 8)  # DRAM still works
        assert all(h in p for h in hashes[-DRAM_BLOCKS:])
    finally:
        p.close()
    p = make_pool(d, node_id="B", ns="layout-one")  # another node's directory
    try:
        assert p.disk is None
    finally:
        p.close()


def test_a_removed_directory_turns_the_tier_off(pool: NodePool, caplog: pytest.LogCaptureFixture) -> None:
    hashes = put_chain(pool, 6)
    assert pool.disk is not None and len(pool.disk) == 2
    shutil.rmtree(pool.disk.path)
    with caplog.at_level(logging.ERROR, logger="kvpool.disk"):
        more = put_chain(pool, 6, seed="more")
    assert not pool.stats.disk_enabled and pool.stats.disk_errors == 1 and pool.stats.disk_blocks == 0
    assert sum("off after an I/O error" in r.getMessage() for r in caplog.records) == 1
    assert read_local(pool, hashes[:2])[0] == ()  # the disk blocks are gone, reported failed
    ok, dest = read_local(pool, more[-2:])  # DRAM goes on
    assert ok == (0, 1) and np.array_equal(dest[BB:], block_content(more[-1], BB))


def test_a_full_disk_leaves_the_node_on_dram(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        with caplog.at_level(logging.ERROR, logger="kvpool.pool"):
            p = make_pool(mnt / "disk", disk_blocks=(32 << 20) // disk_slot_bytes(BB))  # 32 MiB on 16
        try:
            assert p.disk is None and not p.stats.disk_enabled
            assert any("No space left" in r.getMessage() for r in caplog.records)
            hashes = put_chain(p, 8)
            ok, dest = read_local(p, hashes[-1:])
            assert ok == (0,) and np.array_equal(dest, block_content(hashes[-1], BB))
        finally:
            p.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_the_tier_alone_keeps_only_complete_slots(tmp_path: Path) -> None:
    """A slot without a valid header is not kept at restart; a torn slot (valid header, part
    of its payload not written: a power loss, or a buffered write cut short) is kept by the
    header scan, and its first read fails the checksum and drops it."""
    stats = PoolStats()
    ident = DiskIdentity("A", NS, BB)
    tier = DiskTier(str(tmp_path), 8 * disk_slot_bytes(BB), ident, stats)
    src = np.zeros(HEADER_BYTES + BB, dtype=np.uint8)
    from kvpool.layout import MAGIC, SlotHeader, checksum

    hashes = [block_hash("t", i) for i in range(4)]
    for h in hashes:
        src[HEADER_BYTES:] = block_content(h, BB)
        src[:HEADER_BYTES] = np.frombuffer(SlotHeader(MAGIC, 1, BB, checksum(src.ctypes.data + HEADER_BYTES, BB),
                                                      h).pack(), dtype=np.uint8)
        assert tier.offer(h, src.ctypes.data)
    assert tier.flush() and len(tier) == 4
    no_header = tier.block(hashes[1]).offset  # type: ignore[union-attr]
    torn = tier.block(hashes[3]).offset  # type: ignore[union-attr]
    tier.close()
    with open(tmp_path / DATA_FILE, "r+b") as f:
        f.seek(no_header)  # the header never reached the disk
        f.write(b"\0" * 4)
        f.seek(torn + HEADER_BYTES + BB - 4096)  # the payload's last page did not
        f.write(b"\0" * 4096)
    again = DiskTier(str(tmp_path), 8 * disk_slot_bytes(BB), ident, stats)
    try:
        assert [b.block_hash for b in again.blocks()] == [hashes[0], hashes[2], hashes[3]]  # LRU order kept
        dest = np.zeros(BB, dtype=np.uint8)
        assert again.read_into(hashes[2], dest.ctypes.data)
        assert np.array_equal(dest, block_content(hashes[2], BB))
        failed = stats.disk_failed_reads
        assert not again.read_into(hashes[3], dest.ctypes.data)  # torn: fails validation, dropped
        assert stats.disk_failed_reads == failed + 1 and hashes[3] not in again
        assert np.array_equal(dest, block_content(hashes[2], BB))  # nothing written to dest
    finally:
        again.close()


def test_a_disk_read_runs_off_the_callers_thread_and_wakes_it(pool: NodePool) -> None:
    """The engine loop polls `done()`: the disk read runs on a pool thread and calls
    `on_progress` when it ends; DRAM blocks of the same read are copied at once."""
    hashes = put_chain(pool, 8)
    dram = pool.locate(hashes[-1:])[0]
    locs = [BlockLocation(BlockHash(hashes[0]), NodeId("A"), 0, HEADER_BYTES + BB, 0),
            BlockLocation(dram.block_hash, NodeId("A"), dram.offset, dram.size_bytes, dram.generation),
            BlockLocation(BlockHash(block_hash("never", 0)), NodeId("A"), 0, HEADER_BYTES + BB, 0)]
    dest = np.zeros(3 * BB, dtype=np.uint8)
    woken = threading.Event()
    readers: list[str] = []
    read = pool.disk.read_into  # type: ignore[union-attr]

    def spy(h, d, memory):
        readers.append(threading.current_thread().name)
        return read(h, d, memory)

    pool.disk.read_into = spy  # type: ignore[union-attr,method-assign]
    handle = pool.get(locs, {}, [dest.ctypes.data + i * BB for i in range(3)], on_progress=woken.set)
    assert woken.wait(30) and handle.done()
    assert handle.result is not None and handle.result.ok == (0, 1) and handle.result.failed == (2,)
    assert readers and threading.current_thread().name not in readers
    assert np.array_equal(dest[:BB], block_content(hashes[0], BB))
    assert np.array_equal(dest[BB:2 * BB], block_content(hashes[-1], BB))


def test_a_closed_pool_saves_its_dram_blocks_and_a_new_one_finds_them(tmp_path: Path) -> None:
    p = make_pool(tmp_path / "disk")
    hashes = put_chain(p, 10)
    p.close()
    again = make_pool(tmp_path / "disk")
    try:
        assert again.disk is not None and [b.block_hash for b in again.disk.blocks()] == hashes  # LRU order kept
        assert len(again) == 0 and again.stats.disk_blocks == 10
        ok, dest = read_local(again, [hashes[0], hashes[-1]])
        assert ok == (0, 1) and np.array_equal(dest[BB:], block_content(hashes[-1], BB))
    finally:
        again.close()
    for name, kw in (("disk2", {"disk_save_on_close": False}), ("disk3", {"disk_save_timeout_s": 0.0})):
        off = make_pool(tmp_path / name, **kw)  # not saved: off, or no time for it
        put_chain(off, 10)
        off.close()
        assert len(make_pool_disk_blocks(tmp_path / name)) == 10 - DRAM_BLOCKS


def make_pool_disk_blocks(d: Path) -> list[bytes]:
    p = make_pool(d, disk_save_on_close=False)
    try:
        assert p.disk is not None
        return [b.block_hash for b in p.disk.blocks()]
    finally:
        p.close()


def test_touch_refreshes_disk_blocks_too(pool: NodePool) -> None:
    """A local hit in the engine's cache (`touch`) keeps a block held only on disk from being
    the next one the disk evicts."""
    hashes = put_chain(pool, 8)  # 0..3 on disk (oldest first), 4..7 in DRAM
    assert pool.disk is not None
    assert pool.touch([hashes[0], hashes[5], block_hash("never", 0)]) == 2
    assert [b.block_hash for b in pool.disk.blocks()] == [hashes[1], hashes[2], hashes[3], hashes[0]]


def test_a_block_offered_again_while_its_write_is_in_flight_takes_one_slot(tmp_path: Path) -> None:
    """The stage thread claims a slot and hands the block to the device writer; the same block
    offered again before that write ended is not staged a second time (one slot, none lost)."""
    from kvpool.layout import MAGIC, SlotHeader, checksum

    stats = PoolStats()
    tier = DiskTier(str(tmp_path), 4 * disk_slot_bytes(BB), DiskIdentity("A", NS, BB), stats)
    release, entered = threading.Event(), threading.Event()
    write = tier._pwrite

    def slow(data, offset):  # the device holds the first write until released
        entered.set()
        release.wait(30)
        write(data, offset)

    tier._pwrite = slow  # type: ignore[method-assign]
    src = np.zeros(HEADER_BYTES + BB, dtype=np.uint8)
    h = block_hash("again", 0)
    src[HEADER_BYTES:] = block_content(h, BB)
    src[:HEADER_BYTES] = np.frombuffer(SlotHeader(MAGIC, 1, BB, checksum(src.ctypes.data + HEADER_BYTES, BB),
                                                  h).pack(), dtype=np.uint8)
    try:
        assert tier.offer(h, src.ctypes.data)
        assert entered.wait(10)
        assert tier.offer(h, src.ctypes.data)  # not on disk yet: queued, and skipped by the stage
        release.set()
        assert tier.flush()
        assert len(tier) == 1 and stats.disk_writes == 1 and len(tier._free) == tier.num_slots - 1
        dest = np.zeros(BB, dtype=np.uint8)
        assert tier.read_into(h, dest.ctypes.data) and np.array_equal(dest, block_content(h, BB))
    finally:
        release.set()
        tier.close()
