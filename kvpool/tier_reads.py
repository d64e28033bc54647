"""Reads that wait on a disk or on another node, run off the caller's thread.

Where it sits: `NodePool.get` copies DRAM hits at once and hands the blocks it cannot read
from registered memory here, on a pool thread (its caller is usually the engine loop):
- this node's blocks held only on its disk tier: read and validated by the tier
  (`DiskTier.read_into`), then promoted back into DRAM (a `put`);
- other nodes' DISK blocks: their holder stages them into its DRAM (`kvpool.stage`), then
  they are read as any remote DRAM block, validated against the holder's answer.
The holder's side of staging (`stage`) and promotion (`promote`, also for `locate`) are here
too. A block whose read fails or does not validate is reported failed (recomputed).

Threading: every method may run on any thread (stage requests one at a time); what it touches (the pool through `put` and
`dram_record`, the disk tier, the read context) is thread-safe.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.config import PoolConfig
from kvpool.disk import DiskTier
from kvpool.errors import PoolError
from kvpool.layout import HEADER_BYTES, Payload
from kvpool.reader import ReadContext, ReadHandle
from kvpool.stage import MAX_BLOCKS as STAGE_MAX_BLOCKS
from kvpool.stage import StageError, stage
from kvpool.stats import PoolStats
from metaserver.types import BlockHash, BlockLocation, BlockRecord, NodeRecord

log = logging.getLogger(__name__)

PutFn = Callable[[bytes, Payload, int], bool]          # NodePool.put
DramRecordFn = Callable[[BlockHash], BlockRecord | None]  # where DRAM holds a block now, if it does


class TierReads:
    def __init__(self, config: PoolConfig, disk: DiskTier | None, stats: PoolStats, reads: ReadContext,
                 put: PutFn, dram_record: DramRecordFn) -> None:
        self._config = config
        self._disk = disk
        self._stats = stats
        self._reads = reads
        self._put = put
        self._dram_record = dram_record
        # One stage request at a time: a reader's load that asks for blocks a prefetch of the
        # same blocks (connector.prefetch) is promoting waits for it and finds them in DRAM,
        # instead of answering "not staged" while the other thread still copies them in.
        self._staging = threading.Lock()

    def _put_back(self, block_hash: BlockHash, src: Payload) -> bool:
        """Promote a block read from disk into DRAM (the next hit is a DRAM one)."""
        try:
            self._put(block_hash, src, self._config.block_bytes)
        except PoolError as err:  # every DRAM slot is being written: served from disk only
            log.warning("node %s: disk block not promoted: %s", self._config.node_id, err)
            return False
        return True

    def promote(self, block_hash: BlockHash) -> bool:
        """Read a block held only on disk back into a DRAM slot (validated); False if it is
        not on disk, did not validate, or found no DRAM slot."""
        if self._disk is None:
            return False
        tmp = np.empty(self._config.block_bytes, dtype=np.uint8)
        if not self._disk.read_into(block_hash, tmp.ctypes.data):
            return False
        self._stats.bytes_read += tmp.nbytes
        return self._put_back(block_hash, tmp.ctypes.data)

    def stage(self, hashes: list[bytes]) -> list[tuple[int, int] | None]:
        """A reader's stage request (kvpool.stage, on a server thread): bring each block into
        DRAM (from the disk tier if need be) and say where it is now."""
        out: list[tuple[int, int] | None] = []
        with self._staging:
            for raw in hashes:
                h = BlockHash(raw)
                rec = self._dram_record(h)
                if rec is None and self.promote(h):
                    self._stats.disk_staged += 1
                    rec = self._dram_record(h)
                out.append(None if rec is None else (rec.offset, rec.generation))
        return out

    def read(self, locations: Sequence[BlockLocation], dest_addrs: Sequence[Payload], on_disk: list[int],
             staged: list[tuple[NodeRecord, list[int]]]) -> set[int]:
        """Blocks `on_disk` from this node's disk tier, and per node the blocks it stages;
        returns the indices delivered (validated, copied to their destinations)."""
        ok = self._read_disk(locations, dest_addrs, on_disk) if on_disk else set()
        for node, idx in staged:
            ok |= self._read_staged(node, locations, dest_addrs, idx)
        return ok

    def _read_disk(self, locations: Sequence[BlockLocation], dest_addrs: Sequence[Payload], idx: list[int]) -> set[int]:
        assert self._disk is not None
        n, ok = self._config.block_bytes, set()
        for i in idx:
            # Content is named by its hash: any copy that validates is the block asked for.
            h = locations[i].block_hash
            if self._disk.read_into(h, dest_addrs[i], self._reads.memory):
                ok.add(i)
                self._put_back(h, dest_addrs[i])
        self._stats.bytes_read += len(ok) * n
        self._stats.failed_reads += len(idx) - len(ok)
        return ok

    def _read_staged(self, node: NodeRecord, locations: Sequence[BlockLocation], dest_addrs: Sequence[Payload],
                     idx: list[int]) -> set[int]:
        """Have `node` stage its disk blocks `idx` into DRAM (no answer within half the read
        timeout: all fail), then read them from there as remote DRAM blocks."""
        n = self._config.block_bytes
        answers: list[tuple[int, int] | None] = []
        try:
            for k in range(0, len(idx), STAGE_MAX_BLOCKS):
                answers += stage(node.stage_address, [locations[i].block_hash for i in idx[k:k + STAGE_MAX_BLOCKS]],
                                 self._config.read_timeout_s / 2)
        except StageError as err:
            log.warning("node %s: %d disk blocks of %s not staged: %s", self._config.node_id, len(idx), node.node_id,
                        err)
            self._stats.failed_reads += len(idx)
            return set()
        got = [(i, a) for i, a in zip(idx, answers) if a is not None]
        self._stats.failed_reads += len(idx) - len(got)
        if not got:
            return set()
        locs = [BlockLocation(locations[i].block_hash, node.node_id, offset, HEADER_BYTES + n, generation)
                for i, (offset, generation) in got]
        res = ReadHandle(self._reads, locs, [dest_addrs[i] for i, _ in got], n,
                         [(node, list(range(len(got))))]).wait()
        return {got[j][0] for j in res.ok}
