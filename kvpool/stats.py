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
    published: int = 0        # records acknowledged by the metaserver
    unpublished: int = 0
