"""The simulator's pool eviction (`kvpool_plan.eviction.PoolLRU`) keeps and drops the same
blocks as a real NodePool (no metaserver) on the same puts, touches and own reads; with a
disk tier (`DiskLRU`, `TieredPool`) the same blocks in each tier as a real NodePool with a
real disk tier, and the index changes it reports match what the pool publishes."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest

from kvpool import NodePool, PoolConfig
from kvpool.disk import disk_slot_bytes
from kvpool.layout import slot_bytes_for
from kvpool_plan.eviction import DiskLRU, PoolLRU, TieredPool
from metaserver.index import BlockIndex
from metaserver.types import BlockHash, BlockRecord, Medium, Namespace, NodeId, NodeRecord
from tests.kvpool.hooks import lru_order

BB = 4096


def _h(i: int) -> bytes:
    return hashlib.sha256(b"plan/%d" % i).digest()


@pytest.mark.parametrize("slots, evict_batch, seed", [(40, 16, 0), (7, 3, 1), (33, 1, 2)])
def test_same_blocks_as_a_real_node_pool(slots: int, evict_batch: int, seed: int) -> None:
    cfg = PoolConfig("sim-check", slots * slot_bytes_for(BB), BB, "plan-ns", evict_batch=evict_batch)
    pool = NodePool(cfg, client=None)
    try:
        assert pool.num_slots == slots
        sim = PoolLRU(slots, evict_batch)
        src = np.zeros(BB, dtype=np.uint8)
        rng = random.Random(seed)
        universe = [_h(i) for i in range(3 * slots)]
        for step in range(1500):
            op = rng.random()
            if op < 0.7:  # a save (write-through): a new block, or one held already
                h = rng.choice(universe)
                stored, _ = sim.put(h)
                assert pool.put(h, src.ctypes.data, BB) == stored, step
            elif op < 0.85:  # a local hit touches its blocks (the connector's Recency rule)
                hs = rng.sample(universe, 4)
                assert pool.touch(hs) == sim.touch(hs), step
            else:  # the node reads a prefix from its own pool
                hs = rng.sample(universe, 3)
                got = pool.locate(hs)
                n = 0
                while n < len(hs) and hs[n] in sim:
                    n += 1
                sim.touch(hs[:n])
                assert len(got) == n, step
            assert lru_order(pool) == sim.blocks(), step
        assert pool.stats.evictions == sim.evictions
    finally:
        pool.close()


# ---- with a disk tier ------------------------------------------------------------------------


def _holdings(pool: NodePool) -> set:
    """What the node publishes (what it re-publishes after an outage: `NodePool._holdings`)."""
    return {(r.block_hash, r.medium) for r in pool._holdings()}


def _indexed(index: BlockIndex) -> set:
    """What the changes the mirror returned left in an index of the one node."""
    return {(loc.block_hash, loc.medium) for loc in index.namespace_state(Namespace("plan-ns"))[1]}


def _disk_pool(tmp_path: Path, slots: int, evict_batch: int, disk_slots: int,
               monkeypatch: pytest.MonkeyPatch) -> NodePool:
    """A real NodePool with a disk tier in `tmp_path` whose writer has written each block it
    is offered before `offer` returns (the mirror's model: bounded waits, no sleeps)."""
    cfg = PoolConfig("sim-check", slots * slot_bytes_for(BB), BB, "plan-ns", evict_batch=evict_batch,
                     disk_dir=str(tmp_path / "disk"), disk_size_bytes=disk_slots * disk_slot_bytes(BB),
                     disk_queue_blocks=8, disk_save_on_close=False)
    pool = NodePool(cfg, client=None)
    tier = pool.disk
    assert tier is not None, "the disk tier did not start"
    offer = tier.offer

    def offer_and_wait(*args: object, **kw: object) -> bool:
        queued = offer(*args, **kw)  # type: ignore[arg-type]
        assert tier.flush(30), "the disk writer did not write one block in 30 s"
        return queued

    monkeypatch.setattr(tier, "offer", offer_and_wait)
    return pool


@pytest.mark.parametrize("slots, evict_batch, disk_slots, seed", [(6, 3, 10, 0), (5, 1, 4, 1), (8, 16, 20, 2)])
def test_same_blocks_in_each_tier_as_a_real_pool_with_a_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              slots: int, evict_batch: int, disk_slots: int,
                                                              seed: int) -> None:
    """Saves, touches, own reads (promoted from disk) and other nodes' stage requests on a real
    NodePool with a disk tier and on `TieredPool`: after every step the same blocks in DRAM
    and on disk in the same LRU order, and the mirror's index changes leave the index holding
    what the pool publishes, with the same media."""
    pool = _disk_pool(tmp_path, slots, evict_batch, disk_slots, monkeypatch)
    try:
        assert pool.num_slots == slots and pool.disk is not None and pool.disk.num_slots == disk_slots
        disk = DiskLRU(disk_slots)
        sim = TieredPool(PoolLRU(slots, evict_batch), disk)
        index = BlockIndex()
        node = NodeId("sim-check")
        index.upsert_node(NodeRecord(node, "", 0, 0, Namespace("plan-ns"), 0, 0, stage_address="x"))

        def apply(changes: list) -> None:
            for h, medium in changes:
                if medium is None:
                    index.remove_block(node, h)
                else:
                    index.add_block(node, BlockRecord(BlockHash(h), 0, 0, 0, medium))

        src = np.zeros(BB, dtype=np.uint8)
        rng = random.Random(seed)
        universe = [_h(i) for i in range(2 * (slots + disk_slots))]
        kinds = {"put": 0, "touch": 0, "read": 0, "stage": 0}
        for step in range(300):
            op = rng.random()
            if op < 0.55:  # a save (write-through)
                h = rng.choice(universe)
                stored, changes = sim.put(h)
                assert pool.put(h, src.ctypes.data, BB) == stored, step
                kinds["put"] += 1
            elif op < 0.7:  # a local hit touches its blocks: DRAM, else disk
                hs = rng.sample(universe, 4)
                assert pool.touch(hs) == sim.touch(hs), step
                changes = []
                kinds["touch"] += 1
            elif op < 0.85:  # the node reads a prefix of its own blocks (disk ones promoted)
                hs = rng.sample(universe, 3)
                got = pool.locate(hs)
                n, changes = 0, []
                for h in hs:
                    medium, more = sim.read_own(h)
                    changes += more
                    if medium is None:
                        break
                    n += 1
                assert len(got) == n, step
                kinds["read"] += n > 0
            else:  # another node's load: this node stages its blocks into DRAM
                hs = rng.sample(universe, 2)
                answers = pool._tiers.stage(hs)
                changes = []
                for h, a in zip(hs, answers):
                    medium, more = sim.stage(h)
                    changes += more
                    assert (a is not None) == (medium is not None), step
                kinds["stage"] += 1
            apply(changes)
            assert lru_order(pool) == sim.dram.blocks(), step
            assert [b.block_hash for b in pool.disk.blocks()] == disk.blocks(), step
            assert _holdings(pool) == _indexed(index), step
        assert pool.stats.evictions == sim.dram.evictions
        assert pool.stats.disk_writes == disk.writes and pool.stats.disk_evictions == disk.evictions
        assert disk.evictions > 0 and pool.stats.disk_hits > 0 and all(kinds.values()), kinds
    finally:
        pool.close()


def test_a_block_in_both_tiers_is_published_once_as_dram() -> None:
    """Evicted to disk, read back (promoted: now in both), evicted again: the disk keeps its
    one copy (moved to its LRU's end, no second write) and publishes it as DISK again."""
    sim = TieredPool(PoolLRU(1, 1), DiskLRU(2))
    assert sim.put("a") == (True, [("a", Medium.DRAM)])
    assert sim.put("b") == (True, [("a", None), ("a", Medium.DISK), ("b", Medium.DRAM)])
    medium, changes = sim.read_own("a")  # promoted: b leaves DRAM for the disk
    assert medium == Medium.DISK
    assert changes == [("b", None), ("b", Medium.DISK), ("a", Medium.DRAM)]
    assert sim.dram.blocks() == ["a"] and sim.disk.blocks() == ["a", "b"]
    assert sim.put("c")[1] == [("a", None), ("a", Medium.DISK), ("c", Medium.DRAM)]
    assert sim.disk.blocks() == ["b", "a"] and sim.disk.writes == 2
    # a third block on the full disk drops its LRU block b (held nowhere else: unpublished)
    assert sim.put("d")[1] == [("c", None), ("b", None), ("c", Medium.DISK), ("d", Medium.DRAM)]
    assert sim.disk.blocks() == ["a", "c"] and not sim.holds("b")
