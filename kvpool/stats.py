"""The node pool's counters, shared by the pool, its reader and its publisher."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolStats:
    puts: int = 0             # blocks written into slots
    evictions: int = 0        # slots freed by LRU
    local_hits: int = 0       # blocks read from this node's own pool
    remote_hits: int = 0      # blocks read from other nodes and validated
    failed_reads: int = 0     # blocks whose read failed or did not validate
    bytes_read: int = 0       # payload bytes delivered by get()
    quarantined_slots: int = 0  # read-buffer slots lost to failed transfers (see kvpool.reader)
    published: int = 0        # records acknowledged by the metaserver (re-publications included)
    unpublished: int = 0
    unpublish_waits: int = 0  # unpublishes held until a publish of the same blocks was answered
    # The disk tier (kvpool.disk); all stay 0 / False without one.
    disk_enabled: bool = False  # the tier is on (turns False after an I/O error)
    disk_blocks: int = 0        # blocks held on disk now
    disk_writes: int = 0        # blocks written to disk (evicted from DRAM)
    disk_hits: int = 0          # blocks read from disk and validated
    disk_failed_reads: int = 0  # disk reads that did not validate (torn, stale, foreign slots)
    disk_evictions: int = 0     # disk slots reused by LRU
    disk_errors: int = 0        # I/O errors (each turns the tier off)
    disk_dropped_writes: int = 0  # evicted blocks not written: the writer's queue was full
    disk_staged: int = 0        # disk blocks promoted into DRAM for other nodes' reads (kvpool.stage)
