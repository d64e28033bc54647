"""`kvpool admin`: the gRPC admin CLI of the metadata service.

Tables for people, `--json` for scripts. Exit codes: 0 ok, 1 the server refused the
request (its gRPC status and message are printed), 2 bad arguments, 3 no metaserver
reachable, 4 aborted at the confirmation prompt. Errors are one line on stderr.

A secured metaserver: `--tls-ca` (and `--tls-cert/--tls-key` for mutual TLS); the token
from `--token-file`, else from the environment variable KVPOOL_ADMIN_TOKEN. The token is
never printed.

The connection and output options (`--metaserver`, `--json`, `--timeout`, TLS, token) go
before or after the command: `kvpool admin --metaserver X --json stats` and `kvpool admin
--metaserver X stats --json` are the same.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from metaserver.cli import accept_after_subcommands
from metaserver.client import MetaClient
from metaserver.credentials import ClientSecurity
from metaserver.errors import MetaError, Unavailable
from metaserver.types import BlockHash, BlockRecord, NodeRecord

TOKEN_ENV = "KVPOOL_ADMIN_TOKEN"

EXIT_SERVER, EXIT_ARGS, EXIT_UNREACHABLE, EXIT_ABORTED = 1, 2, 3, 4

# The options of `kvpool admin` that its commands accept too (before or after the command).
GROUP_OPTIONS = ("metaserver", "json", "timeout", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file")


class ArgError(Exception):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("admin", help="inspect and change the metadata service")
    # Not required=True: it may also follow the command (checked in main).
    p.add_argument("--metaserver", default="", help="HOST:PORT[,HOST:PORT] of metaserver replicas (required)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="deadline of each call in seconds")
    p.add_argument("--tls-ca", default="", help="PEM CA that signed the metaserver's certificate (turns on TLS)")
    p.add_argument("--tls-cert", default="", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    p.add_argument("--tls-server-name", default="", help="name to verify in the server certificate")
    p.add_argument("--token-file", default="", help=f"file holding the admin token (default: ${TOKEN_ENV})")
    cmds = p.add_subparsers(dest="admin_cmd", required=True, metavar="COMMAND")
    cmds.add_parser("nodes", help="list registered nodes")
    cmds.add_parser("stats", help="index and replica statistics")
    q = cmds.add_parser("query", help="longest present prefix of a hash chain")
    q.add_argument("--namespace", required=True)
    q.add_argument("--hash", dest="hashes", action="append", required=True, help="hex block hash (repeat, in chain order)")
    q.add_argument("--requester", default="", help="node id whose own copies are preferred")
    pub = cmds.add_parser("publish", help="publish blocks for a node (hash i at offset + i*size)")
    pub.add_argument("--node", required=True)
    pub.add_argument("--hash", dest="hashes", action="append", required=True, help="hex block hash (repeat)")
    pub.add_argument("--offset", type=int, required=True)
    pub.add_argument("--size", type=int, required=True)
    pub.add_argument("--generation", type=int, default=0)
    inv = cmds.add_parser("invalidate", help="remove blocks from the index")
    inv.add_argument("--hash", dest="hashes", action="append", help="hex block hash (repeat; needs --namespace)")
    inv.add_argument("--node", help="every block of this node")
    inv.add_argument("--namespace", help="with --hash: where the hashes live; alone: every block in it")
    inv.add_argument("--all", action="store_true", help="every block of every node")
    inv.add_argument("--yes", action="store_true", help="do not ask before --all")
    dr = cmds.add_parser("drain", help="stop using a node as a source and refuse its publishes")
    dr.add_argument("node")
    ud = cmds.add_parser("undrain", help="undo drain: the node is a source again and its publishes are accepted")
    ud.add_argument("node")
    accept_after_subcommands(p, *GROUP_OPTIONS)


def _hashes(values: Sequence[str]) -> list[bytes]:
    out = []
    for v in values:
        try:
            out.append(bytes.fromhex(v))
        except ValueError:
            raise ArgError(f"--hash {v!r} is not hexadecimal") from None
    return out


def _table(rows: list[list[object]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _node_dict(node: NodeRecord) -> dict[str, object]:
    data = asdict(node)
    del data["session_digest"]  # server-side only (and never sent)
    return data


def _security(args: argparse.Namespace) -> ClientSecurity:
    if args.token_file:
        return ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.token_file,
                                         args.tls_server_name)
    return ClientSecurity(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name,
                          os.environ.get(TOKEN_ENV, "").strip())


def _run(args: argparse.Namespace, client: MetaClient) -> tuple[object, str]:
    """Perform the command; returns (json-able result, human text)."""
    cmd = args.admin_cmd
    if cmd == "nodes":
        nodes = client.list_nodes()
        data = [dict(_node_dict(n), num_blocks=k) for n, k in nodes]
        rows = [[n.node_id, n.session_address, n.api_url or "-", n.namespace, n.capacity_bytes, k,
                 f"{n.lease_id:x}", "draining" if n.draining else "active"] for n, k in nodes]
        return data, _table(rows, ["NODE", "SESSION", "API", "NAMESPACE", "CAPACITY_BYTES", "BLOCKS", "LEASE",
                                   "STATE"])
    if cmd == "stats":
        s = client.stats()
        data = asdict(s)
        lines = [f"replica            {s.replica_id}", f"nodes              {s.index.num_nodes}",
                 f"blocks             {s.index.num_blocks}", f"copies             {s.index.num_copies}",
                 f"queries            {s.queries}", f"query hit blocks   {s.query_hit_blocks}/{s.query_blocks}",
                 f"published blocks   {s.published_blocks}",
                 f"etcd               {'healthy' if s.etcd_healthy else 'UNREACHABLE (degraded)'}",
                 f"pending writes     {s.pending_writes}"]
        if s.index.namespaces:
            lines += ["", _table([[n.namespace, n.num_blocks, n.num_copies - n.num_disk_copies, n.dram_bytes,
                                   n.num_disk_copies, n.disk_bytes] for n in s.index.namespaces],
                                 ["NAMESPACE", "BLOCKS", "DRAM COPIES", "DRAM BYTES", "DISK COPIES", "DISK BYTES"])]
        return data, "\n".join(lines)
    if cmd == "query":
        r = client.query_prefix(args.namespace, _hashes(args.hashes), args.requester)
        data = {"num_matched": r.num_matched, "locations": [dict(asdict(loc), block_hash=loc.block_hash.hex())
                                                             for loc in r.locations]}
        rows = [[loc.block_hash.hex()[:16], loc.node_id, r.nodes[loc.node_id].session_address, loc.offset,
                 loc.size_bytes, loc.generation, loc.medium.name] for loc in r.locations]
        text = f"matched {r.num_matched} of {len(args.hashes)} blocks"
        if rows:
            text += "\n" + _table(rows, ["HASH", "NODE", "SESSION", "OFFSET", "SIZE", "GENERATION", "MEDIUM"])
        return data, text
    if cmd == "publish":
        recs = [BlockRecord(BlockHash(h), args.offset + i * args.size, args.size, args.generation)
                for i, h in enumerate(_hashes(args.hashes))]
        n = client.publish(args.node, recs)
        return {"num_published": n}, f"published {n} blocks for node {args.node}"
    if cmd == "invalidate":
        return _invalidate(args, client)
    if cmd == "drain":
        n = client.drain(args.node)
        return {"num_removed": n}, f"node {args.node} draining; {n} blocks removed from the index"
    if cmd == "undrain":
        was_draining = client.undrain(args.node)
        text = (f"node {args.node} active again: a source, its publishes accepted (its blocks return to the "
                f"index as it re-publishes them)" if was_draining else
                f"node {args.node} was not draining; nothing changed")
        return {"was_draining": was_draining}, text
    raise ArgError(f"unknown command {cmd}")


def _invalidate(args: argparse.Namespace, client: MetaClient) -> tuple[object, str]:
    targets = [bool(args.hashes), bool(args.node), bool(args.all)]
    if sum(targets) > 1:
        raise ArgError("give one of --hash, --node, --namespace or --all")
    if args.hashes:
        if not args.namespace:
            raise ArgError("--hash needs --namespace")
        n = client.invalidate(namespace=args.namespace, hashes=_hashes(args.hashes))
    elif args.node:
        n = client.invalidate(node_id=args.node)
    elif args.all:
        if not args.yes and not _confirm("Invalidate every block of every node?"):
            raise KeyboardInterrupt
        n = client.invalidate(all=True)
    elif args.namespace:
        n = client.invalidate(namespace=args.namespace, by_namespace=True)
    else:
        raise ArgError("give one of --hash, --node, --namespace or --all")
    return {"num_removed": n}, f"invalidated {n} block copies"


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        print(f"kvpool admin: {question} refusing without --yes (stdin is not a terminal)", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def main(args: argparse.Namespace) -> int:
    if not args.metaserver:
        print("kvpool admin: error: the following arguments are required: --metaserver", file=sys.stderr)
        return EXIT_ARGS
    try:
        with MetaClient(args.metaserver, timeout_s=args.timeout, security=_security(args)) as client:
            data, text = _run(args, client)
    except ArgError as err:
        print(f"kvpool admin: error: {err}", file=sys.stderr)
        return EXIT_ARGS
    except KeyboardInterrupt:
        print("kvpool admin: aborted", file=sys.stderr)
        return EXIT_ABORTED
    except Unavailable as err:
        print(f"kvpool admin: error: metaserver unreachable: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MetaError as err:
        print(f"kvpool admin: error: {err.code.name}: {err}", file=sys.stderr)
        return EXIT_SERVER
    except ValueError as err:
        print(f"kvpool admin: error: {err}", file=sys.stderr)
        return EXIT_ARGS
    print(json.dumps(data, indent=2, default=str) if args.json else text)
    return 0
