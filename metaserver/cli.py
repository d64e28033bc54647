"""`kvpool metaserver`: run one metadata server replica (its flags and `main`).

Also runnable alone as `python -m metaserver [--log-level L] metaserver ...` (see
`metaserver.__main__`), which `kvpool_harness.processes.MetaserverProcess` uses: it starts
without loading the rest of kvpool. Like every CLI layer, this one reads the environment:
KVPOOL_ADMIN_TOKEN and KVPOOL_NODE_TOKEN when no token file is given.

`accept_after_subcommands` (shared by `kvpool admin`, `python -m metaserver` and the
`kvpool` parser) lets a command group's options follow its subcommands too.
"""
from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import sys
from collections.abc import Iterator

from metaserver.credentials import read_secret_file

ADMIN_TOKEN_ENV = "KVPOOL_ADMIN_TOKEN"
NODE_TOKEN_ENV = "KVPOOL_NODE_TOKEN"


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """The entry points' `--log-level`, accepted before or after the command (call after the
    subcommands are added)."""
    parser.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "INFO"),
                        help="logging level, before or after the command (default: $KVPOOL_LOG_LEVEL or INFO)")
    accept_after_subcommands(parser, "log_level")


def configure_logging(level: str) -> None:
    """Process-wide logging for an entry point's `main()` (never at import)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def accept_after_subcommands(parser: argparse.ArgumentParser, *dests: str) -> None:
    """Let the options `dests` of `parser` also be given after its subcommands, at any depth
    (`kvpool admin --metaserver X stats --json` as well as `... --json stats`), as etcdctl,
    kubectl and helm accept their global flags anywhere. Call it once the subcommands exist.

    Each subcommand parser gets a copy of the option with default SUPPRESS: argparse copies
    a subcommand's parsed values over its parent's, so the copy sets the value only when it
    is given after the subcommand, and otherwise leaves the one parsed (or defaulted) before
    it. Given both before and after, the later one wins. A subcommand that already has an
    option of the same name keeps its own. The copies are never required: check a required
    option after parsing (see `metaserver.admin.main`)."""
    shared = [a for a in parser._actions if a.dest in dests and a.option_strings]
    missing = set(dests) - {a.dest for a in shared}
    if missing:
        raise ValueError(f"no option with dest {sorted(missing)} in {parser.prog}")
    for child in _subcommand_parsers(parser):
        for action in shared:
            if any(s in child._option_string_actions for s in action.option_strings):
                continue
            twin = copy.copy(action)
            twin.default = argparse.SUPPRESS
            twin.required = False
            if twin.help and "%(default)" in twin.help:
                twin.help = twin.help.replace("%(default)s", str(action.default))
            child._add_action(twin)


def _subcommand_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser below `parser` (subcommands, their subcommands, ...), each once."""
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if id(child) not in seen:  # aliases map several names to one parser
                    seen.add(id(child))
                    yield child
                    yield from _subcommand_parsers(child)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("metaserver", help="run a metadata server replica (gRPC, etcd-backed)")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve gRPC on")
    p.add_argument("--etcd", default="127.0.0.1:2379", help="etcd endpoints HOST:PORT[,HOST:PORT]")
    p.add_argument("--key-prefix", default="/kvpool/", help="etcd key prefix of this pool")
    p.add_argument("--replica-id", default="", help="name in logs and Stats (default: the listen address)")
    p.add_argument("--lease-ttl", type=int, default=10, help="default node lease TTL in seconds")
    p.add_argument("--max-txn-ops", type=int, default=128,
                   help="operations per etcd transaction (etcd's --max-txn-ops)")
    p.add_argument("--hash-bytes", type=int, default=32, help="length of block hashes")
    p.add_argument("--threads", type=int, default=2, help="gRPC handler threads (2 measured best on 2 cores)")
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="Python GIL switch interval")
    p.add_argument("--tls-cert", default="", help="PEM server certificate chain (turns on TLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", help="PEM CA: require client certificates it signed (mutual TLS)")
    p.add_argument("--admin-token-file", default="",
                   help=f"file with the admin token (default: ${ADMIN_TOKEN_ENV}); with no token every call is open")
    p.add_argument("--node-token-file", default="", help=f"file with the node token (default: ${NODE_TOKEN_ENV})")
    from metaserver.config import MetaServerConfig as C
    p.add_argument("--etcd-compact-interval", type=float, default=C.etcd_compact_interval_s,
                   help="compact etcd's history every this many seconds (0: leave it to etcd)")
    p.add_argument("--etcd-compact-keep", type=int, default=C.etcd_compact_keep,
                   help="revisions of history each compaction keeps")


def _token(path: str, env: str, what: str) -> str:
    return read_secret_file(path, what) if path else os.environ.get(env, "").strip()


def main(args: argparse.Namespace) -> int:
    from metaserver.config import MetaServerConfig
    from metaserver.server import serve

    try:
        config = MetaServerConfig(listen=args.listen, etcd_endpoints=tuple(args.etcd.split(",")),
                                  key_prefix=args.key_prefix, replica_id=args.replica_id,
                                  default_lease_ttl_s=args.lease_ttl, max_txn_ops=args.max_txn_ops,
                                  hash_bytes=args.hash_bytes, tls_cert_file=args.tls_cert,
                                  tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca,
                                  admin_token=_token(args.admin_token_file, ADMIN_TOKEN_ENV, "admin token"),
                                  node_token=_token(args.node_token_file, NODE_TOKEN_ENV, "node token"),
                                  etcd_compact_interval_s=args.etcd_compact_interval,
                                  etcd_compact_keep=args.etcd_compact_keep)
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
