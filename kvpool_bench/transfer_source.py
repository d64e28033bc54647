"""The source side of `kvpool bench transfer`, run as its own process.

For each block size it fills a NodePool (published to the metaserver) with random blocks,
serves the same bytes over a raw TCP socket (the loopback limit without any engine), and,
if a Mooncake master is given, puts the same blocks into Mooncake Store. Prints one JSON
line with what the reader needs, then serves until SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import threading

import numpy as np

from kvpool import NodePool, PoolConfig, slot_bytes_for
from metaserver.client import MetaClient


def block_hash(size: int, i: int) -> bytes:
    return size.to_bytes(8, "big") + i.to_bytes(8, "big") + b"\x5a" * 16


def serve_tcp(sock: socket.socket, data: np.ndarray) -> None:
    """Each request is an 8-byte length; the answer is that many bytes of `data`."""
    view = memoryview(data)
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def handle(c: socket.socket) -> None:
            with c:
                while True:
                    hdr = c.recv(8, socket.MSG_WAITALL)
                    if len(hdr) < 8:
                        return
                    (n,) = struct.unpack("<Q", hdr)
                    c.sendall(view[:n])

        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--metaserver", required=True)
    p.add_argument("--sizes", required=True, help="block sizes in bytes, comma-separated")
    p.add_argument("--blocks", required=True, help="blocks per size, comma-separated")
    p.add_argument("--store-master", default="", help="Mooncake master HOST:PORT ('' = no Store)")
    p.add_argument("--store-metadata", default="")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(s) for s in args.blocks.split(",")]
    rng = np.random.default_rng(0)
    pools, out = [], {"tcp_port": 0, "store": bool(args.store_master)}
    biggest = max(s * n for s, n in zip(sizes, counts))
    data = rng.integers(0, 255, size=biggest, dtype=np.uint8)
    store = None
    if args.store_master:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        # Twice the data: the master evicts objects above its high watermark.
        rc = store.setup("127.0.0.1", args.store_metadata, 2 * sum(s * n for s, n in zip(sizes, counts)) + (256 << 20),
                         64 << 20, "tcp", "", args.store_master)
        if rc != 0:
            print(f"error: Mooncake Store setup returned {rc}", file=sys.stderr)
            return 1
        store.register_buffer(data.ctypes.data, data.nbytes)
    for size, n in zip(sizes, counts):
        cfg = PoolConfig(f"src-{size}", n * slot_bytes_for(size), size, f"bench-{size}", args.metaserver,
                         publish_batch=1024)
        pool = NodePool(cfg, MetaClient(args.metaserver))
        pool.start()
        for i in range(n):
            pool.put(block_hash(size, i), data.ctypes.data + i * size, size)
        pool.flush_publishes()
        pools.append(pool)
        if store is not None:
            keys = [f"b{size}-{i}" for i in range(n)]
            rcs = store.batch_put_from(keys, [data.ctypes.data + i * size for i in range(n)], [size] * n)
            if any(rc != 0 for rc in rcs):
                print(f"error: Mooncake Store put returned {set(rcs)}", file=sys.stderr)
                return 1
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    out["tcp_port"] = sock.getsockname()[1]
    threading.Thread(target=serve_tcp, args=(sock, data), daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(json.dumps(out), flush=True)
    stop.wait()
    sock.close()
    for pool in pools:
        pool.close()
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
