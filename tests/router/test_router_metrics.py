"""The router's /metrics: every family has HELP and TYPE (a P/D router's too), counters end
in `_total` and never go down, and `errors_total` counts a streamed answer that ends in an
error event: the node's own, or the router's for a node that died mid-answer. Scripted
nodes are aiohttp apps on loopback; `ErrorEvents` is also fed streams cut at every byte."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpool_harness.processes import free_port
from router.app import Router, build_app
from router.backends import Backends
from router.metrics import ErrorEvents, Family, Kind
from router.pd import PDRouter
from router.policy import RoundRobin
from tests.exposition import counters, parse

ERROR_EVENT = b'data: {"error": {"message": "engine failed", "type": "server_error", "param": null, "code": null}}\n\n'


class Node:
    """A scripted engine node; `mode`: ok | error_event (a token, then an error event, cut
    mid-line across two writes) | die_mid (a token, then the connection drops) | error_text
    (a token whose text is "error": not an error)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.server: TestServer | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="kvpool:num_requests_running 0\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text = "error" if self.mode == "error_text" else "Hi"
        await resp.write(f'data: {json.dumps({"choices": [{"text": text}]})}\n\n'.encode())
        if self.mode == "die_mid":
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.mode == "error_event":
            await resp.write(ERROR_EVENT[:20])
            await resp.write(ERROR_EVENT[20:])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def served(router: Router, backends: list[Backends]) -> AsyncIterator[str]:
    for b in backends:
        await b.start()
    server = TestServer(build_app(router), host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()
        for b in backends:
            await b.close()


@contextlib.asynccontextmanager
async def nodes(count: int) -> AsyncIterator[list[Node]]:
    started = [Node() for _ in range(count)]
    for n in started:
        n.server = TestServer(n.app(), host="127.0.0.1", port=free_port())
        await n.server.start_server()
    try:
        yield started
    finally:
        for n in started:
            assert n.server is not None
            await n.server.close()


def url_of(node: Node) -> str:
    assert node.server is not None
    return str(node.server.make_url("")).rstrip("/")


async def stream(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                    json={"prompt": "x", "stream": True}) as r:
        assert r.status == 200
        return await r.text()


async def scrape(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        return parse(await r.text())


def errors(families: dict) -> float:
    (v,) = families["kvpool_router:errors_total"].samples.values()
    return v


def test_a_streamed_answer_ending_in_an_error_event_counts_as_an_error() -> None:
    """Three requests to one node: a good stream, one whose text is "error" (no error), one
    with the node's error event cut across two writes (an error): errors_total goes 0, 0, 1,
    the client gets the event as the node sent it, and no counter goes down."""
    async def main() -> None:
        async with nodes(1) as (node,):
            backends = Backends([url_of(node)], probe_interval_s=60)
            async with served(Router(backends, RoundRobin(), None), [backends]) as url:
                first = await scrape(url)
                seen = []
                for mode in ("ok", "error_text", "error_event"):
                    node.mode = mode
                    text = await stream(url)
                    seen.append((mode, errors(await scrape(url))))
                last = await scrape(url)
        assert ERROR_EVENT.decode() in text
        assert seen == [("ok", 0), ("error_text", 0), ("error_event", 1)]
        old, new = counters(first), counters(last)
        assert [k for k, v in old.items() if new.get(k, -1) < v] == []
        assert new[("kvpool_router:requests_total", ())] == 3

    asyncio.run(main())


def test_a_node_dying_mid_stream_counts_as_an_error() -> None:
    async def main() -> None:
        async with nodes(1) as (node,):
            node.mode = "die_mid"
            backends = Backends([url_of(node)], probe_interval_s=60)
            router = Router(backends, RoundRobin(), None)
            async with served(router, [backends]) as url:
                text = await stream(url)
                families = await scrape(url)
        assert "the node serving this request failed" in text
        assert errors(families) == 1 and router.retries == 0

    asyncio.run(main())


def test_every_family_of_a_pd_router_has_help_and_type() -> None:
    """A P/D router (two node groups, its own extra families): the strict parser takes its
    exposition, counters are typed and named as such, the per-node families carry each node
    once per group, and docs/METRICS.md lists every family."""
    async def main() -> dict:
        async with nodes(2) as (pre, dec):
            prefill, decode = Backends([url_of(pre)], probe_interval_s=60), Backends([url_of(dec)], probe_interval_s=60)
            async with served(PDRouter(prefill, decode, RoundRobin(), None), [prefill, decode]) as url:
                return await scrape(url)

    families = asyncio.run(main())
    types = {name: f.type for name, f in families.items()}
    assert types["kvpool_router:pd_fallbacks_total"] == "counter" and types["kvpool_router:errors_total"] == "counter"
    assert types["kvpool_router:node_up"] == "gauge"
    roles = sorted(dict(labels)["role"] for _, labels in families["kvpool_router:node_up"].samples)
    assert roles == ["decode", "prefill"]
    documented = (Path(__file__).resolve().parents[2] / "docs" / "METRICS.md").read_text()
    assert [name for name in families if f"`{name}`" not in documented] == []


def test_a_family_refuses_a_counter_not_named_total() -> None:
    with pytest.raises(ValueError, match="_total"):
        Family("kvpool_router:errors", Kind.COUNTER, "Errors", (("", 1),))
    with pytest.raises(ValueError, match="_total"):
        Family("kvpool_router:up_total", Kind.GAUGE, "Up", (("", 1),))


# ---- the watch on streams ---------------------------------------------------------------

# Texts that are, or quote, the word "error": no error event among them.
GOOD_STREAM = (b'data: {"choices": [{"text": "error"}]}\n\ndata: {"choices": [{"text": "\\"error\\""}]}\n\n'
               b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream_bytes,want", [
    (GOOD_STREAM, False),
    (GOOD_STREAM[:-14] + ERROR_EVENT + b"data: [DONE]\n\n", True),
    (GOOD_STREAM[:-14] + b'data: {"object": "error", "message": "x"}\r\n\r\n', True),   # vLLM's older form
    (GOOD_STREAM[:-14] + ERROR_EVENT.rstrip(b"\n"), True),                             # no newline at the end
    (b'data: {"error": null}\n\n', False),
    (b': a comment with "error" in it\n\n', False),
])
def test_error_events_are_found_wherever_the_chunks_are_cut(stream_bytes: bytes, want: bool) -> None:
    for cut in range(len(stream_bytes) + 1):
        watch = ErrorEvents()
        watch.feed(stream_bytes[:cut])
        watch.feed(stream_bytes[cut:])
        watch.close()
        assert watch.seen is want, cut
