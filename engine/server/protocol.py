"""OpenAI request parsing and validation, and the response bodies.

Every problem with a request becomes `BadRequest` (an HTTP 400 with an OpenAI-style error
body), or its subclass `ModelNotFound` (HTTP 404, as vLLM answers an unknown model); nothing
is queued until the whole request validated.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput
from engine.request import SamplingParams


class BadRequest(Exception):
    """A request the server refuses; `status` is the HTTP status to answer with, `body()` the
    OpenAI-style error body."""

    status = 400
    type_ = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type_, "param": self.param, "code": self.code}}


class ModelNotFound(BadRequest):
    """The request names a model this server does not serve: HTTP 404, type NotFoundError,
    code model_not_found (vLLM's answer)."""

    status = 404
    type_ = "NotFoundError"

    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        also = f" (also accepted: {', '.join(repr(n) for n in served[1:])})" if len(served) > 1 else ""
        super().__init__(f"the model '{model}' does not exist; this server serves '{served[0]}'{also}", "model",
                         "model_not_found")


def error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None      # completions
    messages: list[dict[str, str]] | None  # chat
    params: SamplingParams
    stream: bool
    cache_salt: str | None
    include_usage: bool
    return_token_ids: bool = False      # vLLM's extension: prompt and output token ids in each choice
    kv_transfer_params: dict | None = None  # vLLM's P/D field, for the KV connector


def _num(body: dict[str, Any], key: str, kind: type, default: Any, lo: float | None = None,
         hi: float | None = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"'{key}' must be an integer", key)
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise BadRequest(f"'{key}' must be a number", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return kind(v)


def parse(body: Any, chat: bool, model_names: str | Iterable[str], default_max_tokens: int) -> ParsedRequest:
    """Validate one request body. `model_names`: the names the server answers to, the served
    name first (as `/v1/models` lists them); a body without "model" means the served model.
    Raises BadRequest (ModelNotFound for a model not in `model_names`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    served = (model_names,) if isinstance(model_names, str) else tuple(model_names)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    if model is not None and model not in served:
        raise ModelNotFound(model, served)
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}] needs a role (system, user or assistant) and string content",
                                 "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
        elif not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids", "prompt")
    if _num(body, "n", int, 1, 1, 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 8 of them", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of integers", "stop_token_ids")
    logprobs: int | None
    if chat:
        logprobs = _num(body, "top_logprobs", int, 0, 0, 20) if body.get("logprobs") else None
    else:
        logprobs = _num(body, "logprobs", int, None, 0, 20)
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
        raise BadRequest("'cache_salt' must be a non-empty string of at most 256 characters", "cache_salt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise BadRequest("'return_token_ids' must be a boolean", "return_token_ids")
    transfer = body.get("kv_transfer_params")
    if transfer is not None and not isinstance(transfer, dict):
        raise BadRequest("'kv_transfer_params' must be an object", "kv_transfer_params")
    try:
        params = SamplingParams(
            max_tokens=_num(body, max_key, int, default_max_tokens, 1, 1 << 20),
            temperature=_num(body, "temperature", float, 1.0, 0, 2),
            top_k=_num(body, "top_k", int, 0, -1, 1 << 20) if body.get("top_k", 0) != -1 else 0,
            top_p=_num(body, "top_p", float, 1.0, 0, 1),
            seed=_num(body, "seed", int, None, -(1 << 63), (1 << 63) - 1),
            stop=tuple(stop), stop_token_ids=tuple(stop_ids),
            ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs)
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return ParsedRequest(prompt, messages, params, stream, salt,
                         bool(isinstance(opts, dict) and opts.get("include_usage")), return_ids, transfer)


def usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens + out.num_external_tokens,
                                      # kvpool's split of cached_tokens: local prefix cache vs the pool
                                      "local_cached_tokens": out.num_cached_tokens,
                                      "remote_cached_tokens": out.num_external_tokens}}


def completion_body(rid: str, model: str, out: RequestOutput, text: str, chat: bool, stream: bool,
                    logprobs: Any = None) -> dict[str, Any]:
    """A whole response (stream=False) or one server-sent chunk (stream=True)."""
    reason = out.finish_reason if out.finished else None
    if chat:
        key = "delta" if stream else "message"
        choice: dict[str, Any] = {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason,
                                  "logprobs": logprobs}
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    if out.finished and out.stop_reason is not None:
        choice["stop_reason"] = out.stop_reason
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def logprobs_body(tokenizer, out: RequestOutput, start: int, chat: bool) -> Any:  # noqa: ANN001
    """Logprobs of generated tokens start.. in the OpenAI format of the endpoint."""
    if out.logprobs is None:
        return None
    toks = out.token_ids[start:]
    lps = out.logprobs[start:len(toks) + start]
    if chat:
        return {"content": [
            {"token": tokenizer.token_text(t), "logprob": lp[t], "bytes": list(tokenizer.token_text(t).encode()),
             "top_logprobs": [{"token": tokenizer.token_text(k), "logprob": v}
                              for k, v in sorted(lp.items(), key=lambda kv: -kv[1])]}
            for t, lp in zip(toks, lps)]}
    return {"tokens": [tokenizer.token_text(t) for t in toks], "token_logprobs": [lp[t] for t, lp in zip(toks, lps)],
            "top_logprobs": [{tokenizer.token_text(k): v for k, v in lp.items()} for lp in lps]}
