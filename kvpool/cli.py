"""`kvpool`: the one command-line entry point, with vllm-style subcommands.

Each subcommand's module is imported only when it runs, so `kvpool admin` does not load
the engine. Only this layer reads the environment and configures logging.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys


def _add_metaserver(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("metaserver", help="run a metadata server replica (gRPC, etcd-backed)")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve gRPC on")
    p.add_argument("--etcd", default="127.0.0.1:2379", help="etcd endpoints HOST:PORT[,HOST:PORT]")
    p.add_argument("--key-prefix", default="/kvpool/", help="etcd key prefix of this pool")
    p.add_argument("--replica-id", default="", help="name in logs and Stats (default: the listen address)")
    p.add_argument("--lease-ttl", type=int, default=10, help="default node lease TTL in seconds")
    p.add_argument("--max-txn-ops", type=int, default=128, help="operations per etcd transaction (etcd's --max-txn-ops)")
    p.add_argument("--hash-bytes", type=int, default=32, help="length of block hashes")
    p.add_argument("--threads", type=int, default=2, help="gRPC handler threads (2 measured best on 2 cores)")
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="Python GIL switch interval")


def _run_metaserver(args: argparse.Namespace) -> int:
    from metaserver.config import MetaServerConfig
    from metaserver.server import serve

    try:
        config = MetaServerConfig(listen=args.listen, etcd_endpoints=tuple(args.etcd.split(",")),
                                  key_prefix=args.key_prefix, replica_id=args.replica_id,
                                  default_lease_ttl_s=args.lease_ttl, max_txn_ops=args.max_txn_ops,
                                  hash_bytes=args.hash_bytes)
    except ValueError as err:
        print(f"kvpool metaserver: error: {err}", file=sys.stderr)
        return 2
    # The index holds millions of small long-lived objects and few cycles: rare full
    # collections keep QueryPrefix tail latency flat.
    gc.set_threshold(50_000, 20, 100)
    # Handler threads hand the GIL to each other per call: a short switch interval keeps a
    # query from waiting out another thread's full 5 ms default slice.
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    try:
        serve(config, handler_threads=args.threads)
    except OSError as err:
        print(f"kvpool metaserver: error: {err}", file=sys.stderr)
        return 1
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpool_bench import connector_bench, cross_node, engine_bench, metaserver_bench, soak, transfer_bench

    p = sub.add_parser("bench", help="benchmarks")
    benches = p.add_subparsers(dest="bench_cmd", required=True, metavar="BENCH")
    metaserver_bench.add_parser(benches)
    transfer_bench.add_parser(benches)
    engine_bench.add_parser(benches)
    connector_bench.add_parser(benches)
    cross_node.add_parser(benches)
    soak.add_parser(benches)


def build_parser() -> argparse.ArgumentParser:
    from engine import cli as engine_cli
    from metaserver import admin

    parser = argparse.ArgumentParser(prog="kvpool", description="Mooncake-style global KV-cache pool")
    parser.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_metaserver(sub)
    admin.add_parser(sub)
    engine_cli.add_parsers(sub)
    from kvpool import cluster

    cluster.add_parser(sub)
    _add_bench(sub)
    from kvpool_bench import demo

    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "metaserver":
        return _run_metaserver(args)
    if args.cmd == "admin":
        from metaserver import admin

        return admin.main(args)
    if args.cmd == "bench":
        from kvpool_bench import connector_bench, cross_node, engine_bench, metaserver_bench, soak, transfer_bench

        benches = {"metaserver": metaserver_bench.main, "transfer": transfer_bench.main, "engine": engine_bench.main,
                   "connector": connector_bench.main, "cross-node": cross_node.main, "soak": soak.main}
        return benches[args.bench_cmd](args)
    if args.cmd in ("serve", "generate"):
        from engine import cli as engine_cli

        return {"serve": engine_cli.serve, "generate": engine_cli.generate}[args.cmd](args)
    if args.cmd == "cluster":
        from kvpool import cluster

        return cluster.main(args)
    if args.cmd == "demo":
        from kvpool_bench import demo

        return demo.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
