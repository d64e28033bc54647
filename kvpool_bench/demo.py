"""`kvpool demo` (`make demo`): the main job, for now the metadata service end to end.

Starts a real etcd and two metaserver replicas on loopback (logs in --run-dir), registers two
engine nodes that publish the blocks of a shared prompt prefix, and shows what an engine
would see: a prefix query answered by the other replica, the admin tables, invalidation and
a node's lease running out. Then a short `kvpool bench metaserver`. Everything it started
is stopped by PID at the end. (The engine, node pool and cross-node benchmark take this
place once they land.)
"""
from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

from kvpool_bench import metaserver_bench
from metaserver import admin
from metaserver.client import MetaClient, NodeSession
from metaserver.launch import EtcdProcess, MetaserverProcess
from metaserver.types import BlockHash, BlockRecord

NS = "SmolLM2-135M|bf16|block16|L30|kv3|hd64"
BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 2  # K and V, 30 layers, 3 KV heads, head_dim 64, 16 tokens, bf16


def chain(prompt_tokens: list[int], block_size: int = 16) -> list[BlockHash]:
    """Chained block hashes, as the engine computes them: h_i = H(h_{i-1}, tokens_i)."""
    out, prev = [], hashlib.sha256(NS.encode()).digest()
    for i in range(0, len(prompt_tokens) - block_size + 1, block_size):
        prev = hashlib.sha256(prev + bytes(str(prompt_tokens[i:i + block_size]), "ascii")).digest()
        out.append(BlockHash(prev))
    return out


def show(title: str, address: str, *argv: str) -> None:
    print(f"\n$ kvpool admin --metaserver {address} {' '.join(argv)}   # {title}")
    parser = argparse.ArgumentParser()
    admin.add_parser(parser.add_subparsers(dest="cmd"))
    admin.main(parser.parse_args(["admin", "--metaserver", address, *argv]))


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    system_prompt = list(range(1000, 1000 + 512))  # a 512-token shared prefix: 32 blocks
    hashes = chain(system_prompt)
    with EtcdProcess(run_dir / f"etcd-{int(time.time())}") as etcd, \
            MetaserverProcess(etcd.endpoint, run_dir / "metaserver-a.log") as a, \
            MetaserverProcess(etcd.endpoint, run_dir / "metaserver-b.log") as b:
        print(f"etcd {etcd.endpoint} (pid {etcd.proc.pid}); metaserver replicas {a.address}, {b.address}")
        with MetaClient([a.address, b.address]) as ca, MetaClient(b.address) as cb:
            held = [BlockRecord(h, i * BLOCK_BYTES, BLOCK_BYTES, 1) for i, h in enumerate(hashes)]
            node_a = NodeSession(ca, "node-a", "127.0.0.1:17001", 0x7F0000000000, 4 << 30, NS, lambda: held,
                                 lease_ttl_s=5)
            node_b = NodeSession(cb, "node-b", "127.0.0.1:17002", 0x7F8000000000, 4 << 30, NS, lambda: [],
                                 lease_ttl_s=2)
            node_a.start()
            node_b.start()
            t0 = time.perf_counter()
            while cb.query_prefix(NS, hashes).num_matched < len(hashes):
                time.sleep(0.001)
            print(f"node-a published {len(hashes)} blocks via replica A; replica B answers after "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
            r = cb.query_prefix(NS, hashes + chain(list(range(5000, 5032))), requester_node_id="node-b")
            print(f"node-b asks for a 34-block chain: {r.num_matched} blocks hit, all on "
                  f"{sorted(r.nodes)} (read {r.num_matched * BLOCK_BYTES / 2**20:.1f} MiB instead of recomputing "
                  f"{r.num_matched * 16} tokens)")
            show("nodes", b.address, "nodes")
            show("index stats", b.address, "stats")
            show("the first 3 blocks", a.address, "query", "--namespace", NS, *sum((["--hash", h.hex()] for h in hashes[:3]), []))
            show("a stale block", a.address, "invalidate", "--namespace", NS, "--hash", hashes[10].hex())
            t0 = time.perf_counter()
            while cb.query_prefix(NS, hashes).num_matched != 10:
                time.sleep(0.001)
            print(f"replica B after the invalidation on A: the chain now matches 10 blocks "
                  f"(converged in {(time.perf_counter() - t0) * 1e3:.1f} ms)")
            node_b.stop(unregister=False)
            node_b_gone = time.perf_counter()
            while any(n.node_id == "node-b" for n, _ in ca.list_nodes()):
                time.sleep(0.05)
            print(f"node-b stopped without unregistering: dropped after {time.perf_counter() - node_b_gone:.1f} s "
                  f"(lease TTL 2 s)")
            node_a.stop()
    print("\nShort metaserver benchmark (the full one: `kvpool bench metaserver`):")
    bench_args = argparse.Namespace(loads="500,1000", seconds=1.5, chains=500, publish_batch=1024, concurrency=32,
                                    out=str(run_dir / "bench-metaserver.json"), server_args="")
    return metaserver_bench.main(bench_args)
