"""The router's HTTP side: an OpenAI-compatible proxy in front of the engine nodes.

POST /v1/completions and /v1/chat/completions go to the node the policy picks, with the
client's body and Authorization header as they came; the node's answer (a JSON body, or a
server-sent-event stream) is passed back as it arrives, chunk by chunk. A node that refuses
the connection, drops it, or answers 5xx before its first byte is taken out (503 overloaded:
only skipped) and the request goes to the next choice among the nodes not tried yet; once a
byte has reached the client the request stays where it is (a stream cannot be replayed), so
a node dying mid-stream ends that stream with an error event. GET /v1/models is forwarded
to a node that is up; /health is 200 while one node is up; /metrics is Prometheus text.

A body that is not JSON gets the router's own 400 (OpenAI error body) and reaches no node;
anything else a node refuses, the node answers (its 400 passes through unchanged).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from router.backends import Backend, Backends
from router.chain import Chain, PromptHasher
from router.metrics import PREFIX, ErrorEvents, Family, Kind, counter, label_value, render
from router.policy import Choice, Policy

log = logging.getLogger(__name__)
ROUTER = web.AppKey("router", "Router")
# Hop-by-hop and length headers are the proxy's own business on each side.
_SKIP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status)


class Router:
    def __init__(self, backends: Backends, policy: Policy, hasher: PromptHasher | None,
                 prefix_wait_s: float = 10.0, prefix_wait_blocks: int = 2) -> None:
        """`prefix_wait_s`, `prefix_wait_blocks`: a request that has at least that many leading
        blocks (and half of its own) in common with another one still in its prefill waits (at
        most that long) for the other's first byte before it is routed, so it hits the prefix
        (on that node, or pulled from its pool) instead of computing it a second time beside it."""
        self.backends = backends
        self.policy = policy
        self.hasher = hasher
        self.prefix_wait_s = prefix_wait_s
        self.prefix_wait_blocks = prefix_wait_blocks
        self._prefilling: dict[str, list[tuple[tuple[bytes, ...], asyncio.Event]]] = {}  # node url -> chains
        self.retries = 0        # requests sent again to another node (counter)
        # requests that got an error: no node could take them (503), or their stream ended in
        # an error event, the node's own or the router's for a node that failed mid-answer (counter)
        self.errors = 0
        self.prefix_waits = 0   # requests held for a prefix being computed on their node (counter)
        self.requests = 0

    def _chain(self, body: bytes, chat: bool) -> Chain | None:
        return self.hasher.chain(body, chat) if self.hasher is not None else None

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.read()
        try:
            json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error_response(400, f"invalid JSON body: {err}")
        self.requests += 1
        # Tokenizing a long prompt takes milliseconds: off the event loop, which streams for everyone.
        chain = await asyncio.to_thread(self._chain, body, chat) if self.policy.name == "prefix" else None
        return await self._send(request, body, forward_headers(request), chain, self.backends, self.policy)

    async def _send(self, request: web.Request, body: bytes, headers: dict[str, str], chain: Chain | None,
                    backends: Backends, policy: Policy) -> web.StreamResponse:
        """Send the request to the node `policy` picks among `backends` and pass its answer on;
        the next choice while a node fails before its first byte; 503 when none is left."""
        tried: set[str] = set()
        last = "no node is up"
        while True:
            nodes = [n for n in backends.up() if n.url not in tried]
            if not nodes:
                self.errors += 1
                return error_response(503, f"no node could take the request ({last})", "server_error")
            if not tried:
                await self._wait_for_shared_prefix(chain)
            choice = policy.choose(nodes, chain)
            node = choice.node
            if tried:
                self.retries += 1
            tried.add(node.url)
            node.in_flight += 1
            node.prefilling += choice.compute_tokens
            mine = self._hold(node, chain, policy)
            progress = _Progress(mine[1].set if mine is not None else None)
            try:
                await self._wait_for_shared_prefix(chain, mine, node)
                resp = await self._forward(request, node, body, headers, backends, choice, progress)
            except _NotAccepted as err:
                last = f"{node.url}: {err}"
                continue
            finally:
                node.in_flight -= 1
                if progress.started:
                    node.decoding -= 1
                else:
                    node.prefilling -= choice.compute_tokens
                self._release(node, mine)
            return resp

    def _hold(self, node: Backend, chain: Chain | None,
              policy: Policy) -> tuple[tuple[bytes, ...], asyncio.Event] | None:
        """Note that a request with `chain` is in its prefill on `node` (until `_release`)."""
        if chain is None or not chain.hashes:
            return None
        entry = (chain.hashes, asyncio.Event())
        self._prefilling.setdefault(node.url, []).append(entry)
        policy.routed(node, chain)  # the prefix will be there: later requests predict the hit
        return entry

    def _release(self, node: Backend, entry: tuple[tuple[bytes, ...], asyncio.Event] | None) -> None:
        if entry is None:
            return
        entry[1].set()
        pending = self._prefilling.get(node.url, [])
        if entry in pending:
            pending.remove(entry)

    async def _wait_for_shared_prefix(self, chain: Chain | None,
                                      mine: tuple[tuple[bytes, ...], asyncio.Event] | None = None,
                                      node: Backend | None = None) -> None:
        """Wait for the first byte of an earlier request still in its prefill that shares at least
        `prefix_wait_blocks` leading blocks, and at least half of its own, with this one (the
        longest such share): on `node`, or on any node when None. Before a choice (node None) this
        keeps a request from computing a prefix beside the one computing it elsewhere: once the
        other's first token is out, the policy sees the prefix where it was computed (a local
        hit there, a pull from anywhere else) instead of a recompute."""
        if chain is None or not chain.hashes or self.prefix_wait_s <= 0:
            return
        urls = [node.url] if node is not None else list(self._prefilling)
        best, event = 0, None
        for url in urls:
            for hashes, ev in self._prefilling.get(url, []):
                if (mine is not None and ev is mine[1]) or ev.is_set():
                    continue
                shared = 0
                for a, b in zip(hashes, chain.hashes):
                    if a != b:
                        break
                    shared += 1
                if shared > best:
                    best, event = shared, ev
        # A share of a few leading blocks (a system prompt) is not worth a whole prefill's wait.
        if event is None or best < self.prefix_wait_blocks or 2 * best < len(chain.hashes):
            return
        self.prefix_waits += 1
        try:
            await asyncio.wait_for(event.wait(), self.prefix_wait_s)
        except asyncio.TimeoutError:
            pass

    async def _forward(self, request: web.Request, node: Backend, body: bytes, headers: dict[str, str],
                       backends: Backends, choice: Choice, progress: _Progress) -> web.StreamResponse:
        """Send to `node` and pass its answer on; _NotAccepted if nothing was sent back yet
        and another node should try. The first byte back moves the request from the node's
        prefilling to its decoding count (`progress.started`)."""
        try:
            upstream = await backends.session.post(f"{node.url}{request.path}", data=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            backends.mark_down(node, str(err) or type(err).__name__)
            raise _NotAccepted(str(err) or type(err).__name__) from None
        async with upstream:
            if upstream.status >= 500:
                why = f"HTTP {upstream.status}"
                if upstream.status == 503:
                    node.failures += 1  # overloaded or failing: skip it for this request only
                else:
                    backends.mark_down(node, why)
                raise _NotAccepted(why)
            resp = web.StreamResponse(status=upstream.status,
                                      headers={**{k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP},
                                               "x-kvpool-node": node.url})
            started = failed = False
            # Only a stream's error events are errors here: any other answer has its status.
            events = ErrorEvents() if upstream.content_type == "text/event-stream" else None
            try:
                async for data in upstream.content.iter_any():
                    if not started:
                        await resp.prepare(request)
                        started = progress.started = True
                        node.prefilling -= choice.compute_tokens
                        node.decoding += 1
                        node.requests += 1
                        node.predicted_hit_tokens += choice.predicted_hit_tokens
                        progress.first_byte()
                    await resp.write(data)
                    if events is not None:
                        events.feed(data)
            except ConnectionResetError:  # the client went away: stop reading the node's answer
                log.info("client of %s left mid-answer", request.path)
                return resp
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                if not started:
                    backends.mark_down(node, str(err) or type(err).__name__)
                    raise _NotAccepted(str(err) or type(err).__name__) from None
                log.warning("node %s failed mid-answer: %s", node.url, err)
                backends.mark_down(node, f"failed mid-answer: {err}")
                event = {"error": {"message": f"the node serving this request failed: {err}", "type": "server_error"}}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                failed = True
            if events is not None:
                events.close()
            if failed or (events is not None and events.seen):
                self.errors += 1
            if not started:  # an empty body
                await resp.prepare(request)
                node.requests += 1
            await resp.write_eof()
            return resp

    def extra_metrics(self) -> list[Family]:
        """More families (named under router.metrics.PREFIX) for a router that has more to say."""
        return []

    def groups(self) -> list[tuple[str, Backends, Policy]]:
        """The node groups, each with its extra metric label and policy."""
        return [("", self.backends, self.policy)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        for node in self.backends.up():
            try:
                async with self.backends.session.get(f"{node.url}/v1/models",
                                                     headers={k: v for k, v in request.headers.items()
                                                              if k.lower() == "authorization"},
                                                     timeout=aiohttp.ClientTimeout(total=10)) as r:
                    return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                self.backends.mark_down(node, str(err) or type(err).__name__)
        return error_response(503, "no node is up", "server_error")

    async def health(self, request: web.Request) -> web.Response:
        up = len(self.backends.up())
        return web.json_response({"status": "ok" if up else "error", "nodes_up": up,
                                  "nodes": len(self.backends.nodes)}, status=200 if up else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: the router's counters, each node's (labelled node, policy and, for a
        P/D router, role), a subclass's `extra_metrics`; every family with HELP and TYPE."""
        p = PREFIX
        families = [
            counter("requests_total", "Generation requests received (valid JSON bodies)", self.requests),
            counter("prefix_waits_total", "Requests held for a shared prefix another request was computing",
                    self.prefix_waits),
            counter("retries_total", "Requests sent again to another node after one failed before its first byte",
                    self.retries),
            counter("errors_total", "Requests that got an error: no node could take them (HTTP 503), or their "
                    "stream ended in an error event (the node's, or the router's for a node that failed mid-answer)",
                    self.errors)]
        per_node = (
            ("node_requests_total", Kind.COUNTER, "Requests the node answered", lambda b: b.requests),
            ("node_predicted_hit_tokens_total", Kind.COUNTER,
             "Prompt tokens the policy predicted the node would find cached, over the requests it answered",
             lambda b: b.predicted_hit_tokens),
            ("node_failures_total", Kind.COUNTER,
             "Requests to the node that failed: refused, dropped or HTTP 5xx (503 overloaded included)",
             lambda b: b.failures),
            ("node_up", Kind.GAUGE, "1 while the node is taken as up", lambda b: int(b.up)),
            ("node_in_flight", Kind.GAUGE, "Requests the router has in flight on the node", lambda b: b.in_flight),
            ("node_queued", Kind.GAUGE, "Requests running and waiting on the node, from its /metrics at the last probe",
             lambda b: b.queued))
        for name, kind, help_, get in per_node:
            families.append(Family(p + name, kind, help_, tuple(
                (f'{{node="{label_value(b.url)}",policy="{label_value(policy.name)}"{role}}}', get(b))
                for role, backends, policy in self.groups() for b in backends.nodes)))
        families += self.extra_metrics()
        answers = [getattr(policy, "view_answers", None) for _, _, policy in self.groups()]
        if any(a is not None for a in answers):
            families.append(counter("index_answers_total", "Prefix-policy choices made with the index view's answer",
                                    sum(a for a in answers if a is not None)))
        return web.Response(text=render(families), content_type="text/plain")


def forward_headers(request: web.Request) -> dict[str, str]:
    """The client's headers a node gets: its API key and the body's type."""
    return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}


class _Progress:
    """Where a forwarded request is: `started` once the node's first byte reached the client."""

    def __init__(self, on_first_byte: Callable[[], None] | None = None) -> None:
        self.started = False
        self._on_first_byte = on_first_byte

    def first_byte(self) -> None:
        if self._on_first_byte is not None:
            self._on_first_byte()


class _NotAccepted(Exception):
    """The node did not take the request (nothing reached the client): try another."""


def build_app(router: Router, on_cleanup: Callable[[], Awaitable[None]] | None = None) -> web.Application:
    app = web.Application(client_max_size=16 << 20)
    app[ROUTER] = router
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics)

    async def cleanup(_: web.Application) -> None:
        if on_cleanup is not None:
            await on_cleanup()

    app.on_cleanup.append(cleanup)
    return app
