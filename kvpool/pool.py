"""A node's share of the global KV pool: a DRAM buffer of block slots, published cluster-wide.

Where it sits: the connector puts newly computed blocks here and reads hit blocks through
`get()` into the engine's KV cache (through this node's read buffer: `kvpool.reader`). The buffer is registered with the
Mooncake Transfer Engine so other nodes read slots one-sidedly; the metaserver learns what
this node holds through batched Publish calls (`kvpool.publisher`).

Invariants:
- A slot is unpublished before it is reused: an evicted slot leaves the LRU at once, is
  unpublished (outside the lock) and only then freed. The Unpublish is sent only after any
  Publish of the same block that the publisher already found current was answered
  (`Publisher.wait_sent`), so it cannot overtake that Publish and leave the block indexed.
- Every read is validated against (hash, generation, checksum); a block the source evicted
  or overwrote meanwhile is reported failed, never handed on as good.

Disk tier (`kvpool.disk`, when configured): blocks evicted from DRAM are copied to the
tier's writer before their slot is freed; a block held only on disk is read from there
(validated) by `get` and `locate` and promoted back into DRAM. A tier that cannot start or
fails later is off; the pool goes on with DRAM only. The index learns of each block once,
with its medium: a block in DRAM is published as DRAM (also when a disk copy exists); one
that left DRAM for the disk as DISK, and unpublished when it leaves the disk. A pool
started on a disk directory it used before publishes the valid blocks found there.
Another node's DISK copy is never read one-sidedly: its holder stages it into DRAM on
request first (`kvpool.stage`; the pool serves those requests when it has a disk tier).

Threading: every public method is thread-safe; `self._lock` guards the slot tables.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvpool.config import PoolConfig
from kvpool.errors import PoolError
from kvpool.disk import DiskBlock, DiskError, DiskIdentity, DiskTier
from kvpool.layout import HEADER_BYTES, MAGIC, CallerMemory, Payload, SlotHeader, checksum, slot_bytes_for, view
from kvpool.publisher import Publisher
from kvpool.reader import Landing, Peers, ReadContext, ReadHandle
from kvpool.stage import StageServer
from kvpool.stats import PoolStats
from kvpool.tier_reads import TierReads
from kvpool.transfer import TransferEngine
from metaserver.client import MetaClient, NodeSession
from metaserver.errors import MetaError
from metaserver.types import BlockHash, BlockLocation, BlockRecord, Medium, Namespace, NodeId, NodeRecord

log = logging.getLogger(__name__)

UNPUBLISH_BATCH = 4096  # hashes per Unpublish RPC (the metaserver's default limit is 8192)
READ_SLOTS_MIN = 64  # read-buffer slots of even a small pool (the buffer's pages are mapped as used)


@dataclass(slots=True)
class _Slot:
    index: int
    generation: int = 0
    block_hash: BlockHash | None = None


class NodePool:
    def __init__(self, config: PoolConfig, client: MetaClient | None = None) -> None:
        self.config = config
        self.slot_bytes = slot_bytes_for(config.block_bytes)
        self.num_slots = config.pool_size_bytes // self.slot_bytes
        self._mem = mmap.mmap(-1, self.num_slots * self.slot_bytes)  # page-aligned, zeroed
        self._buf = np.frombuffer(self._mem, dtype=np.uint8)
        self.buffer_address = self._buf.ctypes.data
        self.capacity_bytes = self._buf.nbytes
        self.te = TransferEngine(config.transfer)
        self.te.register(self.buffer_address, self.capacity_bytes)
        self.stats = PoolStats()
        # Remote blocks land here before the copy to their destination (kvpool.reader): a
        # quarter of the pool's slots, at least READ_SLOTS_MIN, at most max_read_blocks.
        landing = Landing(self.te, min(config.max_read_blocks, max(READ_SLOTS_MIN, self.num_slots // 4)),
                          self.slot_bytes, self.stats)
        # Threads that wait (GIL released) for transfer batches to complete.
        self._completer = ThreadPoolExecutor(4, thread_name_prefix=f"read-{config.node_id}")
        # Threads for reads that wait on a disk or a stage request (kept off the completer,
        # whose threads such a read may itself wait on).
        self._slow_reads = ThreadPoolExecutor(2, thread_name_prefix=f"disk-read-{config.node_id}")
        self._stager: StageServer | None = None
        self._unregistered = False  # close() ended the registration: nothing left to unpublish
        self._lock = threading.Lock()
        self._slots = [_Slot(i) for i in range(self.num_slots)]
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._writing: set[BlockHash] = set()  # blocks being copied in by `put` (their slots taken)
        self._lru: OrderedDict[BlockHash, _Slot] = OrderedDict()  # oldest first
        self._reads = ReadContext(self.te, self._completer, landing, Peers(self.te, landing), self.stats,
                                  config.read_timeout_s)
        self.client = client
        self._publisher: Publisher | None = None
        self._session: NodeSession | None = None
        # Blocks whose Unpublish failed (the metaserver unreachable): sent again before the
        # session next re-publishes, unless held again by then (`_retry_unpublishes`).
        self._lost_unpublishes: set[BlockHash] = set()
        self._lost_lock = threading.Lock()
        self.disk = self._open_disk() if config.disk_enabled else None
        self._tiers = TierReads(config, self.disk, self.stats, self._reads, self.put, self._dram_record)

    def _open_disk(self) -> DiskTier | None:
        cfg = self.config
        t0 = time.monotonic()
        try:
            tier = DiskTier(cfg.disk_dir, cfg.disk_size_bytes,
                            DiskIdentity(cfg.node_id, cfg.layout_fingerprint, cfg.block_bytes), self.stats,
                            queue_blocks=cfg.disk_staging_blocks, on_written=self._disk_written,
                            on_evicted=self._disk_evicted)
        except DiskError as err:
            log.error("node %s: no disk tier, DRAM only: %s", cfg.node_id, err)
            return None
        log.info("node %s: disk tier %s opened: %d of %d slots hold valid blocks (scanned in %.2f s)", cfg.node_id,
                 cfg.disk_dir, len(tier), tier.num_slots, time.monotonic() - t0)
        return tier

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Register with the metaserver and start publishing (no-op without a client)."""
        if self.client is None:
            return
        if self.disk is not None:
            # On the address peers reach this node's transfer engine at (127.0.0.1 on one
            # machine): a reader on another host must reach this node, not its own loopback.
            self._stager = StageServer(self._tiers.stage, host=self.config.transfer.local_hostname,
                                       io_timeout_s=self.config.read_timeout_s)
        self._session = NodeSession(self.client, self.config.node_id, self.te.session_id, self.buffer_address,
                                    self.capacity_bytes, self.config.layout_fingerprint, self._holdings,
                                    self.config.lease_ttl_s, api_url=self.config.api_url,
                                    stage_address=self._stager.address if self._stager is not None else "",
                                    on_published=self._count_published,
                                    before_publishing=self._retry_unpublishes)
        self._publisher = Publisher(self.client, self.config, self._is_current, self.stats,
                                    on_failure=self._session.resync)
        self._session.start()
        self._publisher.start()

    def _count_published(self, n: int) -> None:
        """The session re-published n held records (after a failed publish or an outage)."""
        self.stats.published += n

    def close(self) -> None:
        """Unregister from the metaserver, unregister all memory. Idempotent."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None
        if self._session is not None:
            self._session.stop(unregister=True)
            self._session = None
            self._unregistered = True  # (the index dropped every block of the node)
        self._slow_reads.shutdown(wait=True)
        self._completer.shutdown(wait=True)
        if self.disk is not None:
            if self.config.disk_save_on_close:
                self._save_to_disk()
            self.disk.close()
        self.te.close()

    def __enter__(self) -> NodePool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush_publishes(self, timeout_s: float = 10.0) -> bool:
        """Wait until every block put so far was sent to the metaserver."""
        return self._publisher is None or self._publisher.flush(timeout_s)

    @property
    def publishing(self) -> bool:
        """Blocks put but not yet sent to the metaserver."""
        return self._publisher is not None and not self._publisher.idle

    @property
    def node_id(self) -> NodeId:
        return NodeId(self.config.node_id)

    def size_read_buffer(self, num_slots: int) -> None:
        """At least `num_slots` read-buffer slots (a host passes its KV cache's blocks: a load
        never reads more blocks than the cache has, so every load in flight fits). Call
        before the first read; PoolError after one."""
        old = self._reads.landing
        if num_slots <= old.num_slots:
            return
        if not old.idle:
            raise PoolError("the read buffer is sized before the first read")
        new = Landing(self.te, min(num_slots, self.config.max_read_blocks), self.slot_bytes, self.stats)
        self._reads.landing = self._reads.peers.landing = new
        self.te.unregister(old.addr)

    def host_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the host memory blocks are copied out of into a caller's memory:
        the DRAM slots and the read buffer (a GPU host pins them: `connector.device_memory`).
        After `size_read_buffer`."""
        landing = self._reads.landing
        return [(self.buffer_address, self.capacity_bytes),
                (landing.addr, landing.num_slots * landing.slot_bytes)]

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Register caller memory (the engine's KV cache) as a read destination."""
        self.te.register(addr, nbytes)

    def unregister_memory(self, addr: int) -> None:
        self.te.unregister(addr)

    # ---- slots ----------------------------------------------------------------------

    def _slot_addr(self, slot: _Slot) -> int:
        return self.buffer_address + slot.index * self.slot_bytes

    def _record(self, slot: _Slot) -> BlockRecord:
        assert slot.block_hash is not None
        return BlockRecord(slot.block_hash, slot.index * self.slot_bytes, HEADER_BYTES + self.config.block_bytes,
                           slot.generation)

    def _disk_record(self, block: DiskBlock) -> BlockRecord:
        return BlockRecord(block.block_hash, block.offset, HEADER_BYTES + self.config.block_bytes, block.generation,
                           Medium.DISK)

    def _dram_record(self, block_hash: BlockHash) -> BlockRecord | None:
        with self._lock:
            slot = self._lru.get(block_hash)
            return self._record(slot) if slot is not None else None

    def _in_dram(self, block_hash: BlockHash) -> bool:
        """Under the lock: held in DRAM or being copied in (then published as DRAM)."""
        return block_hash in self._lru or block_hash in self._writing

    def _holdings(self) -> list[BlockRecord]:
        on_disk = self.disk.blocks() if self.disk is not None else []
        with self._lock:
            return ([self._record(s) for s in self._lru.values()]
                    + [self._disk_record(b) for b in on_disk if not self._in_dram(b.block_hash)])

    def num_held(self) -> int:
        """Blocks this node holds as the index should list them: in DRAM, or only on its disk
        tier (what `kvpool bench soak` and `chaos` compare with the index): `_holdings`
        counted, without building its records (every /stats and /metrics scrape asks)."""
        on_disk = self.disk.blocks() if self.disk is not None else []
        with self._lock:
            return len(self._lru) + sum(not self._in_dram(b.block_hash) for b in on_disk)

    def _is_current(self, rec: BlockRecord) -> bool:
        if rec.medium == Medium.DISK:
            if self.disk is None or not self.disk.holds(rec.block_hash, rec.generation):
                return False
            with self._lock:
                return not self._in_dram(rec.block_hash)
        with self._lock:
            slot = self._lru.get(rec.block_hash)
            return slot is not None and slot.generation == rec.generation

    def locate(self, hashes: Sequence[bytes]) -> list[BlockRecord]:
        """Where this pool holds the leading blocks of `hashes` (up to the first it does
        not hold), as records to read them by; each is marked recently used."""
        out = []
        for h in hashes:
            with self._lock:
                slot = self._lru.get(BlockHash(h))
                if slot is not None:
                    self._lru.move_to_end(slot.block_hash)
                    out.append(self._record(slot))
                    continue
            if not self._tiers.promote(BlockHash(bytes(h))):  # a disk block comes back into DRAM
                break
            with self._lock:
                slot = self._lru.get(BlockHash(h))
                if slot is None:  # evicted again at once (a tiny pool): not held
                    break
                out.append(self._record(slot))
        return out

    def touch(self, hashes: Sequence[bytes]) -> int:
        """Mark the blocks of `hashes` this pool holds as recently used (a use the pool did
        not see: a local hit in the engine's own cache), in DRAM or else on its disk tier;
        returns how many it holds."""
        n = 0
        missed = []
        with self._lock:
            lru = self._lru
            for h in hashes:
                if h in lru:
                    lru.move_to_end(BlockHash(h))
                    n += 1
                else:
                    missed.append(h)
        if missed and self.disk is not None:
            n += self.disk.touch(missed)
        return n

    def node_record(self) -> NodeRecord:
        """This node as a reader needs it (no lease: not from the registry)."""
        return NodeRecord(self.node_id, self.te.session_id, self.buffer_address, self.capacity_bytes,
                          Namespace(self.config.layout_fingerprint), 0, 0)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def _take_victims(self) -> list[_Slot]:
        """Under the lock: take up to evict_batch LRU slots out of the LRU (no longer offered
        locally, not yet free). `_retire` unpublishes and frees them."""
        victims = []
        while self._lru and len(victims) < self.config.evict_batch:
            victims.append(self._lru.popitem(last=False)[1])
        return victims

    def _retire(self, victims: list[_Slot]) -> None:
        """Unpublish evicted slots, hand them to the disk tier (which copies them), then free
        them. Called without the lock: the RPC must not hold up reads and other puts (with the
        metaserver frozen it lasts a whole deadline)."""
        hashes = [s.block_hash for s in victims if s.block_hash is not None]
        self._unpublish(hashes, "evicted")
        if self.disk is not None:  # after the unpublish: the disk copy's publish must come later
            for slot in victims:
                if slot.block_hash is not None:
                    self.disk.offer(slot.block_hash, self._slot_addr(slot))
        with self._lock:
            for slot in victims:
                slot.block_hash = None
                self._free.append(slot.index)
            self.stats.evictions += len(victims)

    def _unpublish(self, hashes: list[BlockHash], why: str) -> None:
        if self.client is None or self._unregistered:
            return
        publisher = self._publisher
        if publisher is not None:  # not before a Publish of these blocks that passed its check
            publisher.wait_sent(hashes)
        # In batches the metaserver takes (a disk tier that turns off drops all it held at once).
        for i in range(0, len(hashes), UNPUBLISH_BATCH):
            part = hashes[i:i + UNPUBLISH_BATCH]
            try:
                self.stats.unpublished += self.client.unpublish(self.config.node_id, part)
            except MetaError as err:
                # Readers still validate the generation, so a stale entry only costs a miss
                # until the session sends it again (`_retry_unpublishes`, after its next keepalive).
                log.warning("node %s: unpublish of %d %s blocks failed: %s", self.config.node_id, len(part), why, err)
                with self._lost_lock:
                    self._lost_unpublishes.update(part)
                session = self._session
                if session is not None:
                    session.resync()

    def _retry_unpublishes(self) -> None:
        """Before the session re-publishes this node's holdings (after an outage, or a new
        registration): send again the Unpublishes that failed, for the blocks not held again
        since (re-publishing adds entries, it never removes one). Raises MetaError (the session
        retries after its next keepalive; the blocks stay to send)."""
        with self._lost_lock:
            lost, self._lost_unpublishes = self._lost_unpublishes, set()
        if not lost:
            return
        publisher = self._publisher
        if publisher is not None:
            publisher.wait_sent(lost)
        on_disk = self.disk.blocks() if self.disk is not None else []
        with self._lock:
            held = set(self._lru) | {b.block_hash for b in on_disk}
        gone = [h for h in lost if h not in held]
        try:
            for i in range(0, len(gone), UNPUBLISH_BATCH):
                self.stats.unpublished += self.client.unpublish(self.config.node_id, gone[i:i + UNPUBLISH_BATCH])
        except MetaError:
            with self._lost_lock:
                self._lost_unpublishes.update(gone)
            raise

    # ---- disk tier ------------------------------------------------------------------

    def _save_to_disk(self) -> None:
        """At close: write the blocks still in DRAM to the disk tier (oldest first, so the
        disk's LRU order follows DRAM's), so a restart on this directory finds them too. Only
        blocks leaving DRAM go to disk while the pool runs (write-on-evict, kvpool.disk).
        Bounded by `disk_save_timeout_s` in all: a slow or stuck disk does not hold up the
        shutdown (what is not written by then is lost, as after a kill)."""
        assert self.disk is not None
        with self._lock:
            held = [(s.block_hash, self._slot_addr(s)) for s in self._lru.values() if s.block_hash is not None]
        deadline = time.monotonic() + self.config.disk_save_timeout_s
        offered = 0
        for h, addr in held:  # nothing reuses the slots now: the pool is closing
            left = deadline - time.monotonic()
            if not self.disk.enabled or left <= 0:
                break
            self.disk.offer(h, addr, wait_s=left)
            offered += 1
        done = self.disk.flush(max(deadline - time.monotonic(), 0.0))
        log.info("node %s: %d of %d DRAM blocks offered to the disk tier at close%s (%d there now)",
                 self.config.node_id, offered, len(held), "" if done else ", not all written in time",
                 len(self.disk))

    def _disk_written(self, block: DiskBlock) -> None:
        """The disk writer stored a block (or found it stored) after it left DRAM: publish the
        disk copy (the publisher drops it if the block is back in DRAM by then)."""
        if self._publisher is not None:
            self._publisher.enqueue(self._disk_record(block))

    def _disk_evicted(self, hashes: list[BlockHash]) -> None:
        """Blocks left the disk tier (reused slots, failed reads, the tier turned off):
        unpublish those the node does not hold in DRAM either, before the disk slot is reused."""
        with self._lock:
            gone = [h for h in hashes if not self._in_dram(h)]
        self._unpublish(gone, "disk-evicted")

    def use_caller_memory(self, memory: CallerMemory) -> None:
        """Where callers' payload addresses point (host memory unless told: a KV cache on a GPU
        gives `connector.device_memory.CudaMemory`). Set before the first read or put."""
        self._reads.memory = memory

    def put(self, block_hash: bytes, src_addr: Payload, nbytes: int) -> bool:
        """Copy a block from `src_addr` (one address, or equal segments in order) into a slot
        and queue its publication.

        Returns False (and copies nothing) if the block is already held. Evicts LRU slots
        when the pool is full. Raises PoolError if the block does not fit a slot.
        """
        if nbytes != self.config.block_bytes:
            raise PoolError(f"block of {nbytes} bytes does not match the pool's {self.config.block_bytes}-byte slots")
        if len(block_hash) != 32:
            raise PoolError(f"block hash must be 32 bytes, got {len(block_hash)}")
        h = BlockHash(bytes(block_hash))
        while True:
            with self._lock:
                if h in self._lru:
                    self._lru.move_to_end(h)
                    return False
                if h in self._writing:  # another thread is copying it in
                    return False
                if self._free:
                    slot = self._slots[self._free.pop()]
                    slot.generation += 1
                    slot.block_hash = h
                    self._writing.add(h)  # neither free nor in the LRU: nothing reuses the slot meanwhile
                    base = self._slot_addr(slot)
                    hdr = view(base, HEADER_BYTES)
                    hdr[:4] = b"\0\0\0\0"  # not valid while being written
                    break
                victims = self._take_victims()
                if not victims:
                    raise PoolError("every slot of the pool is being written; no room for another block")
            self._retire(victims)  # then try again: another put may have taken the freed slots
        # The copy and its checksum outside the lock: a saver thread must not hold up reads.
        self._reads.memory.read(base + HEADER_BYTES, src_addr, nbytes)
        header = SlotHeader(MAGIC, slot.generation, nbytes, checksum(base + HEADER_BYTES, nbytes), h).pack()
        with self._lock:
            hdr[:] = header
            self._writing.discard(h)
            self._lru[h] = slot
            self.stats.puts += 1
            record = self._record(slot)
        if self._publisher is not None:
            self._publisher.enqueue(record)
        return True

    # ---- reads ----------------------------------------------------------------------

    def get(self, locations: Sequence[BlockLocation], nodes: dict[NodeId, NodeRecord],
            dest_addrs: Sequence[Payload], on_progress: Callable[[], None] | None = None) -> ReadHandle:
        """Read each located block's payload to its destination (one address, or the addresses
        of equal segments, e.g. one per layer); returns a pollable handle.

        Blocks in this node's pool are copied at once; the rest are read with one transfer
        batch per source node into this node's read buffer, validated there and copied to
        their destinations by the handle (`kvpool.reader`): a destination is never written
        by a transfer, so a failed one cannot touch it. `on_progress` is called (on any
        thread) whenever a transfer batch of the read finishes, so a caller can wait on an
        event instead of polling; `done()` then settles the read. Raises PoolError for bad
        arguments; read failures are reported by the handle as failed block indices.

        Blocks this node holds only on its disk tier, and other nodes' DISK blocks (which
        their holder stages into DRAM first, `kvpool.stage`), are read on a pool thread; the
        handle reports them when that read has returned (another node's DISK block whose
        holder does not stage is reported failed at once).
        """
        if len(locations) != len(dest_addrs):
            raise PoolError(f"{len(locations)} locations but {len(dest_addrs)} destinations")
        n = self.config.block_bytes
        for i, dst in enumerate(dest_addrs):
            if not isinstance(dst, int) and (not dst or n % len(dst)):
                raise PoolError(f"destination #{i}: {len(dst)} segments do not split a {n}-byte block evenly")
        me, slot_bytes = self.config.node_id, HEADER_BYTES + n
        local: list[int] = []
        remote: dict[NodeId, list[int]] = {}  # source node -> the request's indices on it
        unreadable: list[int] = []  # another node's disk blocks it does not stage
        staged: dict[NodeId, list[int]] = {}  # another node's disk blocks it stages first
        for i, loc in enumerate(locations):
            node_id = loc.node_id
            if node_id == me:
                local.append(i)
            elif loc.medium != Medium.DRAM:
                if node_id in nodes and nodes[node_id].stage_address:
                    staged.setdefault(node_id, []).append(i)
                else:
                    unreadable.append(i)
            elif node_id in nodes:
                on_node = remote.get(node_id)
                if on_node is None:
                    remote[node_id] = [i]
                else:
                    on_node.append(i)
            else:
                raise PoolError(f"block #{i} is on unknown node {node_id!r}")
            if loc.size_bytes != slot_bytes:
                raise PoolError(f"block #{i} is {loc.size_bytes} bytes; this pool's slots are {slot_bytes}")
        local_ok, missed = self._read_local(locations, dest_addrs, local) if local else (set(), [])
        if self.disk is None:
            unreadable += missed
            missed = []
        deferred, deferred_idx = None, missed + [i for idx in staged.values() for i in idx]
        if deferred_idx:  # on a pool thread: the caller may be the engine loop
            deferred = self._slow_reads.submit(self._tiers.read, locations, dest_addrs, missed,
                                               [(nodes[k], idx) for k, idx in staged.items()])
        self.stats.failed_reads += len(unreadable)
        return ReadHandle(self._reads, locations, dest_addrs, n, [(nodes[k], idx) for k, idx in remote.items()],
                          local_ok, unreadable, on_progress=on_progress, deferred=deferred,
                          deferred_idx=deferred_idx)

    def _read_local(self, locations: Sequence[BlockLocation], dest_addrs: Sequence[Payload],
                    idx: list[int]) -> tuple[set[int], list[int]]:
        """Copy this node's blocks whose DRAM slot still holds the located generation to their
        destinations; returns those indices and the others (for the disk tier, `TierReads`)."""
        n = self.config.block_bytes
        ok = set()
        missed = []
        with self._lock:
            for i in idx:
                loc = locations[i]
                slot = self._lru.get(loc.block_hash)
                if slot is None or slot.generation != loc.generation:
                    missed.append(i)
                    continue
                self._reads.memory.write(dest_addrs[i], self._slot_addr(slot) + HEADER_BYTES, n)
                self._lru.move_to_end(loc.block_hash)
                ok.add(i)
        self.stats.local_hits += len(ok)
        self.stats.bytes_read += len(ok) * n
        return ok, missed
