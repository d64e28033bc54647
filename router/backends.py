"""The router's engine nodes: health, load and KV layout, kept current by a probe loop.

A node is `up` while its /health answers 200. One that refuses a connection or fails a
health probe is taken out at once (`mark_down`) and probed again every `probe_interval_s`;
it is back when /health answers 200 again. Load is what the router knows best, its own
requests in flight to the node, plus the node's requests that did not come through this
router: its running and waiting requests (its /metrics) beyond the router's own, as of the
last probe. (Taking the probe's count as the load instead would hold a finished request
against the node for up to a probe interval.)

Event-loop only: every method runs on the router's asyncio loop.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)

# Running and waiting requests in a node's /metrics: ours (kvpool:) and vLLM's (vllm:).
_QUEUE = re.compile(r"^(?:kvpool|vllm):num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background loop and wait until it is gone."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


class LayoutError(Exception):
    """A node's KV layout differs from the router's (or the other nodes'); one line."""


class NoLayout(LayoutError):
    """A node has no /kv_layout: not a kvpool engine node (e.g. a vLLM server)."""


@dataclass
class Backend:
    url: str
    node_id: str = ""          # its id in the pool's index ("" unknown: pool off, or not a kvpool node)
    up: bool = True
    in_flight: int = 0         # this router's requests to it, not finished
    prefilling: int = 0        # of those, the predicted compute tokens of the ones with no byte back yet
    decoding: int = 0          # of those, the ones whose answer has started (prefill done)
    queued: int = 0            # running + waiting, from its /metrics at the last probe
    external: int = 0          # of those, not this router's (queued - in_flight at that probe)
    cache_blocks: int = 0      # its KV cache's blocks (its /stats; 0 unknown)
    requests: int = 0          # routed to it (counter)
    predicted_hit_tokens: int = 0  # the policy's predicted hits of those requests (counter)
    failures: int = 0          # connections refused, 5xx before the first byte (counter)
    discovered: bool = False   # found in the node registry (`router.discovery`), not given by --nodes
    last_error: str = field(default="", repr=False)

    @property
    def load(self) -> int:
        return self.in_flight + self.external


class Backends:
    def __init__(self, urls: list[str], probe_interval_s: float = 1.0, allow_empty: bool = False) -> None:
        """`allow_empty`: nodes may all come later (`add`, from the node registry)."""
        if not urls and not allow_empty:
            raise ValueError("the router needs at least one node URL")
        self.nodes = [Backend(u.rstrip("/")) for u in urls]
        self.probe_interval_s = probe_interval_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Backends.start() first"
        return self._session

    def up(self) -> list[Backend]:
        return [b for b in self.nodes if b.up]

    async def start(self) -> None:
        # No total timeout: a streamed completion lasts as long as it generates.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        await self.probe_all()
        self._task = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        await stop_task(self._task)
        if self._session is not None:
            await self._session.close()

    def find(self, url: str) -> Backend | None:
        return next((b for b in self.nodes if b.url == url.rstrip("/")), None)

    async def add(self, url: str, node_id: str = "") -> Backend:
        """A node found after start: probed (health, load, cache size) before it is offered."""
        node = Backend(url.rstrip("/"), node_id=node_id, discovered=True)
        await self._probe(node)
        await self._cache_size(node)
        self.nodes.append(node)
        log.info("node %s (%s) added", node.url, node_id or "no pool id")
        return node

    def remove(self, node: Backend) -> None:
        """Offer `node` no more (its requests in flight finish where they are)."""
        if node in self.nodes:
            self.nodes.remove(node)
            log.info("node %s (%s) removed", node.url, node.node_id or "no pool id")

    def mark_down(self, node: Backend, why: str) -> None:
        """A request to `node` failed before its first byte: out until a probe finds it healthy."""
        if node.up:
            log.warning("node %s taken out: %s", node.url, why)
        node.up = False
        node.failures += 1
        node.last_error = why

    async def layouts(self, timeout_s: float) -> list[dict]:
        """Every node's /kv_layout, waiting up to `timeout_s` for nodes still starting;
        LayoutError for a node that never answers or is not a kvpool engine node."""
        deadline = time.monotonic() + timeout_s
        return [await self.layout(node.url, deadline - time.monotonic()) for node in self.nodes]

    async def layout(self, url: str, timeout_s: float) -> dict:
        """One node's /kv_layout (see `layouts`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self.session.get(f"{url}/kv_layout", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 404:
                        raise NoLayout(f"node {url} has no /kv_layout (not a kvpool engine node): "
                                       "policy prefix needs kvpool nodes")
                    if r.status == 200:
                        return await r.json()
                    why = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                why = str(err) or type(err).__name__
            if time.monotonic() > deadline:
                raise LayoutError(f"node {url} did not answer /kv_layout within {max(timeout_s, 0):.0f} s ({why})")
            await asyncio.sleep(0.5)

    async def cache_sizes(self) -> None:
        """Each node's KV cache blocks (its /stats `kv_cache_blocks`; left 0 where unknown)."""
        for node in self.nodes:
            await self._cache_size(node)

    async def _cache_size(self, node: Backend) -> None:
        try:
            async with self.session.get(f"{node.url}/stats", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    node.cache_blocks = int((await r.json()).get("kv_cache_blocks", 0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(n) for n in self.nodes))

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe_all()

    async def _probe(self, node: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.probe_interval_s * 2))
        try:
            async with self.session.get(f"{node.url}/health", timeout=timeout) as r:
                healthy = r.status == 200
            if healthy:
                async with self.session.get(f"{node.url}/metrics", timeout=timeout) as r:
                    text = await r.text() if r.status == 200 else ""
                node.queued = int(sum(float(v) for v in _QUEUE.findall(text)))
                node.external = max(0, node.queued - node.in_flight)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            healthy, why = False, str(err) or type(err).__name__
        else:
            why = "health check failed"
        if healthy != node.up:
            log.log(logging.INFO if healthy else logging.WARNING, "node %s %s", node.url,
                    "is back" if healthy else f"taken out: {why}")
        node.up = healthy
        if not healthy:
            node.last_error = why
