"""`kvpool`: the one command-line entry point, with vllm-style subcommands.

Each subcommand's module is imported only when it runs, so `kvpool admin` does not load
the engine. Only this layer reads the environment and configures logging.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


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
    from metaserver import cli as metaserver_cli

    parser = argparse.ArgumentParser(prog="kvpool", description="Mooncake-style global KV-cache pool")
    parser.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    metaserver_cli.add_parser(sub)
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
        from metaserver import cli as metaserver_cli

        return metaserver_cli.main(args)
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
