"""The simulator's pool eviction (`kvpool_plan.eviction.PoolLRU`) keeps and drops the same
blocks as a real NodePool (no metaserver) on the same puts, touches and own reads."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from kvpool import NodePool, PoolConfig
from kvpool.layout import slot_bytes_for
from kvpool_plan.eviction import PoolLRU
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
