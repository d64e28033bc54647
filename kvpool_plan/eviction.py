"""A node pool's slot eviction without its memory: what `kvpool.pool.NodePool` keeps and drops.

NodePool allocates its buffer and a transfer engine, so thousands of simulated nodes cannot
each hold one. This mirrors its policy exactly, and `tests/plan/test_eviction.py` runs a
real NodePool beside it on the same puts and touches and checks they hold the same blocks:
- an LRU of the held blocks, oldest first; a put of a held block, a `touch` (a local hit in
  the engine's cache, the connector's Recency rule) and a read from the node's own pool
  (`get`, `locate`) move it to the end; a read by another node does not (one-sided);
- a put into a full pool takes `evict_batch` blocks from the LRU's front at once (they are
  unpublished together) and the put then takes one of the freed slots.
Kept a mirror rather than a class NodePool would share: the pool's LRU lives under its lock
beside slot generations and the disk tier, and the pool is edited in parallel; the test
keeps the two in step.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class PoolLRU:
    def __init__(self, num_slots: int, evict_batch: int = 16) -> None:
        if num_slots < 1 or evict_batch < 1:
            raise ValueError("num_slots and evict_batch must be >= 1")
        self.num_slots = num_slots
        self.evict_batch = evict_batch
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self.evictions = 0
        self.puts = 0

    def __contains__(self, h: Hashable) -> bool:
        return h in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def blocks(self) -> list[Hashable]:
        """Held blocks, least recently used first."""
        return list(self._lru)

    def put(self, h: Hashable) -> tuple[bool, list[Hashable]]:
        """(stored, the blocks evicted to make room); a held block is only moved to the end."""
        lru = self._lru
        if h in lru:
            lru.move_to_end(h)
            return False, []
        victims: list[Hashable] = []
        if len(lru) >= self.num_slots:
            for _ in range(min(self.evict_batch, len(lru))):
                victims.append(lru.popitem(last=False)[0])
            self.evictions += len(victims)
        lru[h] = None
        self.puts += 1
        return True, victims

    def touch(self, hashes: Iterable[Hashable]) -> int:
        """Move the held ones of `hashes` to the end; how many were held."""
        lru = self._lru
        n = 0
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                n += 1
        return n
