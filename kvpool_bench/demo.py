"""`kvpool demo` (`make demo`): the main job. A 2-node pool on loopback with the real model,
and the cross-node benchmark on a multi-turn chat workload, pool on against pool off.

It starts etcd, a metaserver and two `kvpool serve --kv-connector mooncake` nodes, runs the
workload with round-robin routing, then does the same with the connector off (local prefix
caches only), prints the comparison table, writes the JSON report and two PNG plots into
--run-dir, and stops every process it started, by PID. A few minutes on 2 CPU cores.
The workload: 7 users in 3 groups (a shared 192-token system prompt per group), each with a
256-token context of their own, 5 rounds of 32-token messages and 64-token model replies,
4 users at a time. Each node's own KV cache is sized like a GPU's (96 MiB: the requests in
flight and little more); with the pool on, each node adds a 2 GiB DRAM pool beside it.
"""
from __future__ import annotations

import argparse

from kvpool_bench import cross_node


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="the main job: a 2-node pool on loopback, pool on vs off (cross-node bench)")
    cross_node.add_args(p)
    p.set_defaults(run_dir="runs/demo")


def main(args: argparse.Namespace) -> int:
    return cross_node.main(args)
