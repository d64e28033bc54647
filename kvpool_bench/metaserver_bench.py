"""`kvpool bench metaserver`: the metadata service under load, real gRPC on loopback, etcd on.

Starts its own etcd and two metaserver replicas (127.0.0.1, ended by PID at the end), then
measures, in one run:
- Publish throughput (blocks/s acknowledged, batched) and the rate they become durable in etcd;
- QueryPrefix latency p50/p99 for 64-hash chains at several offered loads (open loop: sends
  follow a fixed schedule whatever the answers do; latency counts from the send);
- the maximum QueryPrefix rate from one client process (closed loop);
- replica convergence (publish on one replica, answered by the other) and lease-expiry delay.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import grpc

from kvpool_bench.report import pct, write_report
from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from kvpool_proto.kvpool.v1 import meta_pb2_grpc as pb_grpc
from metaserver.launch import EtcdProcess, MetaserverProcess

CHAIN = 64
NS = "bench-ns"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("metaserver", help="QueryPrefix latency/rate, Publish throughput, convergence")
    p.add_argument("--loads", default="250,500,1000,2000", help="offered QueryPrefix loads, queries/s")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each load step")
    p.add_argument("--chains", type=int, default=2000, help="published 64-block chains (blocks = 64x)")
    p.add_argument("--publish-batch", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=32, help="in-flight queries in the max-rate step")
    p.add_argument("--out", default="runs/bench-metaserver.json", help="JSON report path")
    p.add_argument("--server-args", default="", help="extra `kvpool metaserver` flags, e.g. '--threads 2'")


def h(chain: int, i: int) -> bytes:
    return chain.to_bytes(16, "big") + i.to_bytes(16, "big")


async def publish_phase(stub: pb_grpc.MetaServiceStub, args: argparse.Namespace) -> dict:
    nodes = [f"bench-node-{i}" for i in range(4)]
    for i, n in enumerate(nodes):
        await stub.RegisterNode(pb.RegisterNodeRequest(node_id=n, session_address=f"127.0.0.1:{9000 + i}",
                                                       capacity_bytes=1 << 40, layout_fingerprint=NS,
                                                       lease_ttl_s=600), timeout=10)
    records = [(nodes[c % len(nodes)], pb.BlockRecord(block_hash=h(c, i), offset=(c * CHAIN + i) * 65536,
                                                      size_bytes=65536, generation=1))
               for c in range(args.chains) for i in range(CHAIN)]
    batches = []
    for n in nodes:
        mine = [r for node, r in records if node == n]
        batches += [pb.PublishRequest(node_id=n, blocks=mine[i:i + args.publish_batch])
                    for i in range(0, len(mine), args.publish_batch)]
    sem = asyncio.Semaphore(4)

    async def one(req: pb.PublishRequest) -> None:
        async with sem:
            await stub.Publish(req, timeout=30)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    acked_s = time.perf_counter() - t0
    while (await stub.Stats(pb.StatsRequest(), timeout=10)).pending_writes:
        await asyncio.sleep(0.01)
    durable_s = time.perf_counter() - t0
    return {"blocks": len(records), "batch": args.publish_batch, "acked_blocks_per_s": len(records) / acked_s,
            "durable_blocks_per_s": len(records) / durable_s}


def make_queries(args: argparse.Namespace, n: int) -> list[pb.QueryPrefixRequest]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        c = rng.randrange(args.chains * 2)  # half the chains were never published: misses too
        out.append(pb.QueryPrefixRequest(namespace=NS, block_hashes=[h(c, i) for i in range(CHAIN)],
                                         requester_node_id="bench-client"))
    return out


async def open_loop(stub: pb_grpc.MetaServiceStub, queries: list[pb.QueryPrefixRequest], rate: float,
                    seconds: float) -> dict:
    n = int(rate * seconds)
    lat: list[float] = []
    errors = 0
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal errors
        sent = time.perf_counter()
        try:
            await stub.QueryPrefix(queries[i % len(queries)], timeout=5)
            lat.append(time.perf_counter() - sent)
        except grpc.aio.AioRpcError:
            errors += 1

    tasks = []
    for i in range(n):
        scheduled = t0 + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return {"offered_qps": rate, "achieved_qps": len(lat) / elapsed, "p50_ms": pct(lat, 50) * 1e3,
            "p99_ms": pct(lat, 99) * 1e3, "errors": errors}


async def closed_loop(stub: pb_grpc.MetaServiceStub, queries: list[pb.QueryPrefixRequest], concurrency: int,
                      seconds: float) -> dict:
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < deadline:
            await stub.QueryPrefix(queries[i % len(queries)], timeout=5)
            done += 1
            i += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return {"concurrency": concurrency, "max_qps": done / (time.perf_counter() - t0)}


async def convergence(stub_a: pb_grpc.MetaServiceStub, stub_b: pb_grpc.MetaServiceStub, samples: int) -> dict:
    delays = []
    for k in range(samples):
        hh = h(10**9 + k, 0)
        await stub_a.Publish(pb.PublishRequest(node_id="bench-node-0", blocks=[
            pb.BlockRecord(block_hash=hh, offset=0, size_bytes=65536, generation=1)]), timeout=5)
        t0 = time.perf_counter()
        while (await stub_b.QueryPrefix(pb.QueryPrefixRequest(namespace=NS, block_hashes=[hh]), timeout=5)).num_matched != 1:
            pass
        delays.append(time.perf_counter() - t0)
    return {"samples": samples, "p50_ms": pct(delays, 50) * 1e3, "p99_ms": pct(delays, 99) * 1e3,
            "max_ms": max(delays) * 1e3}


async def lease_expiry(stub_a: pb_grpc.MetaServiceStub, stub_b: pb_grpc.MetaServiceStub, ttl_s: int) -> dict:
    await stub_a.RegisterNode(pb.RegisterNodeRequest(node_id="bench-mortal", session_address="127.0.0.1:9999",
                                                     capacity_bytes=1 << 30, layout_fingerprint=NS,
                                                     lease_ttl_s=ttl_s), timeout=5)
    hh = h(2 * 10**9, 0)
    await stub_a.Publish(pb.PublishRequest(node_id="bench-mortal", blocks=[
        pb.BlockRecord(block_hash=hh, offset=0, size_bytes=64, generation=1)]), timeout=5)
    t0 = time.perf_counter()
    for stub in (stub_a, stub_b):
        while (await stub.QueryPrefix(pb.QueryPrefixRequest(namespace=NS, block_hashes=[hh],
                                                            requester_node_id="bench-mortal"), timeout=5)).num_matched:
            await asyncio.sleep(0.01)
    return {"ttl_s": ttl_s, "dropped_on_both_replicas_after_s": time.perf_counter() - t0}


async def run(args: argparse.Namespace, a: str, b: str) -> dict:
    ch_a, ch_b = grpc.aio.insecure_channel(a), grpc.aio.insecure_channel(b)
    stub_a, stub_b = pb_grpc.MetaServiceStub(ch_a), pb_grpc.MetaServiceStub(ch_b)
    report: dict = {"publish": await publish_phase(stub_a, args)}
    queries = make_queries(args, 4096)
    await open_loop(stub_a, queries, 200, 0.5)  # warm-up
    report["query_latency"] = [await open_loop(stub_a, queries, float(r), args.seconds)
                               for r in args.loads.split(",")]
    report["query_max_rate"] = await closed_loop(stub_a, queries, args.concurrency, args.seconds)
    report["replica_convergence"] = await convergence(stub_a, stub_b, 50)
    report["lease_expiry"] = await lease_expiry(stub_a, stub_b, 2)
    await ch_a.close()
    await ch_b.close()
    return report


def print_report(r: dict) -> None:
    p = r["publish"]
    print(f"\nPublish: {p['blocks']} blocks in batches of {p['batch']}: "
          f"{p['acked_blocks_per_s']:,.0f} blocks/s acknowledged, {p['durable_blocks_per_s']:,.0f} blocks/s durable in etcd"
          f"   (target >= 50,000 blocks/s)")
    print(f"\nQueryPrefix, {CHAIN}-hash chains (target: p99 <= 2 ms at 1,000 q/s)")
    print(f"{'offered q/s':>12} {'achieved q/s':>13} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for row in r["query_latency"]:
        print(f"{row['offered_qps']:>12.0f} {row['achieved_qps']:>13.0f} {row['p50_ms']:>8.3f} "
              f"{row['p99_ms']:>8.3f} {row['errors']:>7}")
    m = r["query_max_rate"]
    print(f"\nQueryPrefix max rate, one client process, {m['concurrency']} in flight: {m['max_qps']:,.0f} q/s"
          "   (target >= 3,000 q/s)")
    c = r["replica_convergence"]
    print(f"Replica convergence (publish on A, answered by B): p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms,"
          f" max {c['max_ms']:.2f} ms   (target <= 100 ms)")
    e = r["lease_expiry"]
    print(f"Lease expiry: node with TTL {e['ttl_s']} s dropped on both replicas after "
          f"{e['dropped_on_both_replicas_after_s']:.2f} s   (target <= TTL + 1 s)")


def main(args: argparse.Namespace) -> int:
    extra = tuple(args.server_args.split())
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        with EtcdProcess(Path(tmp) / "etcd", fast=False) as etcd, \
                MetaserverProcess(etcd.endpoint, Path(tmp) / "a.log", log_level="WARNING", extra_args=extra) as a, \
                MetaserverProcess(etcd.endpoint, Path(tmp) / "b.log", log_level="WARNING", extra_args=extra) as b:
            report = asyncio.run(run(args, a.address, b.address))
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print_report(report)
    write_report(args.out, report)
    return 0
