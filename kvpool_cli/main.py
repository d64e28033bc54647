"""`kvpool`: the one command-line entry point, with vllm-style subcommands.

Each subcommand's module is imported only when it runs, so `kvpool admin` does not load
the engine. Only this layer reads the environment and configures logging. `--log-level`
goes before or after the command (`kvpool --log-level DEBUG serve` = `kvpool serve
--log-level DEBUG`).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

# OpenMP threads that wait spin for a while before they sleep (libgomp's default spin count is
# long). A server's engine thread shares the cores with its HTTP thread and the clients: a
# spinning worker delays them, and a preempted one stalls the next parallel region. A short spin
# served decode and prefill faster (docs/journal/benchmarks-history.md, "After the in-place decode
# kernel and a short OpenMP spin").
# Set before torch loads libgomp (it reads the variable once): `main` does, first; a value the
# user set wins. The harness drops it again for the vLLM servers it starts (their defaults
# are the reference).
SPIN_ENV, SPIN_DEFAULT = "GOMP_SPINCOUNT", "50000"


def default_spin_count() -> None:
    """Set the OpenMP spin default (above) where the process starts, never at import."""
    if SPIN_ENV not in os.environ:
        os.environ[SPIN_ENV] = SPIN_DEFAULT
        os.environ["KVPOOL_DEFAULTED_" + SPIN_ENV] = "1"


def stop_children_on_sigterm() -> None:
    """SIGTERM ends a process without running its `finally` blocks, and a benchmark's stop its
    etcd, metaservers and engines there: as SystemExit, it unwinds them and the children stop
    with it instead of running on, orphaned."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvpool_bench import (chaos, connector_bench, cross_node, disk_bench, engine_bench, kernels_bench,
                              lookup_bench, metaserver_bench, pd_bench, soak, spec_bench, transfer_bench, vllm_reads)

    p = sub.add_parser("bench", help="benchmarks")
    benches = p.add_subparsers(dest="bench_cmd", required=True, metavar="BENCH")
    metaserver_bench.add_parser(benches)
    transfer_bench.add_parser(benches)
    engine_bench.add_parser(benches)
    connector_bench.add_parser(benches)
    cross_node.add_parser(benches)
    soak.add_parser(benches)
    lookup_bench.add_parser(benches)
    pd_bench.add_parser(benches)
    spec_bench.add_parser(benches)
    vllm_reads.add_parser(benches)
    disk_bench.add_parser(benches)
    chaos.add_parser(benches)
    kernels_bench.add_parser(benches)


# Our own packages: a missing one of these is a bug, never a missing extra.
_OURS = {"kvpool_cli", "kvpool_plan", "kvpool_bench", "kvpool_harness", "router", "connector", "engine", "kvpool",
         "metaserver", "kvpool_proto"}
_MISSING: set[str] = set()  # the commands added without their extra


def _add_or_explain(sub: argparse._SubParsersAction, names: tuple[str, ...], extra: str,  # type: ignore[type-arg]
                    add: Callable[[], None]) -> None:
    """Add a command whose modules need an extra beyond the core distribution (pyproject.toml).
    Without the extra the command is still listed and says what to install, and the others run:
    `kvpool metaserver` from `pip install kvpool[cpu]`, without the engine's torch."""
    loaded = set(sys.modules)
    try:
        add()
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in _OURS:
            raise
        for name in set(sys.modules) - loaded:  # ours, half-imported, would import the next time
            if name.split(".")[0] in _OURS:
                del sys.modules[name]
        for name in names:
            _MISSING.add(name)
            p = sub.add_parser(name, help=f"(needs kvpool[{extra}]: {err.name} is not installed)")
            p.set_defaults(missing=f"kvpool {name} needs kvpool[{extra}] ({err.name} is not installed): "
                                   f"pip install 'kvpool[{extra}]' (from a checkout: pip install '.[cpu,{extra}]')")


# Commands of the core distribution: when one is named, no other command's modules are
# imported (the engine's torch and the benchmarks take seconds to import; `kvpool admin
# drain` runs in a pod's preStop hook, and an operator's `kvpool admin stats` should answer
# as fast as etcdctl does).
LIGHT = ("metaserver", "admin")


def command_word(argv: list[str]) -> str | None:
    """The command `argv` names (its first word that is no option nor --log-level's value)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: every command (`argv` None or naming none), or only the command
    `argv` names (with the LIGHT ones, always there)."""
    from metaserver import admin
    from metaserver import cli as metaserver_cli

    parser = argparse.ArgumentParser(prog="kvpool", description="Mooncake-style global KV-cache pool")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    metaserver_cli.add_parser(sub)
    admin.add_parser(sub)
    if argv is not None and command_word(argv) in LIGHT:
        metaserver_cli.add_log_level(parser)
        return parser

    def serve() -> None:
        from kvpool_cli import serve as serve_cli
        serve_cli.add_parsers(sub)

    def cluster() -> None:
        from kvpool_harness import cluster
        cluster.add_parser(sub)

    def router() -> None:
        from router import cli as router_cli
        router_cli.add_parser(sub)

    def demo() -> None:
        from kvpool_bench import demo
        demo.add_parser(sub)

    def plan() -> None:
        from kvpool_plan import cli as plan_cli
        plan_cli.add_parser(sub)

    groups = [(("serve", "generate"), "engine", serve), (("cluster",), "bench", cluster), (("router",), "router", router),
              (("bench",), "bench", lambda: _add_bench(sub)), (("demo",), "bench", demo), (("plan",), "bench", plan)]
    word = command_word(argv) if argv is not None else None
    # A command named: its modules only (a router or `kvpool cluster status` starts without the
    # engine's torch); none, or an unknown word: all of them, for the help and the error.
    for names, extra, add in [g for g in groups if word in g[0]] or groups:
        _add_or_explain(sub, names, extra, add)
    metaserver_cli.add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    default_spin_count()
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    if _MISSING:  # a command without its extra takes any arguments, and says what to install
        args, _ = parser.parse_known_args(argv)
        if getattr(args, "missing", None):
            print(args.missing, file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    from metaserver.cli import configure_logging

    configure_logging(args.log_level)
    if args.cmd == "metaserver":
        from metaserver import cli as metaserver_cli

        return metaserver_cli.main(args)
    if args.cmd == "admin":
        from metaserver import admin

        return admin.main(args)
    if args.cmd in ("bench", "demo"):
        stop_children_on_sigterm()
    if args.cmd == "bench":
        from kvpool_bench import (chaos, connector_bench, cross_node, disk_bench, engine_bench, kernels_bench,
                                  lookup_bench, metaserver_bench, pd_bench, soak, spec_bench, transfer_bench,
                                  vllm_reads)

        benches = {"metaserver": metaserver_bench.main, "transfer": transfer_bench.main, "engine": engine_bench.main,
                   "connector": connector_bench.main, "cross-node": cross_node.main, "soak": soak.main,
                   "lookup": lookup_bench.main, "pd": pd_bench.main, "spec": spec_bench.main,
                   "vllm-reads": vllm_reads.main, "disk": disk_bench.main, "chaos": chaos.main,
                   "kernels": kernels_bench.main}
        return benches[args.bench_cmd](args)
    if args.cmd in ("serve", "generate"):
        from kvpool_cli import serve as serve_cli

        return {"serve": serve_cli.serve, "generate": serve_cli.generate}[args.cmd](args)
    if args.cmd == "cluster":
        from kvpool_harness import cluster

        return cluster.main(args)
    if args.cmd == "router":
        from router import cli as router_cli

        return router_cli.main(args)
    if args.cmd == "demo":
        from kvpool_bench import demo

        return demo.main(args)
    if args.cmd == "plan":
        from kvpool_plan import cli as plan_cli

        return plan_cli.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
