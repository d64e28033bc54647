"""Prefill/decode disaggregation at the router (`kvpool router --pd`).

Each request goes first to a prefill node (the policy's choice among the --prefill nodes;
prefix-aware by default) as a one-token, unstreamed completion with `kv_transfer_params`
{"do_remote_decode": true}: that node computes the prompt, puts its full blocks into its
pool and answers with `kv_transfer_params` naming where they are (`connector.handoff`).
Then the client's own request, with those params added, goes to the decode node with the
fewest requests (the --decode nodes); it reads the blocks straight from the producer's
pool, computes only the tail, and its answer streams back to the client as it comes.

Failures: a prefill node that refuses, drops or fails (5xx) → the next prefill node; none
left, or an answer without params (a node that does not produce) → the decode node computes
the whole prompt (counted as a fallback). A producer that dies after answering → the decode
node's validated reads fail and it recomputes those blocks. A decode node that fails before
its first byte → the next decode node, with the same params (`Router._send`). A client error
(4xx) from the prefill node is the answer.
"""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from router.app import Router, error_response, forward_headers
from router.backends import Backend, Backends
from router.chain import Chain, PromptHasher
from router.metrics import Family, counter
from router.policy import LeastLoaded, Policy

log = logging.getLogger(__name__)


class PDRouter(Router):
    def __init__(self, prefill: Backends, decode: Backends, prefill_policy: Policy, hasher: PromptHasher | None,
                 prefix_wait_s: float = 10.0) -> None:
        super().__init__(decode, LeastLoaded(), hasher, prefix_wait_s)
        self.prefill = prefill
        self.prefill_policy = prefill_policy
        self.handoffs = 0      # requests decoded with a producer's KV (counter)
        self.fallbacks = 0     # requests decoded without it: no prefill node could hand it over (counter)

    def groups(self) -> list[tuple[str, Backends, Policy]]:
        return [(',role="prefill"', self.prefill, self.prefill_policy), (',role="decode"', self.backends, self.policy)]

    def extra_metrics(self) -> list[Family]:
        return [counter("pd_handoffs_total", "Requests decoded with the KV a prefill node handed over", self.handoffs),
                counter("pd_fallbacks_total", "Requests whose decode node computed the whole prompt: no prefill "
                        "node handed its KV over", self.fallbacks)]

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.read()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error_response(400, f"invalid JSON body: {err}")
        if not isinstance(obj, dict):
            return error_response(400, "the request body must be a JSON object")
        self.requests += 1
        chain = await asyncio.to_thread(self._chain, body, chat) if self.prefill_policy.name == "prefix" else None
        headers = forward_headers(request)
        params = await self._prefill(request.path, obj, headers, chain)
        if isinstance(params, web.Response):  # the prefill node refused the request itself (4xx)
            return params
        if params is None:
            self.fallbacks += 1
        else:
            self.handoffs += 1
            obj = {**obj, "kv_transfer_params": params}
        return await self._send(request, json.dumps(obj).encode(), headers, None, self.backends, self.policy)

    async def _prefill(self, path: str, obj: dict, headers: dict[str, str],
                       chain: Chain | None) -> dict | web.Response | None:
        """The producer's transfer params for this request; None if no prefill node handed it
        over; a 4xx answer of a prefill node as the response."""
        body = {**obj, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        data = json.dumps(body).encode()
        tried: set[str] = set()
        while True:
            nodes = [n for n in self.prefill.up() if n.url not in tried]
            if not nodes:
                log.warning("no prefill node could take a request; its decode node computes the prompt")
                return None
            if not tried:
                await self._wait_for_shared_prefix(chain)
            choice = self.prefill_policy.choose(nodes, chain)
            node = choice.node
            tried.add(node.url)
            node.in_flight += 1
            node.prefilling += choice.compute_tokens
            mine = self._hold(node, chain, self.prefill_policy)
            try:
                await self._wait_for_shared_prefix(chain, mine, node)
                status, answer = await self._post(node, path, data, headers)
            finally:
                node.in_flight -= 1
                node.prefilling -= choice.compute_tokens
                self._release(node, mine)
            if status is None or status >= 500:
                continue
            node.requests += 1
            node.predicted_hit_tokens += choice.predicted_hit_tokens
            if status != 200:
                return web.json_response(answer, status=status)
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
                log.warning("prefill node %s answered without transfer params (not a producer?)", node.url)
                return None
            return params

    async def _post(self, node: Backend, path: str, data: bytes,
                    headers: dict[str, str]) -> tuple[int | None, object]:
        """POST to a prefill node: (status, parsed body), or (None, None) if it failed (taken
        out unless it only said 503)."""
        try:
            async with self.prefill.session.post(f"{node.url}{path}", data=data, headers=headers) as r:
                if r.status >= 500:
                    if r.status == 503:
                        node.failures += 1
                    else:
                        self.prefill.mark_down(node, f"HTTP {r.status}")
                    return r.status, None
                return r.status, await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            self.prefill.mark_down(node, str(err) or type(err).__name__)
            return None, None

    async def health(self, request: web.Request) -> web.Response:
        up, pre = len(self.backends.up()), len(self.prefill.up())
        return web.json_response({"status": "ok" if up else "error", "nodes_up": up, "nodes": len(self.backends.nodes),
                                  "prefill_nodes_up": pre, "prefill_nodes": len(self.prefill.nodes)},
                                 status=200 if up else 503)
