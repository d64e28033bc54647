"""`kvpool bench metaserver`: the metadata service under load, real gRPC on loopback, etcd on.

Starts its own etcd and two metaserver replicas (127.0.0.1, ended by PID at the end), then
measures, in one run:
- Publish throughput (blocks/s acknowledged, batched) and the rate they become durable in etcd;
- QueryPrefix latency p50/p99 for 64-hash chains at several offered loads (open loop: sends
  follow a fixed schedule whatever the answers do; latency counts from the send, and how late
  the client sent against its schedule is reported beside it);
- the maximum QueryPrefix rate from one client process (closed loop);
- replica convergence (publish on one replica, answered by the other) and lease-expiry delay.

Every QueryPrefix figure has a no-op twin measured right after it the same way: the standard
gRPC health check (`grpc.health.v1.Health/Check`) on the same server and channel, i.e. the
cost of a Python gRPC call itself, the floor under any answer. Each step also reports the CPU
that processes outside the benchmark used meanwhile (the machine is shared; Linux only).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool_bench.report import pct, write_report
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from kvpool_proto.kvpool.v1 import meta_pb2_grpc as pb_grpc

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


class OtherCpu:
    """CPU time that processes outside the benchmark use during a step, in cores: the whole
    machine's busy time (/proc/stat) minus this process's and `pids`'s. None without /proc."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start: tuple[float, float, float] | None = None

    def _machine_busy(self) -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / self._tick  # all but idle and iowait (steal included)

    def _ours(self) -> float:
        total = sum(os.times()[:2])
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / self._tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def start(self) -> None:
        try:
            self._start = (time.perf_counter(), self._machine_busy(), self._ours())
        except OSError:
            self._start = None

    def stop(self) -> float | None:
        if self._start is None:
            return None
        t0, busy0, ours0 = self._start
        try:
            other = (self._machine_busy() - busy0) - (self._ours() - ours0)
        except OSError:
            return None
        return max(0.0, other / (time.perf_counter() - t0))


Call = Callable[..., Awaitable[Any]]


@contextlib.contextmanager
def no_client_gc() -> Iterator[None]:
    """No garbage collection in this (client) process during a measured step: its pauses
    (about 1 ms for a young collection here) would count as server latency."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def open_loop(call: Call, requests: Sequence[Any], rate: float, seconds: float,
                    other: OtherCpu | None = None) -> dict:
    """Send `rate` calls/s for `seconds` whatever the answers do; latency counts from the send."""
    n = int(rate * seconds)
    lat: list[float] = []
    lag: list[float] = []  # how late each send was against the schedule (the client's own delay)
    errors = 0
    if other:
        other.start()
    t0 = time.perf_counter()

    async def one(i: int, scheduled: float) -> None:
        nonlocal errors
        sent = time.perf_counter()
        lag.append(sent - scheduled)
        try:
            await call(requests[i % len(requests)], timeout=5)
            lat.append(time.perf_counter() - sent)
        except grpc.aio.AioRpcError:
            errors += 1

    tasks = []
    for i in range(n):
        scheduled = t0 + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, scheduled)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return {"offered_qps": rate, "achieved_qps": len(lat) / elapsed, "p50_ms": pct(lat, 50) * 1e3,
            "p99_ms": pct(lat, 99) * 1e3, "errors": errors, "send_lag_p99_ms": pct(lag, 99) * 1e3,
            "other_cpu_cores": other.stop() if other else None}


async def closed_loop(call: Call, requests: Sequence[Any], concurrency: int, seconds: float,
                      other: OtherCpu | None = None) -> dict:
    """`concurrency` calls always in flight from this one process for `seconds`."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < deadline:
            await call(requests[i % len(requests)], timeout=5)
            done += 1
            i += concurrency

    if other:
        other.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return {"concurrency": concurrency, "max_qps": done / (time.perf_counter() - t0),
            "other_cpu_cores": other.stop() if other else None}


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


async def run(args: argparse.Namespace, a: str, b: str, other: OtherCpu) -> dict:
    ch_a, ch_b = grpc.aio.insecure_channel(a), grpc.aio.insecure_channel(b)
    stub_a, stub_b = pb_grpc.MetaServiceStub(ch_a), pb_grpc.MetaServiceStub(ch_b)
    noop, noop_req = health_pb2_grpc.HealthStub(ch_a).Check, [health_pb2.HealthCheckRequest()]
    report: dict = {"publish": await publish_phase(stub_a, args)}
    queries = make_queries(args, 4096)
    await open_loop(stub_a.QueryPrefix, queries, 200, 0.5)  # warm-up
    await open_loop(noop, noop_req, 200, 0.5)
    report["query_latency"], report["noop_latency"] = [], []
    with no_client_gc():
        for r in args.loads.split(","):  # each QueryPrefix step, then its no-op twin
            report["query_latency"].append(await open_loop(stub_a.QueryPrefix, queries, float(r), args.seconds, other))
            report["noop_latency"].append(await open_loop(noop, noop_req, float(r), args.seconds, other))
        report["query_max_rate"] = await closed_loop(stub_a.QueryPrefix, queries, args.concurrency, args.seconds,
                                                     other)
        report["noop_max_rate"] = await closed_loop(noop, noop_req, args.concurrency, args.seconds, other)
    report["replica_convergence"] = await convergence(stub_a, stub_b, 50)
    report["lease_expiry"] = await lease_expiry(stub_a, stub_b, 2)
    await ch_a.close()
    await ch_b.close()
    return report


def _cores(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_report(r: dict) -> None:
    p = r["publish"]
    print(f"\nPublish: {p['blocks']} blocks in batches of {p['batch']}: "
          f"{p['acked_blocks_per_s']:,.0f} blocks/s acknowledged, {p['durable_blocks_per_s']:,.0f} blocks/s durable in etcd"
          f"   (target >= 50,000 blocks/s)")
    print(f"\nQueryPrefix, {CHAIN}-hash chains, open loop (target: p99 <= 2 ms at 1,000 q/s)\n"
          "  no-op: the gRPC health check, same server and channel, right after each step (the floor of a call)\n"
          "  send lag: how late the client sent against its schedule (not counted in the latency)\n"
          "  other CPU: cores used by processes outside the benchmark during the QueryPrefix step")
    print(f"{'':12} {'---------------------- QueryPrefix ----------------------':>58} "
          f"{'------------- no-op -------------':>35}")
    print(f"{'offered q/s':>12} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'send lag p99':>13} "
          f"{'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'other CPU':>10}")
    for q, n in zip(r["query_latency"], r["noop_latency"]):
        print(f"{q['offered_qps']:>12.0f} {q['achieved_qps']:>9.0f} {q['p50_ms']:>8.3f} {q['p99_ms']:>8.3f} "
              f"{q['errors']:>7} {q['send_lag_p99_ms']:>10.3f} ms {n['achieved_qps']:>9.0f} "
              f"{n['p50_ms']:>8.3f} {n['p99_ms']:>8.3f} {n['errors']:>7} {_cores(q['other_cpu_cores']):>10}")
    m, nm = r["query_max_rate"], r["noop_max_rate"]
    print(f"\nQueryPrefix max rate, one client process (grpc.aio), {m['concurrency']} in flight: {m['max_qps']:,.0f} q/s"
          f"   (target >= 3,000 q/s); no-op: {nm['max_qps']:,.0f} calls/s; other CPU {_cores(m['other_cpu_cores'])}")
    c = r["replica_convergence"]
    print(f"Replica convergence (publish on A, answered by B): p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms,"
          f" max {c['max_ms']:.2f} ms   (target <= 100 ms)")
    e = r["lease_expiry"]
    print(f"Lease expiry: node with TTL {e['ttl_s']} s dropped on both replicas after "
          f"{e['dropped_on_both_replicas_after_s']:.2f} s   (target <= TTL + 1 s)")
    if r.get("loadavg_at_start") is not None:
        print(f"Machine load average at start: {r['loadavg_at_start']:.2f}")


def main(args: argparse.Namespace) -> int:
    extra = tuple(args.server_args.split())
    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        with EtcdProcess(Path(tmp) / "etcd", fast=False) as etcd, \
                MetaserverProcess(etcd.endpoint, Path(tmp) / "a.log", log_level="WARNING", extra_args=extra) as a, \
                MetaserverProcess(etcd.endpoint, Path(tmp) / "b.log", log_level="WARNING", extra_args=extra) as b:
            other = OtherCpu([pid for pid in (etcd.proc.pid if etcd.proc else None, a.pid, b.pid) if pid])
            report = asyncio.run(run(args, a.address, b.address, other))
    report["loadavg_at_start"] = loadavg
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print_report(report)
    write_report(args.out, report)
    return 0
