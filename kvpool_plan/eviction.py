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

The disk tier (`DiskLRU`, mirroring `kvpool.disk.DiskTier` without its file) and the pool's
hand-off to it (`TieredPool`, NodePool's `_retire`, `touch`, `locate` / `get` of its own
blocks, and the holder's side of staging, `kvpool.tier_reads`):
- blocks evicted from DRAM are unpublished, then offered to the disk in eviction order; a
  block already on disk only moves to the end of the disk's LRU (and is published as DISK
  again); another takes a free disk slot or, with none free, the slot of the disk LRU's
  front block (one block per write), which is unpublished unless DRAM holds it too;
- a block read from the node's own disk (or staged there for another node) moves to the end
  of the disk's LRU and is promoted: put into DRAM (published as DRAM; its disk copy stays,
  so a block can be in both tiers, published once, as DRAM);
- `touch` moves a block held in DRAM there, else on disk; a save (`put`) never looks at the
  disk (a block held only on disk gets a DRAM copy).
The mirror's disk writes complete at once, in order (each offered block is on disk before
the next offer): the real tier writes on its own threads, so under a burst its LRU order
may differ from this one's, and it drops offers when its staging buffers are full (not
modelled). `tests/plan/test_eviction.py` runs a real NodePool with a disk tier beside this,
waiting for the disk writer after each offer.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from metaserver.types import Medium

# An index change, in the order NodePool makes it: (block, the medium it is published with),
# or (block, None): unpublished.
Change = tuple[Hashable, Medium | None]


class _Slots:
    """Blocks held one per slot, least recently used first (a tier's LRU without its memory)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self.evictions = 0

    def __contains__(self, h: Hashable) -> bool:
        return h in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def blocks(self) -> list[Hashable]:
        """Held blocks, least recently used first."""
        return list(self._lru)


class PoolLRU(_Slots):
    def __init__(self, num_slots: int, evict_batch: int = 16) -> None:
        if num_slots < 1 or evict_batch < 1:
            raise ValueError("num_slots and evict_batch must be >= 1")
        super().__init__(num_slots)
        self.evict_batch = evict_batch
        self.puts = 0

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


class DiskLRU(_Slots):
    """A node's disk tier without its file: the blocks `kvpool.disk.DiskTier` holds, one per
    slot, least recently used first (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.writes = 0

    def offer(self, h: Hashable) -> tuple[bool, list[Hashable]]:
        """A block evicted from DRAM (`DiskTier.offer`): (written, the block that left the disk
        for its slot, if any). A held block only moves to the end."""
        lru = self._lru
        if h in lru:
            lru.move_to_end(h)
            return False, []
        victims: list[Hashable] = []
        if len(lru) >= self.num_slots:  # `DiskTier._claim`: the LRU's front slot, one per write
            victims.append(lru.popitem(last=False)[0])
            self.evictions += 1
        lru[h] = None
        self.writes += 1
        return True, victims

    def read(self, h: Hashable) -> bool:
        """A read of `h` (`DiskTier.read_into`): moved to the end; False if not held."""
        if h not in self._lru:
            return False
        self._lru.move_to_end(h)
        return True

    def touch(self, hashes: Iterable[Hashable]) -> int:
        """Move the held ones of `hashes` to the end; how many were held."""
        n = 0
        for h in hashes:
            n += self.read(h)
        return n


class TieredPool:
    """A node pool's DRAM LRU and its disk tier (None: DRAM only) joined as NodePool joins
    them; each call returns the index changes the pool makes, in its order (`Change`)."""

    def __init__(self, dram: PoolLRU, disk: DiskLRU | None = None) -> None:
        self.dram = dram
        self.disk = disk

    def holds(self, h: Hashable) -> bool:
        """In either tier (a read of the node's own copy finds it)."""
        return h in self.dram or (self.disk is not None and h in self.disk)

    def put(self, h: Hashable) -> tuple[bool, list[Change]]:
        """A save (`NodePool.put`): (stored in DRAM, index changes). The evicted blocks are
        unpublished and handed to the disk before the new block is published."""
        stored, victims = self.dram.put(h)
        changes = self._retire(victims)
        if stored:
            changes.append((h, Medium.DRAM))
        return stored, changes

    def _retire(self, victims: list[Hashable]) -> list[Change]:
        """`NodePool._retire`: unpublish DRAM's victims, then offer each to the disk, whose
        copy is published (also one it held already); a block the disk drops for a slot is
        unpublished unless DRAM holds it (`NodePool._disk_evicted`)."""
        changes: list[Change] = [(v, None) for v in victims]
        if self.disk is None:
            return changes
        for v in victims:
            _, dropped = self.disk.offer(v)
            changes += [(d, None) for d in dropped if d not in self.dram]
            changes.append((v, Medium.DISK))
        return changes

    def touch(self, hashes: Iterable[Hashable]) -> int:
        """`NodePool.touch`: each block to the end of DRAM's LRU if held there, else of the
        disk's; how many either holds."""
        missed = []
        n = 0
        for h in hashes:
            if h in self.dram:
                n += self.dram.touch((h,))
            else:
                missed.append(h)
        if missed and self.disk is not None:
            n += self.disk.touch(missed)
        return n

    def read_own(self, h: Hashable) -> tuple[Medium | None, list[Change]]:
        """The node reads its own block (`NodePool.get` / `locate`): from DRAM (to the end of
        its LRU) or else from disk, then promoted into DRAM; (the tier read, None if neither
        holds it; index changes)."""
        if h in self.dram:
            self.dram.touch((h,))
            return Medium.DRAM, []
        return self._promote(h)

    def stage(self, h: Hashable) -> tuple[Medium | None, list[Change]]:
        """Another node reads `h` here (`TierReads.stage`, then a one-sided read): a DRAM
        copy is read as it is (its LRU untouched), a disk copy is promoted into DRAM first;
        (the tier read, None if neither holds it; index changes)."""
        if h in self.dram:
            return Medium.DRAM, []
        return self._promote(h)

    def _promote(self, h: Hashable) -> tuple[Medium | None, list[Change]]:
        """`TierReads.promote`: a disk read, then a put into DRAM."""
        if self.disk is None or not self.disk.read(h):
            return None, []
        _, changes = self.put(h)
        return Medium.DISK, changes
