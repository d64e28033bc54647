"""The HTTP API: /v1/completions, /v1/chat/completions (with server-sent-event streaming),
/v1/models, /health and /metrics, on aiohttp.

A bad request gets HTTP 400 with an OpenAI-style error body (404 for a model this server
does not serve) and changes nothing; the server and the other requests carry on. A request
whose client goes away is aborted in the engine, streaming or not, provided the runner
cancels handlers on disconnect (`handler_cancellation=True`, as `kvpool serve` runs it).
"""
from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from engine.llm_engine import EngineError, LLMEngine
from engine.server.async_engine import AsyncEngine, EngineHost
from engine.server.memory import memory_stats
from engine.server.metrics import Metrics
from engine.server.protocol import BadRequest, ParsedRequest, completion_body, error_body, logprobs_body, parse, usage

log = logging.getLogger(__name__)
ENGINE = web.AppKey("engine", AsyncEngine)
MODEL_NAMES = web.AppKey("model_names", tuple)  # the names requests may give, the served one first


def model_names(engine: LLMEngine) -> tuple[str, ...]:
    """The served name (--served-model-name, else the --model the server was started with)
    and the model's own name, which a client may also use."""
    return tuple(dict.fromkeys((engine.model_name, engine.model_config.name)))


def _json_error(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"invalid JSON body: {err}") from None


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    aeng = request.app[ENGINE]
    eng: LLMEngine = aeng.engine
    try:
        parsed = parse(await _read_json(request), chat, request.app[MODEL_NAMES],
                       default_max_tokens=16 if not chat else 256)
        if chat:
            assert parsed.messages is not None
            try:
                prompt_ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(parsed.messages))
            except ValueError as err:
                raise BadRequest(f"cannot apply the chat template: {err}", "messages") from None
        else:
            assert parsed.prompt is not None
            prompt_ids = eng.tokenizer.encode(parsed.prompt) if isinstance(parsed.prompt, str) else parsed.prompt
    except BadRequest as err:
        return _json_error(err.status, err.body())
    if aeng.dead:
        return _json_error(503, error_body(aeng.dead, "server_error"))
    if not aeng.admit():
        resp = _json_error(503, error_body(f"the server is overloaded ({aeng.in_flight} requests in flight, "
                                           f"--max-pending-requests {aeng.max_in_flight}); retry later",
                                           "server_error", "overloaded"))
        resp.headers["Retry-After"] = "1"
        return resp
    try:
        return await _run(request, aeng, parsed, prompt_ids, chat)
    finally:
        aeng.release()


async def _run(request: web.Request, aeng: AsyncEngine, parsed: ParsedRequest, prompt_ids: list[int],
               chat: bool) -> web.StreamResponse:
    eng: LLMEngine = aeng.engine
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    # aclosing: however the handler ends (the client went away and aiohttp cancelled it, a
    # write failed), the generator's exit aborts the request in the engine now, not at GC.
    async with aclosing(aeng.generate(rid, prompt_ids, parsed.params, parsed.cache_salt,
                                      parsed.kv_transfer_params)) as outputs:
        if parsed.stream:
            return await _stream(request, outputs, rid, chat, parsed.include_usage, eng, parsed.return_token_ids)
        final = None
        try:
            async for out in outputs:
                final = out
        except EngineError as err:
            if aeng.dead:
                return _json_error(503, error_body(aeng.dead, "server_error"))
            return _json_error(400, BadRequest(str(err)).body())
        assert final is not None
        if final.error:
            return _json_error(500, error_body(final.error, "server_error"))
        body = completion_body(rid, eng.model_name, final, final.text, chat, stream=False,
                               logprobs=logprobs_body(eng.tokenizer, final, 0, chat))
        if parsed.return_token_ids:
            body["choices"][0].update(prompt_token_ids=final.prompt_token_ids, token_ids=final.token_ids)
        body["usage"] = usage(final)
        if final.kv_transfer_params is not None:  # as vLLM: for the P/D proxy to pass to a decode node
            body["kv_transfer_params"] = final.kv_transfer_params
        return web.json_response(body)


async def _stream(request: web.Request, outputs, rid: str, chat: bool, include_usage: bool,  # noqa: ANN001
                  eng: LLMEngine, return_token_ids: bool = False) -> web.StreamResponse:
    resp: web.StreamResponse | None = None
    sent_text, sent_tokens = "", 0
    try:
        async for out in outputs:
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
            delta = out.text[len(sent_text):] if out.text.startswith(sent_text) else out.text
            chunk = completion_body(rid, eng.model_name, out, delta, chat, stream=True,
                                    logprobs=logprobs_body(eng.tokenizer, out, sent_tokens, chat))
            if return_token_ids:  # as vLLM: the prompt's ids in the first chunk, each chunk's new ids
                if not sent_tokens:
                    chunk["choices"][0]["prompt_token_ids"] = out.prompt_token_ids
                chunk["choices"][0]["token_ids"] = out.token_ids[sent_tokens:]
            sent_text, sent_tokens = out.text, len(out.token_ids)
            if out.kv_transfer_params is not None:
                chunk["kv_transfer_params"] = out.kv_transfer_params
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if out.finished and include_usage:
                tail = {"id": rid, "object": chunk["object"], "created": int(time.time()), "model": eng.model_name,
                        "choices": [], "usage": usage(out)}
                await resp.write(f"data: {json.dumps(tail)}\n\n".encode())
    except EngineError as err:
        if resp is None:
            return _json_error(400, BadRequest(str(err)).body())
        await resp.write(f"data: {json.dumps(error_body(str(err), 'server_error'))}\n\n".encode())
    assert resp is not None
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    """Every name a request may give, the served one first; `root` is the model's own name."""
    eng = request.app[ENGINE].engine
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvpool", "root": eng.model_config.name,
         "max_model_len": eng.max_model_len} for name in request.app[MODEL_NAMES]]})


async def kv_layout(request: web.Request) -> web.Response:
    """What a router needs to hash prompts as this node does: the served model name (and in
    `model_names` every name requests may give), the layout fingerprint (the hash chain's
    namespace: the model's own name, never the served alias), dtype, block size, and this
    node's id in the pool ("" without a connector)."""
    eng: LLMEngine = request.app[ENGINE].engine
    kvt = eng.config.kv_transfer_config
    return web.json_response({"model": eng.model_name, "model_names": list(request.app[MODEL_NAMES]),
                              "fingerprint": eng.fingerprint, "dtype": eng.config.dtype,
                              "block_size": eng.config.block_size,
                              "node_id": str(kvt.extra("node_id", "")) if kvt else ""})


async def health(request: web.Request) -> web.Response:
    dead = request.app[ENGINE].dead
    return web.json_response({"status": "error", "message": dead} if dead else {"status": "ok"},
                             status=503 if dead else 200)


async def stats(request: web.Request) -> web.Response:
    """The engine's counters as JSON (prefill, local/remote hit tokens, pool traffic), the
    running and waiting requests (the /metrics gauges), the server's admission counters and
    the process's memory (`engine.server.memory`)."""
    aeng = request.app[ENGINE]
    gauges = aeng.metrics.gauges
    return web.json_response({**aeng.engine.stats(), "num_requests_running": gauges["num_requests_running"],
                              "num_requests_waiting": gauges["num_requests_waiting"], "http_in_flight": aeng.in_flight,
                              "http_rejected_overloaded": aeng.rejected, **memory_stats()})


async def metrics(request: web.Request) -> web.Response:
    aeng = request.app[ENGINE]
    return web.Response(text=aeng.metrics.render(aeng.engine.stats(), memory_stats()), content_type="text/plain")


@web.middleware
async def errors(request: web.Request, handler):  # noqa: ANN001, ANN201
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400:
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return _json_error(exc.status, error_body(exc.reason, kind))
        raise


def api_key_middleware(api_key: str):  # noqa: ANN201
    """With an API key set, the /v1/ routes need `Authorization: Bearer <key>` (as vLLM's
    --api-key); /health, /metrics and /stats stay open for probes and scrapers."""
    want = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):  # noqa: ANN001, ANN202
        if request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, want):
                return _json_error(401, error_body("invalid or missing API key (Authorization: Bearer <key>)",
                                                   "authentication_error", "invalid_api_key"))
        return await handler(request)

    return check


def build_app(engine: LLMEngine, max_request_bytes: int = 4 << 20, api_key: str = "",
              max_pending_requests: int = 0, host: EngineHost | None = None) -> web.Application:
    """`max_pending_requests` > 0: a generation request beyond that many in flight (running
    or waiting) gets HTTP 503 (type server_error, code overloaded, Retry-After) at once.
    `host`: the thread that built `engine`, which then runs its loop (EngineHost).

    Run it with `handler_cancellation=True` (web.run_app, AppRunner): aiohttp then cancels
    a handler whose client disconnected, which is what aborts a non-streaming request in the
    engine; without it such a request runs to its end (a stream still stops at its next write)."""
    middlewares = [errors] + ([api_key_middleware(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_request_bytes)
    aeng = AsyncEngine(engine, Metrics(engine.model_name), max_pending_requests, host)
    app[ENGINE] = aeng
    app[MODEL_NAMES] = model_names(engine)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/kv_layout", kv_layout)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)

    async def on_startup(app: web.Application) -> None:
        aeng.start()

    async def on_cleanup(app: web.Application) -> None:
        aeng.stop()
        engine.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
