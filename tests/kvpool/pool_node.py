"""A pool node in its own process for tests: fills blocks with known bytes, then serves.

    python -m tests.kvpool.pool_node --metaserver HOST:PORT --node-id A --blocks 8 --block-bytes 65536

Prints READY once its blocks are published; runs until SIGTERM (clean) or SIGKILL.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

import numpy as np

from kvpool import NodePool, PoolConfig
from metaserver.client import MetaClient
from tests.kvpool.hooks import put_bytes


def block_hash(node_seed: str, i: int) -> bytes:
    import hashlib

    return hashlib.sha256(f"{node_seed}/{i}".encode()).digest()


def block_content(h: bytes, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(nbytes), dtype=np.uint8)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--metaserver", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--namespace", default="test-ns")
    p.add_argument("--seed", default="chain")
    args = p.parse_args()
    config = PoolConfig(args.node_id, (args.blocks + 2) * (args.block_bytes + 64), args.block_bytes, args.namespace,
                        args.metaserver)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with NodePool(config, MetaClient(args.metaserver)) as pool:
        for i in range(args.blocks):
            h = block_hash(args.seed, i)
            put_bytes(pool, h, block_content(h, args.block_bytes))
        pool.flush_publishes()
        print("READY", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
