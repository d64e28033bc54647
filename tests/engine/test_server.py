"""`kvpool serve` as a real process: the OpenAI API, streaming, metrics and bad requests."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaserver.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def call(base: str, path: str, body: object | bytes | None = None, timeout: float = 120) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read().decode(), err.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:  # noqa: ANN001
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "serve", "--port", str(port), "--kv-cache-bytes",
                             "256MiB", "--max-model-len", "2048", "--threads", "2"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvpool serve exited"
        try:
            if call(base, "/health", timeout=1)[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    yield base
    proc.terminate()
    proc.wait(30)


def test_models_and_health(server: str) -> None:
    status, body = call(server, "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert call(server, "/health") == (200, {"status": "ok"})


def test_completion_and_chat(server: str) -> None:
    status, body = call(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                    "temperature": 0})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["choices"][0]["text"].strip().startswith("Paris")
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    status, body = call(server, "/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                                      "What is the capital of France?"}],
                                                         "temperature": 0, "max_tokens": 30})
    assert status == 200, body
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"] and body["choices"][0]["finish_reason"] == "stop"


def test_streaming_matches_non_streaming(server: str) -> None:
    req = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "temperature": 0,
           "max_tokens": 40}
    _, whole = call(server, "/v1/chat/completions", req)
    r = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(
        dict(req, stream=True, stream_options={"include_usage": True})).encode(),
        headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(r, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    text = "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert len(events) > 5 and events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_stop_seed_and_logprobs(server: str) -> None:
    _, body = call(server, "/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0,
                                               "stop": [" 7"], "logprobs": 2})
    choice = body["choices"][0]
    assert " 7" not in choice["text"] and choice["finish_reason"] == "stop" and choice["stop_reason"] == " 7"
    assert len(choice["logprobs"]["token_logprobs"]) == body["usage"]["completion_tokens"]
    sampled = [call(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0,
                                                "seed": 42})[1]["choices"][0]["text"] for _ in range(2)]
    assert sampled[0] == sampled[1]


BAD = [
    (b"{not json", "invalid JSON"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "model": "gpt-17"}, "does not exist"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [99999999]}, "token ids"),
    ({"prompt": "word " * 3000, "max_tokens": 4}, "context"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ([1, 2, 3], "JSON object"),
]


@pytest.mark.parametrize("body,message", BAD, ids=[m for _, m in BAD])
def test_bad_requests_get_400_and_server_carries_on(server: str, body: object, message: str) -> None:
    status, err = call(server, "/v1/completions", body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error" and message in err["error"]["message"]
    status, ok = call(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_bad_chat_requests(server: str) -> None:
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": "hi"}):
        status, err = call(server, "/v1/chat/completions", body)
        assert status == 400 and "messages" in err["error"]["message"]


def test_metrics(server: str) -> None:
    call(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4})
    _, text = call(server, "/metrics")
    assert isinstance(text, str)
    for name in ("kvpool:time_to_first_token_seconds_count", "kvpool:time_per_output_token_seconds_bucket",
                 "kvpool:num_requests_running", "kvpool:num_requests_waiting", "kvpool:kv_cache_usage_perc",
                 "kvpool:prefix_cache_hit_rate"):
        assert name in text, name
    ttft_count = next(line for line in text.splitlines() if line.startswith("kvpool:time_to_first_token_seconds_count"))
    assert int(ttft_count.split()[-1]) >= 1
