"""Nodes from the pool's node registry (`kvpool router --discover`).

Every engine node with the pool on registers with the metaserver, and announces there the
URL of its API (`kvpool serve --advertise-url`, by default http://HOST:PORT). The router
lists the registry every `interval_s`: a registered node that announces a URL, is not
draining and holds the router's namespace (the layout fingerprint it hashes prompts for;
any, when the policy does not hash) joins; a node that joined this way leaves once its
registration is gone (unregistered, lease expired) or it drains. Nodes given with --nodes
are never removed. A metaserver that does not answer changes nothing: the health probes
still take dead nodes out.

Event-loop only, like `router.backends`; the registry is read on a worker thread (the
metaserver client blocks).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from metaserver.client import MetaClient, MetaError
from metaserver.types import NodeRecord
from router.backends import Backends, stop_task
from router.policy import Policy

log = logging.getLogger(__name__)


def announced(listing: Sequence[tuple[NodeRecord, int]], namespace: str | None) -> dict[str, NodeRecord]:
    """URL -> registration of the nodes a router should offer (see the module's rules)."""
    return {n.api_url.rstrip("/"): n for n, _ in listing
            if n.api_url and not n.draining and (namespace is None or n.namespace == namespace)}


async def first_announced(client: MetaClient, timeout_s: float) -> NodeRecord:
    """The announced node with the lowest id, in any namespace, waiting up to `timeout_s`
    for one to register: with no --nodes it fixes the layout a hashing router serves.
    Raises TimeoutError with a one-line reason."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = announced(await asyncio.to_thread(client.list_nodes), None)
        except MetaError as err:
            found, why = {}, f"metaserver: {err}"
        else:
            why = "no registered node announces an API URL"
        if found:
            return min(found.values(), key=lambda n: n.node_id)
        if time.monotonic() > deadline:
            raise TimeoutError(f"--discover found no node within {timeout_s:.0f} s ({why})")
        await asyncio.sleep(0.5)


class Discovery:
    def __init__(self, client: MetaClient, backends: Backends, policy: Policy, namespace: str | None = None,
                 interval_s: float = 2.0) -> None:
        self.client = client
        self.backends = backends
        self.policy = policy
        self.namespace = namespace
        self.interval_s = interval_s
        self.refreshes = 0       # registry listings read (counter)
        self.failures = 0        # listings that failed (counter)
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        """Bring the discovered nodes in line with the registry (one listing)."""
        try:
            listing = await asyncio.to_thread(self.client.list_nodes)
        except MetaError as err:
            self.failures += 1
            log.warning("node registry not read (%s); keeping the %d nodes", err, len(self.backends.nodes))
            return
        self.refreshes += 1
        want = announced(listing, self.namespace)
        for node in list(self.backends.nodes):
            if node.discovered and (node.url not in want or want[node.url].node_id != node.node_id):
                self.backends.remove(node)   # gone, or another node now serves at that URL
                self.policy.forget(node)
        for url, rec in want.items():
            if self.backends.find(url) is None:
                await self.backends.add(url, rec.node_id)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()

    async def close(self) -> None:
        await stop_task(self._task)
