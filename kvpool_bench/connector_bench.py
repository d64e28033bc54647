"""`kvpool bench connector`: TTFT on node B for one prompt in three cases, in one run:

- recompute: B has never seen the prompt and nobody holds it (full prefill);
- local hit: B served the same prompt before (its own prefix cache);
- remote hit: node A served the prompt; B pulls A's blocks through the pool.

Real processes on loopback (etcd, metaserver, two `kvpool serve --kv-connector mooncake`
nodes, the real model). TTFT = the client's wall time of a max_tokens=1 completion.
Targets (issue 5): remote <= 25% of recompute at 2,048 tokens, and <= 2x local.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from kvpool_bench.report import write_report


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("connector", help="TTFT: recompute vs local prefix hit vs remote hit through the pool")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=3, help="prompts per length and case (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per node (two nodes share this machine)")
    p.add_argument("--run-dir", default="runs/bench-connector")
    p.add_argument("--out", default="runs/bench-connector.json")


def _ttft(node, prompt: list[int], expect_remote: int | None = None) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    body = node.complete(prompt, 1)
    dt = time.perf_counter() - t0
    got = body["usage"]["prompt_tokens_details"]["remote_cached_tokens"]
    if expect_remote is not None and got != expect_remote:
        raise RuntimeError(f"expected {expect_remote} remote-hit tokens, got {got}")
    return dt


def main(args: argparse.Namespace) -> int:
    from kvpool_harness.cluster import ClusterSpec, LocalCluster

    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    spec = ClusterSpec(nodes=2, model=args.model, pool_size="2GiB",
                       engine_args=("--dtype", args.dtype, "--kv-cache-bytes", "1GiB", "--threads", str(args.threads)))
    rows = []
    with LocalCluster(Path(args.run_dir), spec) as cluster:
        a, b = cluster.nodes
        b.complete(fresh(64), 1)  # warm both nodes up
        a.complete(fresh(64), 1)
        for n in lengths:
            rec, loc, rem = [], [], []
            for _ in range(args.reps):
                p = fresh(n)
                rec.append(_ttft(b, p, expect_remote=0))
                loc.append(_ttft(b, p, expect_remote=0))
                q = fresh(n)
                published = a.stats()["pool_published"]
                a.complete(q, 1)
                deadline = time.monotonic() + 30
                while a.stats()["pool_published"] < published + n // 16 and time.monotonic() < deadline:
                    time.sleep(0.02)
                rem.append(_ttft(b, q, expect_remote=(n - 1) // 16 * 16))
            row = {"prompt_tokens": n, "recompute_ms": 1e3 * statistics.median(rec),
                   "local_hit_ms": 1e3 * statistics.median(loc), "remote_hit_ms": 1e3 * statistics.median(rem)}
            row["remote_over_recompute"] = row["remote_hit_ms"] / row["recompute_ms"]
            row["remote_over_local"] = row["remote_hit_ms"] / row["local_hit_ms"]
            rows.append(row)
            print(f"{n:>6} tokens: recompute {row['recompute_ms']:8.1f} ms | local hit {row['local_hit_ms']:7.1f} ms"
                  f" | remote hit {row['remote_hit_ms']:7.1f} ms | remote/recompute {row['remote_over_recompute']:.1%}"
                  f" | remote/local {row['remote_over_local']:.2f}x", flush=True)
        stats_b = b.stats()
    print(f"\nnode B: {stats_b['pool_remote_hit_blocks']} blocks pulled, {stats_b['pool_bytes_read'] / 2**20:.0f} MiB, "
          f"{stats_b['failed_load_blocks']} failed")
    write_report(args.out, {"bench": "connector", "model": args.model, "dtype": args.dtype, "reps": args.reps,
                            "rows": rows, "node_b": stats_b})
    return 0
