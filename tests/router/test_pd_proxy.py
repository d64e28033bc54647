"""`PDRouter`'s two legs against scripted nodes on loopback: what a prefill node is asked, how
its failures move the request on (next prefill node, the client's own 4xx, or the decode node
computing it all), and a decode node failing before its first byte. Real nodes handing real
KV over are in test_pd_e2e.py."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpool_harness.processes import free_port
from router.app import build_app
from router.backends import Backends
from router.pd import PDRouter
from router.policy import RoundRobin


class Node:
    """A prefill node (`mode`: ok | fail500 | bad400 | noparams) or a decode node (ok |
    die_before), recording the bodies it got."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode = name, mode
        self.seen: list[dict] = []
        self.server: TestServer | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.mode == "fail500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "bad400":
            return web.json_response({"error": {"message": "'prompt' is bad", "type": "invalid_request_error"}},
                                     status=400)
        if self.mode == "die_before":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.name.startswith("p"):  # a prefill node: one token and the params
            answer: dict = {"choices": [{"text": "x"}]}
            if self.mode != "noparams":
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "remote_blocks": [], "from": self.name}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f'data: {{"node": "{self.name}"}}\n\ndata: [DONE]\n\n'.encode())
        await resp.write_eof()
        return resp


def run(modes: dict[str, str], check) -> None:  # noqa: ANN001
    """Prefill nodes p1, p2 and decode nodes d1, d2 (modes by name, default ok) behind a
    PDRouter; `check(url, nodes, router)` runs against it."""
    async def main() -> None:
        nodes = {n: Node(n, modes.get(n, "ok")) for n in ("p1", "p2", "d1", "d2")}
        for n in nodes.values():
            n.server = TestServer(n.app(), host="127.0.0.1", port=free_port())
            await n.server.start_server()
        prefill = Backends([nodes["p1"].url, nodes["p2"].url], probe_interval_s=60)
        decode = Backends([nodes["d1"].url, nodes["d2"].url], probe_interval_s=60)
        for b in (prefill, decode):
            await b.start()

        async def close() -> None:
            await prefill.close()
            await decode.close()

        router = PDRouter(prefill, decode, RoundRobin(), None)
        server = TestServer(build_app(router, close), host="127.0.0.1", port=free_port())
        await server.start_server()
        try:
            await check(str(server.make_url("")).rstrip("/"), nodes, router)
        finally:
            await server.close()
            for n in nodes.values():
                await n.server.close()

    asyncio.run(main())


async def post(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            return r.status, await r.text()


CLIENT = {"prompt": "hello", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}


def test_a_failed_prefill_node_hands_over_to_the_next_and_the_decode_node_gets_its_params() -> None:
    async def check(url, nodes, router) -> None:  # noqa: ANN001
        status, text = await post(url, CLIENT)
        assert status == 200 and '"node": "d' in text
        (asked,) = nodes["p2"].seen
        assert asked["max_tokens"] == 1 and asked["stream"] is False and "stream_options" not in asked
        assert asked["kv_transfer_params"] == {"do_remote_decode": True} and asked["prompt"] == "hello"
        decoded = nodes["d1"].seen + nodes["d2"].seen
        assert decoded == [{**CLIENT, "kv_transfer_params": {"do_remote_prefill": True, "remote_blocks": [],
                                                               "from": "p2"}}]
        assert not router.prefill.nodes[0].up and (router.handoffs, router.fallbacks) == (1, 0)

    run({"p1": "fail500"}, check)


def test_a_prefill_nodes_client_error_is_the_answer() -> None:
    async def check(url, nodes, router) -> None:  # noqa: ANN001
        status, text = await post(url, CLIENT)
        assert status == 400 and json.loads(text)["error"]["message"] == "'prompt' is bad"
        assert not nodes["d1"].seen and not nodes["d2"].seen and len(nodes["p1"].seen) == 1

    run({"p1": "bad400", "p2": "bad400"}, check)


def test_no_handover_means_the_decode_node_computes_it_all() -> None:
    async def check(url, nodes, router) -> None:  # noqa: ANN001
        status, _ = await post(url, CLIENT)
        assert status == 200 and (nodes["d1"].seen + nodes["d2"].seen) == [CLIENT]   # no params added
        assert (router.handoffs, router.fallbacks) == (0, 1)
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        assert "kvpool_router:pd_fallbacks_total 1" in metrics
        assert f'kvpool_router:node_requests_total{{node="{nodes["p1"].url}",policy="round-robin",role="prefill"}} 1' \
            in metrics

    run({"p1": "noparams", "p2": "noparams"}, check)


def test_a_decode_node_failing_before_its_first_byte_is_replaced_with_the_same_params() -> None:
    async def check(url, nodes, router) -> None:  # noqa: ANN001
        for _ in range(2):
            status, text = await post(url, CLIENT)
            assert status == 200 and '"node": "d2"' in text
        assert len(nodes["d1"].seen) == 1 and nodes["d1"].seen[0] == nodes["d2"].seen[0]
        assert router.retries == 1 and not router.backends.nodes[0].up

    run({"d1": "die_before"}, check)
