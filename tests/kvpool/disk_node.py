"""A pool node with a disk tier in its own process, for kill -9 tests of the disk tier.

    python -m tests.kvpool.disk_node --metaserver HOST:PORT --node-id D --disk DIR \
        --dram-blocks 4 --disk-blocks 64 --blocks 24 --block-bytes 65536

Puts `--blocks` known blocks (most leave DRAM for the disk), waits until they are written and
published, prints READY, then puts more blocks without end (its disk writer stays busy) and
prints BUSY once the writer has written one of those; runs until killed.
"""
from __future__ import annotations

import argparse
import sys

from kvpool import NodePool, PoolConfig
from kvpool.disk import disk_slot_bytes
from kvpool.layout import slot_bytes_for
from metaserver.client import MetaClient
from tests.kvpool.hooks import put_bytes
from tests.kvpool.pool_node import block_content, block_hash


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--metaserver", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--disk", required=True)
    p.add_argument("--dram-blocks", type=int, default=4)
    p.add_argument("--disk-blocks", type=int, default=64)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--namespace", default="test-ns")
    p.add_argument("--lease-ttl-s", type=int, default=2)
    args = p.parse_args()
    bb = args.block_bytes
    config = PoolConfig(args.node_id, args.dram_blocks * slot_bytes_for(bb), bb, args.namespace, args.metaserver,
                        lease_ttl_s=args.lease_ttl_s, evict_batch=1, disk_dir=args.disk,
                        disk_size_bytes=args.disk_blocks * disk_slot_bytes(bb))
    pool = NodePool(config, MetaClient(args.metaserver))
    pool.start()
    assert pool.disk is not None
    for i in range(args.blocks):
        h = block_hash("chain", i)
        put_bytes(pool, h, block_content(h, bb))
    pool.disk.flush()
    pool.flush_publishes()
    print("READY", flush=True)
    written, i, busy = pool.stats.disk_writes, 0, False
    while True:  # until killed
        h = block_hash("busy", i)
        put_bytes(pool, h, block_content(h, bb))
        i += 1
        if not busy and pool.stats.disk_writes > written:
            busy = True
            print("BUSY", flush=True)


if __name__ == "__main__":
    sys.exit(main())
