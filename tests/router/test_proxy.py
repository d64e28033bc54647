"""The router's proxy logic against scripted upstream servers on loopback (aiohttp apps that
answer, fail, stream slowly or die mid-stream on cue): retries only before the first byte,
streaming passed through as it arrives, API keys passed through, bad bodies refused at the
door. The real engine nodes are in test_router_e2e.py."""
from __future__ import annotations

import asyncio
import json
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpool_harness.processes import free_port
from router.app import Router, build_app
from router.backends import Backends
from router.chain import Chain
from router.policy import Prefix, RoundRobin


class Upstream:
    """A scripted node: `mode` is ok | fail500 | overloaded | die_before | die_mid | slow |
    hold_first (nothing is sent until `release` is set: a long prefill)."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name = name
        self.mode = mode
        self.seen: list[dict] = []          # bodies received
        self.auth: list[str] = []           # Authorization headers received
        self.release = asyncio.Event()      # slow mode: the second chunk waits for this
        self.server: TestServer | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="kvpool:num_requests_running 0\n")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(await request.json())
        self.auth.append(request.headers.get("Authorization", ""))
        if self.mode == "fail500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "overloaded":
            return web.json_response({"error": {"message": "full"}}, status=503)
        if self.mode == "die_before":
            assert request.transport is not None
            request.transport.close()  # the connection drops with nothing sent
            return web.Response()
        if self.mode == "hold_first":
            await self.release.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f'data: {{"node": "{self.name}", "i": 0}}\n\n'.encode())
        if self.mode == "die_mid":
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.mode == "slow":
            await self.release.wait()
        await resp.write(f'data: {{"node": "{self.name}", "i": 1}}\n\ndata: [DONE]\n\n'.encode())
        await resp.write_eof()
        return resp


class WordHasher:
    """Stands for PromptHasher: one block per word of a completion prompt."""

    def chain(self, body: bytes, chat: bool) -> Chain:
        words = json.loads(body)["prompt"].split()
        return Chain(tuple(w.encode().ljust(32, b".") for w in words), len(words) + 1)


@contextlib.asynccontextmanager
async def scripted_cluster(policy: str = "round-robin") -> AsyncIterator:
    """Three scripted nodes (a, b, c) behind a router (round-robin, or prefix over words);
    yields (router URL, nodes, router)."""
    ups = [Upstream(n) for n in "abc"]
    for u in ups:
        u.server = TestServer(u.app(), host="127.0.0.1", port=free_port())
        await u.server.start_server()
    backends = Backends([str(u.server.make_url("")).rstrip("/") for u in ups], probe_interval_s=60)
    await backends.start()
    router = (Router(backends, RoundRobin(), None) if policy == "round-robin" else
              Router(backends, Prefix(1, None, load_weight=32, pull_value=0.9), WordHasher()))
    server = TestServer(build_app(router, backends.close), host="127.0.0.1", port=free_port())
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), ups, router
    await server.close()
    for u in ups:
        await u.server.close()


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)


def run(test: Callable[..., Awaitable[None]], policy: str = "round-robin") -> None:
    """Run an async test body with a fresh scripted cluster (no asyncio plugin needed)."""
    async def main() -> None:
        async with scripted_cluster(policy) as cluster:
            await test(cluster)

    asyncio.run(main())


async def post(url: str, body: object, **headers: str) -> tuple[int, str, dict]:
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.post(f"{url}/v1/completions", data=data, headers=headers) as r:
            return r.status, await r.text(), dict(r.headers)


def test_requests_go_round_and_keys_pass_through() -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, _ = cluster
        names = {str(u.server.make_url("")).rstrip("/"): u.name for u in ups}
        for i in range(3):
            status, text, headers = await post(url, {"prompt": f"p{i}"}, Authorization="Bearer secret")
            assert status == 200 and '"i": 1' in text
            assert f'"node": "{names[headers["x-kvpool-node"]]}"' in text  # the header names the node that answered
        assert [len(u.seen) for u in ups] == [1, 1, 1]
        assert all(u.auth == ["Bearer secret"] for u in ups)

    run(body)


@pytest.mark.parametrize("mode", ["fail500", "die_before", "overloaded"])
def test_a_node_failing_before_its_first_byte_is_retried_elsewhere(mode: str) -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        ups[0].mode = mode
        status, text, _ = await post(url, {"prompt": "x"})
        assert status == 200 and '"node": "a"' not in text and '"i": 1' in text  # a failed, another took it
        assert len(ups[0].seen) == 1 and len(ups[1].seen) + len(ups[2].seen) == 1 and router.retries == 1
        a = router.backends.nodes[0]
        assert a.up == (mode == "overloaded")  # overloaded: skipped for this request only; else taken out
        for _ in range(4):                    # no request is lost meanwhile
            assert (await post(url, {"prompt": "y"}))[0] == 200

    run(body)


def test_no_retry_once_bytes_reached_the_client() -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        ups[0].mode = "die_mid"
        status, text, _ = await post(url, {"prompt": "x", "stream": True})
        assert status == 200 and '"node": "a", "i": 0' in text and "the node serving this request failed" in text
        assert len(ups[1].seen) == 0 and router.retries == 0   # never sent twice
        assert not router.backends.nodes[0].up

    run(body)


def test_every_node_down_is_a_503_with_an_openai_body() -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        for u in ups:
            u.mode = "fail500"
        status, text, _ = await post(url, {"prompt": "x"})
        body = json.loads(text)
        assert status == 503 and body["error"]["type"] == "server_error" and "no node could take" in body["error"]["message"]
        assert router.errors == 1 and [len(u.seen) for u in ups] == [1, 1, 1]

    run(body)


def test_bad_json_is_refused_at_the_door() -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, _ = cluster
        status, text, _ = await post(url, b"{not json")
        assert status == 400 and "invalid JSON body" in json.loads(text)["error"]["message"]
        assert all(not u.seen for u in ups)

    run(body)


def test_chunks_arrive_before_the_answer_completes() -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        for u in ups:
            u.mode = "slow"
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
                first = await asyncio.wait_for(r.content.readline(), 30)   # the node still holds the rest
                assert b'"i": 0' in first
                busy = [b for b in router.backends.nodes if b.in_flight]
                assert len(busy) == 1 and busy[0].decoding == 1 and busy[0].prefilling == 0  # prefill over
                for u in ups:
                    u.release.set()
                rest = await r.text()
        assert '"i": 1' in rest and "[DONE]" in rest
        assert all(b.in_flight == b.decoding == b.prefilling == 0 for b in router.backends.nodes)

    run(body)


def test_health_metrics_and_models() -> None:
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        await post(url, {"prompt": "x"})
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/health") as r:
                assert r.status == 200 and (await r.json())["nodes_up"] == 3
            async with s.get(f"{url}/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "a"
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        assert "kvpool_router:requests_total 1" in text
        assert f'kvpool_router:node_requests_total{{node="{router.backends.nodes[0].url}",policy="round-robin"}} 1' in text
        assert 'kvpool_router:node_up{' in text


    run(body)

def test_a_request_waits_for_its_prefix_being_computed_on_its_node() -> None:
    """Prefix policy: a second request with the same 20 leading blocks goes to the node still
    prefilling the first (the others are busy) and is held at the router until the first's
    first byte, so the node has the prefix cached when it arrives; an unrelated request is
    not held."""
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        for u in ups:
            u.mode = "hold_first"
        router.backends.nodes[1].external = router.backends.nodes[2].external = 20  # b and c are busy
        shared = " ".join(f"w{i}" for i in range(20))
        first = asyncio.create_task(post(url, {"prompt": shared + " x", "stream": True}))
        while not ups[0].seen:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(post(url, {"prompt": shared + " y", "stream": True}))
        while router.prefix_waits < 1:
            await asyncio.sleep(0.01)
        other = asyncio.create_task(post(url, {"prompt": "z " * 20, "stream": True}))
        while sum(len(u.seen) for u in ups) < 2:  # the unrelated one is forwarded meanwhile
            await asyncio.sleep(0.01)
        sent = [b["prompt"] for u in ups for b in u.seen]
        assert shared + " y" not in sent and router.prefix_waits == 1  # the second is held at the router
        for u in ups:
            u.release.set()
        results = await asyncio.gather(first, second, other)
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert results[0][2]["x-kvpool-node"] == results[1][2]["x-kvpool-node"]  # where the prefix was computed
        assert router.prefix_waits == 1

    run(body, "prefix")


def test_a_request_waits_for_its_prefix_being_computed_elsewhere_before_it_is_routed() -> None:
    """Prefix policy: the node computing a 20-block prefix is now the busiest, so the policy
    would send a second request with the same prefix to another node and compute it there
    again; it is held before the choice until the first's first byte instead. A request that
    shares only 2 of its 20 blocks (a system prompt's worth) is not held."""
    async def body(cluster) -> None:  # noqa: ANN001
        url, ups, router = cluster
        ups[0].mode = "hold_first"
        router.backends.nodes[1].external = router.backends.nodes[2].external = 20  # the first goes to a
        shared = " ".join(f"w{i}" for i in range(20))
        first = asyncio.create_task(post(url, {"prompt": shared + " x", "stream": True}))
        while not ups[0].seen:
            await asyncio.sleep(0.01)
        router.backends.nodes[0].external = 20          # now a is the busy one
        router.backends.nodes[1].external = router.backends.nodes[2].external = 0
        second = asyncio.create_task(post(url, {"prompt": shared + " y", "stream": True}))
        await asyncio.wait_for(until(lambda: router.prefix_waits >= 1), 10)
        short = asyncio.create_task(post(url, {"prompt": "w0 w1 " + "s " * 18, "stream": True}))
        while sum(len(u.seen) for u in ups) < 2:  # the short share is routed meanwhile
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        sent = [b["prompt"] for u in ups for b in u.seen]
        assert shared + " y" not in sent and router.prefix_waits == 1
        assert not second.done()
        ups[0].release.set()
        results = await asyncio.gather(first, second, short)
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert router.prefix_waits == 1

    run(body, "prefix")
