"""`kvpool router --discover`: nodes join and leave the router's set as they register with,
unregister from, or drain in a real metaserver (etcd behind it). The nodes are scripted
HTTP servers (what is tested is the registry's reading, not the engines); the real engine
nodes announcing their URLs are in test_router_e2e.py."""
from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestServer

from kvpool_harness.processes import MetaserverProcess, free_port
from metaserver.client import MetaClient
from router.backends import Backends
from router.chain import Chain
from router.discovery import Discovery, first_announced
from router.policy import Prefix
from tests.router.test_proxy import Upstream

NS, OTHER = "ns-router", "ns-other-model"
CAP = 1 << 20


def test_nodes_join_and_leave_with_their_registration(metaserver: MetaserverProcess) -> None:
    async def main() -> None:
        ups = [Upstream(n) for n in "abcd"]
        for u in ups:
            u.server = TestServer(u.app(), host="127.0.0.1", port=free_port())
            await u.server.start_server()
        a, b, c, d = (str(u.server.make_url("")).rstrip("/") for u in ups)
        client = MetaClient(metaserver.address)
        backends = Backends([c], probe_interval_s=60, allow_empty=True)   # c: given with --nodes
        await backends.start()
        policy = Prefix(16)
        disc = Discovery(client, backends, policy, NS, interval_s=60)

        def held() -> set[tuple[str, str, bool]]:
            return {(n.url, n.node_id, n.discovered) for n in backends.nodes}

        def register(node_id: str, namespace: str, url: str):  # noqa: ANN202
            return client.register_node(node_id, "127.0.0.1:7001", 0, CAP, namespace, 30, api_url=url)

        try:
            await disc.refresh()
            assert held() == {(c, "", False)}
            reg_a = register("node-a", NS, a + "/")
            register("node-x", OTHER, d)           # another layout: a hashing router never offers it
            register("node-q", NS, "")              # announces no URL: not routable
            await disc.refresh()
            assert held() == {(a, "node-a", True), (c, "", False)}
            assert backends.find(a).up and backends.find(a).queued == 0  # probed before it is offered
            first = await first_announced(client, 5)
            assert (first.node_id, first.api_url) == ("node-a", a + "/")
            register("node-b", NS, b)
            await disc.refresh()
            assert held() == {(a, "node-a", True), (b, "node-b", True), (c, "", False)}
            old_a = backends.find(a)
            policy.routed(old_a, Chain((b"h" * 32,), 17))
            assert policy.table.prefix(old_a, [b"h" * 32]) == 1
            client.unregister_node("node-a", reg_a.lease_id)
            client.drain("node-b")
            await disc.refresh()
            assert held() == {(c, "", False)}      # unregistered and draining nodes leave; --nodes stay
            assert policy.table.prefix(old_a, [b"h" * 32]) == 0   # what the router sent there is forgotten
            register("node-a2", NS, a)              # another node now serves at a's URL
            await disc.refresh()
            assert held() == {(a, "node-a2", True), (c, "", False)} and disc.refreshes == 5
            # A router that does not hash offers every namespace: node-x too.
            await Discovery(client, backends, policy, None).refresh()
            assert held() == {(a, "node-a2", True), (c, "", False), (d, "node-x", True)}
        finally:
            await backends.close()
            client.close()
            for u in ups:
                await u.server.close()

    asyncio.run(main())
