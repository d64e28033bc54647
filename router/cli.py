"""`kvpool router`: the command line of the cache-aware front door (`router.app`)."""
from __future__ import annotations

import argparse
import logging
import sys

from router.policy import DISK_COST, POLICIES

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("router", help="OpenAI-compatible front door routing to engine nodes (prefix-aware)")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve on")
    p.add_argument("--nodes", default="", help="the engine nodes' URLs, comma-separated (http://HOST:PORT,...)")
    p.add_argument("--discover", action="store_true",
                   help="also route to the nodes registered with --metaserver that announce an API URL, joining "
                        "and leaving as they register and go (with no --nodes: only those)")
    p.add_argument("--discover-interval", type=float, default=2.0, help="seconds between reads of the node registry")
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation: each request is prefilled on a --prefill node (chosen by "
                        "--policy), which hands its KV over through the pool, then decoded on the least loaded "
                        "--decode node")
    p.add_argument("--prefill", default="", help="--pd: the prefill (producer) nodes' URLs, comma-separated")
    p.add_argument("--decode", default="", help="--pd: the decode (consumer) nodes' URLs, comma-separated")
    p.add_argument("--policy", choices=POLICIES, default="prefix")
    p.add_argument("--metaserver", default="",
                   help="HOST:PORT[,..] of the metadata service: policy prefix then reads the global index (a "
                        "node-local view of it) for what each node's pool holds")
    p.add_argument("--metaserver-token-file", default="", help="the metaserver's query token, if it checks tokens")
    p.add_argument("--metaserver-tls-ca", default="", help="CA bundle when the metaserver serves TLS")
    p.add_argument("--metaserver-tls-cert", default="", help="client certificate (mutual TLS)")
    p.add_argument("--metaserver-tls-key", default="", help="client key (mutual TLS)")
    p.add_argument("--model", default="smollm2-135m",
                   help="the nodes' model (its tokenizer and chat template hash prompts as the nodes do)")
    p.add_argument("--load-weight", type=float, default=32.0,
                   help="prefix: prefill tokens one generating request on a node is worth (higher: balance the "
                        "number of requests more)")
    p.add_argument("--pull-value", type=float, default=0.9,
                   help="prefix: share of a recompute that a token pulled from another node's pool saves (0..1; "
                        "on loopback TCP a pull costs a few %% of a recompute)")
    p.add_argument("--disk-cost", type=float, default=DISK_COST,
                   help="prefix: prefill tokens one block read from a disk tier costs (its own or another node's; "
                        "default: SmolLM2's block at the tier's measured read rate, docs/BENCHMARKS.md)")
    p.add_argument("--prefix-wait", type=float, default=10.0,
                   help="prefix: a request whose leading blocks (half of its prompt or more) another one is still "
                        "computing waits up to this long (s) for the other's first token before it is routed, "
                        "then hits the prefix (0 = never wait)")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health probes of the nodes")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="prefix: wait this long for every node's /kv_layout at start (with --discover and no "
                        "--nodes: for a first node to register)")


def _listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--listen takes HOST:PORT, got {value!r}")
    return host, int(port)


def _urls(value: str) -> list[str]:
    return [u.strip() for u in value.split(",") if u.strip()]


def _node_urls(args: argparse.Namespace) -> list[str]:
    """The --nodes (checked with the flags that go with them; for --pd: none)."""
    if args.pd:
        if args.nodes or args.discover:
            raise ValueError("--pd takes --prefill URL,.. and --decode URL,.. (not --nodes or --discover)")
        if not _urls(args.prefill) or not _urls(args.decode):
            raise ValueError("--pd needs --prefill URL,.. and --decode URL,..")
        return []
    if args.prefill or args.decode:
        raise ValueError("--prefill and --decode go with --pd")
    urls = _urls(args.nodes)
    if not urls and not args.discover:
        raise ValueError("give the nodes: --nodes URL,.. or --discover (with --metaserver)")
    if args.discover and not args.metaserver:
        raise ValueError("--discover reads the node registry: it needs --metaserver HOST:PORT")
    if args.discover_interval <= 0:
        raise ValueError(f"--discover-interval must be > 0, got {args.discover_interval}")
    return urls


async def _build(args: argparse.Namespace):  # noqa: ANN202 - web.Application
    from engine.kernel_tags import layout_part
    from metaserver.client import MetaClient
    from metaserver.credentials import ClientSecurity
    from metaserver.view import IndexView
    from router.app import Router, build_app
    from router.backends import Backends, LayoutError, NoLayout
    from router.chain import PromptHasher
    from router.discovery import Discovery, first_announced
    from router.pd import PDRouter
    from router.policy import make_policy

    if args.pd:
        backends = Backends(_urls(args.decode), args.probe_interval)
        prefill: Backends | None = Backends(_urls(args.prefill), args.probe_interval)
        groups = [prefill, backends]
    else:
        backends, prefill = Backends(_node_urls(args), args.probe_interval, allow_empty=args.discover), None
        groups = [backends]
    for g in groups:
        await g.start()
    client = None
    if args.metaserver:
        security = ClientSecurity.from_files(tls_ca_file=args.metaserver_tls_ca, tls_cert_file=args.metaserver_tls_cert,
                                             tls_key_file=args.metaserver_tls_key, token_file=args.metaserver_token_file)
        client = MetaClient(args.metaserver, security=security)
    hasher, view, discovery, want = None, None, None, None

    async def cleanup() -> None:
        if discovery is not None:
            await discovery.close()
        for g in groups:
            await g.close()
        if view is not None:
            view.close()
        if client is not None:
            client.close()

    try:
        layouts: list[dict] = []
        if args.policy == "prefix" or args.pd:  # P/D: the KV handed over must fit every node's cache
            try:
                layouts = [layout for g in groups for layout in await g.layouts(args.startup_timeout)]
            except NoLayout as err:
                if args.policy == "prefix":
                    raise
                # vLLM servers do not say their layout; their connector checks it on each hand-off.
                log.info("%s: not checking the nodes' KV layouts (their connectors do)", err)
        if args.policy == "prefix" or layouts:
            if not layouts:  # --discover alone: the first node to register fixes the layout
                assert client is not None
                first = await first_announced(client, args.startup_timeout)
                layouts = [await backends.layout(first.api_url.rstrip("/"), args.startup_timeout)]
            hasher = PromptHasher(args.model, served_name=layouts[0]["model"])
            want = hasher.expect(layouts[0]["dtype"], int(layouts[0]["block_size"]), layouts[0]["fingerprint"])
            for node, layout in zip([n for g in groups for n in g.nodes], layouts):
                if layout["fingerprint"] != want:
                    why = (" (the nodes' CPU classes or kernel choices differ, so their KV is not bit-identical:"
                           " route each class apart, or start them with one --kernels)"
                           if layout_part(layout["fingerprint"]) == layout_part(want) else "")
                    raise LayoutError(f"node {node.url} has KV layout {layout['fingerprint']!r}; the router hashes "
                                      f"prompts for {want!r} (--model {args.model}): it would never predict a hit{why}")
                node.node_id = layout.get("node_id", "")
            for g in groups:
                await g.cache_sizes()
            if client is not None and args.policy == "prefix":
                view = IndexView(client, want)
            if args.policy != "prefix":
                hasher = None
        policy = make_policy(args.policy, hasher.block_size if hasher else 0, view, args.load_weight, args.pull_value,
                             args.disk_cost)
        if args.discover:
            assert client is not None
            # A hashing router offers only nodes of its own layout: the registry's namespace is it.
            discovery = Discovery(client, backends, policy, want, args.discover_interval)
            await discovery.start()
    except BaseException:
        await cleanup()
        raise
    if prefill is not None:
        return build_app(PDRouter(prefill, backends, policy, hasher, prefix_wait_s=args.prefix_wait), cleanup)
    return build_app(Router(backends, policy, hasher, prefix_wait_s=args.prefix_wait), cleanup)


def main(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine.loader import ModelLoadError
    from router.backends import LayoutError

    try:
        host, port = _listen(args.listen)
        _node_urls(args)
        if args.prefix_wait < 0:
            raise ValueError(f"--prefix-wait must be >= 0, got {args.prefix_wait}")
        if args.load_weight < 0 or not 0 <= args.pull_value <= 1 or args.disk_cost < 0:
            raise ValueError(f"need --load-weight >= 0, 0 <= --pull-value <= 1 and --disk-cost >= 0, got "
                             f"{args.load_weight}, {args.pull_value}, {args.disk_cost}")
        web.run_app(_build(args), host=host, port=port, print=None, handle_signals=True)
    except (ValueError, LayoutError, ModelLoadError, OSError, TimeoutError) as err:
        print(f"kvpool router: error: {err}", file=sys.stderr)
        return 2
    return 0
