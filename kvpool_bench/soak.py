"""`kvpool bench soak`: the pool under overload, on loopback.

1. Starts a local cluster (etcd, a metaserver, N `kvpool serve --kv-connector mooncake`
   nodes with an admission limit, `--max-pending-requests`) with small pools and KV caches,
   so that both fill up and evict during the run.
2. Calibrates: a closed loop (2 requests per node in flight) measures the sustainable rate.
3. Soaks: Poisson arrivals at `--rate-factor` x that rate for `--duration` seconds, routed
   round-robin, on a multi-turn chat workload that never runs out (conversations restart).
4. Every request must end with a response or a clear overload error (HTTP 503, code
   `overloaded`); anything else counts as an error. Memory is sampled every `--sample-s`
   seconds: each process's RSS, the pools' and the metaserver index's block counts.
5. Afterwards, once the nodes' publish queues are empty, the index is compared node by node
   with what the nodes' pools hold.

The report (console table, JSON) says whether each of these held.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.server import memory
from kvpool_bench.cross_node import Result, stream_completion
from kvpool_bench.report import pct, write_report
from kvpool_bench.workloads import BenchRequest, multi_turn


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("soak", help="overload soak: responses or clear 503s, bounded memory, index = holdings")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of overload")
    p.add_argument("--rate-factor", type=float, default=2.0, help="arrival rate as a multiple of the sustainable one")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (skips the calibration)")
    p.add_argument("--calibrate-s", type=float, default=40.0)
    p.add_argument("--max-pending-requests", type=int, default=6, help="each node's admission limit")
    p.add_argument("--pool-size", default="96MiB", help="each node's DRAM pool (small: it must evict)")
    p.add_argument("--kv-cache-bytes", default="96MiB", help="each node's KV cache")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/soak")
    p.add_argument("--out", default="", help="JSON report (default RUN_DIR/report.json)")


def endless_chats(output_tokens: int, seed: int):  # noqa: ANN201
    """Multi-turn requests forever: 24 users in 4 groups, 6 rounds, then new conversations."""
    gen = 0
    while True:
        yield from multi_turn(users=24, rounds=6, groups=4, system_tokens=256, user_tokens=48, reply_tokens=48,
                              output_tokens=output_tokens, seed=seed * 1000 + gen)
        gen += 1


def rss_bytes(pid: int | None) -> int:
    """RSS of a process this bench started; 0 when it has none or is gone."""
    if pid is None:
        return 0
    try:
        return memory.rss_bytes(pid)
    except OSError:
        return 0


def classify(r: Result) -> str:
    if not r.error:
        return "ok"
    if r.error.startswith("HTTP 503") and "overloaded" in r.error:
        return "overloaded"
    return "error"


def calibrate(urls: list[str], requests, seconds: float) -> float:  # noqa: ANN001
    """Requests/s the cluster completes with 2 requests per node in flight."""
    lock = threading.Lock()
    done = [0]
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        while time.perf_counter() < stop:
            with lock:
                req = next(requests)
            if classify(stream_completion(urls[i % len(urls)], req, i % len(urls))) == "ok":
                with lock:
                    done[0] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2 * len(urls)) as ex:
        list(ex.map(worker, range(2 * len(urls))))
    return done[0] / (time.perf_counter() - t0)


class Sampler:
    """Memory and index size every `every_s` seconds, in a thread."""

    def __init__(self, cluster, every_s: float) -> None:  # noqa: ANN001
        from metaserver.client import MetaClient

        self.cluster = cluster
        self.every_s = every_s
        self.client = MetaClient(cluster.metaserver.address, timeout_s=5)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()

    def sample(self) -> dict:
        c = self.cluster
        stats = [n.stats() for n in c.nodes]
        try:
            index_blocks = self.client.stats().index.num_blocks
        except Exception:  # noqa: BLE001 -- a missed sample is recorded as -1, not fatal
            index_blocks = -1
        return {"t_s": round(time.perf_counter() - self._t0, 1),
                "node_rss": [rss_bytes(n.pid) for n in c.nodes], "metaserver_rss": rss_bytes(c.metaserver.pid),
                "etcd_rss": rss_bytes(c.etcd.proc.pid if c.etcd.proc else None), "pool_blocks": [s.get("pool_blocks", 0) for s in stats],
                "in_flight": [s.get("http_in_flight", 0) for s in stats], "index_blocks": index_blocks,
                "node_malloc_in_use": [s.get("malloc_in_use_bytes", 0) for s in stats],
                "node_malloc_free": [s.get("malloc_free_bytes", 0) for s in stats]}

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(self.sample())

    def __enter__(self) -> Sampler:
        self.samples.append(self.sample())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.samples.append(self.sample())
        self.client.close()


def soak(urls: list[str], requests, rate: float, seconds: float, seed: int) -> tuple[list[Result], float]:  # noqa: ANN001
    """Poisson arrivals at `rate`, round-robin, each request in its own worker."""
    rng = random.Random(seed)
    results: list[Result] = []
    lock = threading.Lock()

    def one(req: BenchRequest, node: int) -> None:
        r = stream_completion(urls[node], req, node, timeout_s=300)
        with lock:
            results.append(r)

    t0 = time.perf_counter()
    next_at = 0.0
    i = 0
    with ThreadPoolExecutor(256) as ex:
        while next_at < seconds:
            delay = next_at - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            ex.submit(one, next(requests), i % len(urls))
            i += 1
            next_at += rng.expovariate(rate)
    return results, time.perf_counter() - t0


def index_vs_holdings(cluster, timeout_s: float = 60.0, address: str = "") -> list[dict]:  # noqa: ANN001
    """Per node: blocks its pool holds (in DRAM, or only on its disk tier) and blocks the
    index lists for it, once publishing is idle. `address`: the metaserver replica to ask
    (default the cluster's metaserver)."""
    from metaserver.client import MetaClient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(n.stats().get("pool_publishing", 0) for n in cluster.nodes):
        time.sleep(0.2)
    time.sleep(0.5)
    with MetaClient(address or cluster.metaserver.address, timeout_s=5) as client:
        indexed = {rec.node_id: count for rec, count in client.list_nodes()}
    held = [n.stats() for n in cluster.nodes]
    return [{"node": n.node_id, "pool_blocks": int(s.get("pool_held_blocks", s.get("pool_blocks", 0))),
             "index_blocks": int(indexed.get(n.node_id, 0))} for n, s in zip(cluster.nodes, held)]


def summarize(results: list[Result], wall_s: float, rate: float, sustainable: float, samples: list[dict],
              check: list[dict], pool_slots: int) -> dict:
    kinds = {"ok": 0, "overloaded": 0, "error": 0}
    for r in results:
        kinds[classify(r)] += 1
    ok = [r for r in results if not r.error]
    first, last = samples[0], samples[-1]
    peak = {"node_rss": max(max(s["node_rss"]) for s in samples), "metaserver_rss": max(s["metaserver_rss"] for s in samples),
            "etcd_rss": max(s["etcd_rss"] for s in samples),
            "pool_blocks": max(max(s["pool_blocks"]) for s in samples),
            "index_blocks": max(s["index_blocks"] for s in samples)}
    half = samples[len(samples) // 2]
    return {"sustainable_rps": sustainable, "offered_rps": rate, "requests": len(results), **kinds,
            "errors_sample": [r.error for r in results if classify(r) == "error"][:5],
            "completed_rps": len(ok) / wall_s, "wall_s": wall_s,
            "ttft_p50_s": pct([r.ttft_s for r in ok], 50), "ttft_p99_s": pct([r.ttft_s for r in ok], 99),
            "e2e_p99_s": pct([r.e2e_s for r in ok], 99),
            "node_rss_start": max(first["node_rss"]), "node_rss_mid": max(half["node_rss"]),
            "node_rss_end": max(last["node_rss"]), "peak": peak, "pool_slots": pool_slots,
            # glibc's accounting, the larger of the nodes' figures at each point (as for RSS):
            # bytes in use (a leak grows these) and freed bytes kept in arenas (fragmentation)
            **{f"node_malloc_{kind}_{when}": max(smp[f"node_malloc_{kind}"], default=0)
               for kind in ("in_use", "free") for when, smp in (("start", first), ("mid", half), ("end", last))},
            "index_check": check,
            "index_matches_holdings": all(c["pool_blocks"] == c["index_blocks"] for c in check)}


def print_summary(s: dict) -> None:
    mib = 2 ** 20
    rows = [
        ("sustainable rate (req/s)", f"{s['sustainable_rps']:.2f}"),
        ("offered rate (req/s)", f"{s['offered_rps']:.2f}"),
        ("requests", f"{s['requests']}"),
        ("  answered", f"{s['ok']}"),
        ("  503 overloaded", f"{s['overloaded']}"),
        ("  other errors", f"{s['error']}"),
        ("completed (req/s)", f"{s['completed_rps']:.2f}"),
        ("TTFT p50 / p99 (s), answered", f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f}"),
        ("node RSS start / mid / end (MiB)", f"{s['node_rss_start'] / mib:.0f} / {s['node_rss_mid'] / mib:.0f} / "
                                             f"{s['node_rss_end'] / mib:.0f}"),
        ("node malloc in use start / mid / end (MiB)", " / ".join(
            f"{s[f'node_malloc_in_use_{w}'] / mib:.0f}" for w in ("start", "mid", "end"))),
        ("node malloc free in arenas s / m / e (MiB)", " / ".join(
            f"{s[f'node_malloc_free_{w}'] / mib:.0f}" for w in ("start", "mid", "end"))),
        ("metaserver / etcd RSS peak (MiB)", f"{s['peak']['metaserver_rss'] / mib:.0f} / {s['peak']['etcd_rss'] / mib:.0f}"),
        ("pool blocks peak / slots per node", f"{s['peak']['pool_blocks']} / {s['pool_slots']}"),
        ("index blocks peak", f"{s['peak']['index_blocks']}"),
        ("index = holdings afterwards", ", ".join(f"{c['node']} {c['index_blocks']}/{c['pool_blocks']}"
                                                  for c in s["index_check"])
         + (" (match)" if s["index_matches_holdings"] else " (MISMATCH)")),
        ("wall time (s)", f"{s['wall_s']:.0f}"),
    ]
    print()
    for label, value in rows:
        print(f"{label:<44}{value:>32}")


def main(args: argparse.Namespace) -> int:
    from kvpool_harness.cluster import ClusterSpec, LocalCluster

    if args.duration <= 0 or args.rate_factor <= 0 or args.rate < 0 or args.max_pending_requests < 1:
        print("kvpool bench soak: error: --duration, --rate-factor and --max-pending-requests must be positive",
              file=sys.stderr)
        return 2
    spec = ClusterSpec(nodes=args.nodes, model=args.model, connector=True, pool_size=args.pool_size,
                       engine_args=("--threads", "1", "--kv-cache-bytes", args.kv_cache_bytes,
                                    "--max-pending-requests", str(args.max_pending_requests)))
    requests = endless_chats(args.output_tokens, args.seed)
    try:
        with LocalCluster(Path(args.run_dir), spec) as cluster:
            urls = [n.url for n in cluster.nodes]
            sustainable = args.rate or calibrate(urls, requests, args.calibrate_s)
            rate = sustainable * (1.0 if args.rate else args.rate_factor)
            print(f"sustainable {sustainable:.2f} req/s; soaking at {rate:.2f} req/s for {args.duration:.0f} s", flush=True)
            with Sampler(cluster, args.sample_s) as sampler:
                results, wall = soak(urls, requests, rate, args.duration, args.seed)
            check = index_vs_holdings(cluster)
            slots = int(cluster.nodes[0].stats().get("pool_slots", 0))
    except RuntimeError as err:
        print(f"kvpool bench soak: error: {err}", file=sys.stderr)
        return 1
    summary = summarize(results, wall, rate, sustainable, sampler.samples, check, slots)
    print_summary(summary)
    report = {"bench": "soak", "nodes": args.nodes, "model": args.model, "duration_s": args.duration,
              "rate_factor": args.rate_factor, "max_pending_requests": args.max_pending_requests,
              "pool_size": args.pool_size, "kv_cache_bytes": args.kv_cache_bytes, "summary": summary,
              "samples": sampler.samples, "requests": [r.report() for r in results]}
    out = args.out or str(Path(args.run_dir) / "report.json")
    write_report(out, report)
    return 0 if summary["error"] == 0 and summary["index_matches_holdings"] else 1
