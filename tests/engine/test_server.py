"""`kvpool serve` as a real process: the OpenAI API, streaming, metrics, bad requests, the
model's names and clients that go away mid-request. The server runs with an API key
(KVPOOL_API_KEY), a 64 KiB request limit and at most 3 requests in flight; `call` sends the
key."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_harness.processes import free_port
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-4f9b2c71e0d3"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
pytestmark = pytest.mark.slow


def call(base: str, path: str, body: object | bytes | None = None, timeout: float = 120,
         headers: dict[str, str] | None = None) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data,
                                 headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)})
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
def server_log(tmp_path_factory) -> Path:  # noqa: ANN001
    return tmp_path_factory.mktemp("serve") / "serve.log"


@pytest.fixture(scope="module")
def server(server_log: Path) -> Iterator[str]:
    port = free_port()
    log = open(server_log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvpool_cli", "--log-level", "DEBUG", "serve", "--port", str(port),
                             "--kv-cache-bytes", "256MiB", "--max-model-len", "2048", "--threads", "2",
                             "--max-request-bytes", "64KiB", "--max-pending-requests", "3"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "KVPOOL_API_KEY": API_KEY})
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
    assert status == 200 and body["data"][0]["id"] == "smollm2-135m"  # the --model it was started with
    assert call(server, "/health") == (200, {"status": "ok"})


def test_the_served_name_and_the_model_s_own_name_are_accepted(server: str) -> None:
    """As vLLM: the API serves the name given to --model; the model's own name works too; an
    unknown model is a 404 (NotFoundError, model_not_found); the KV namespace keeps the model's
    own name."""
    ids = [m["id"] for m in call(server, "/v1/models")[1]["data"]]
    assert ids == ["smollm2-135m", "SmolLM2-135M-Instruct"]
    for name in ids:
        status, body = call(server, "/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 2})
        assert status == 200 and body["model"] == "smollm2-135m", body
    before = call(server, "/stats")[1]["prefill_tokens"]
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        status, err = call(server, path, {**body, "model": "gpt-17"})
        assert status == 404, err
        assert err["error"]["type"] == "NotFoundError" and err["error"]["code"] == "model_not_found"
        assert err["error"]["param"] == "model" and "smollm2-135m" in err["error"]["message"]
    assert call(server, "/stats")[1]["prefill_tokens"] == before
    layout = call(server, "/kv_layout")[1]
    assert layout["model"] == "smollm2-135m" and layout["fingerprint"].startswith("SmolLM2-135M-Instruct|")


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
           "max_tokens": 40, "return_token_ids": True}
    _, whole = call(server, "/v1/chat/completions", req)
    r = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(
        dict(req, stream=True, stream_options={"include_usage": True})).encode(),
        headers={"Content-Type": "application/json", **AUTH})
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
    # return_token_ids: the prompt's ids in the first chunk, each chunk's new ids after (as vLLM)
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert choices[0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == whole["choices"][0]["token_ids"]


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
    ({"prompt": "hi", "model": 17}, "model"),
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
                 "kvpool:prefix_cache_hit_rate", "kvpool:process_rss_bytes", "kvpool:process_malloc_in_use_bytes",
                 "kvpool:process_malloc_free_bytes"):
        assert name in text, name
    stats = call(server, "/stats")[1]
    assert stats["rss_bytes"] > 100 << 20 and stats["malloc_in_use_bytes"] > 0  # the model alone is > 100 MiB
    ttft_count = next(line for line in text.splitlines() if line.startswith("kvpool:time_to_first_token_seconds_count"))
    assert int(ttft_count.split()[-1]) >= 1


def test_the_api_key_guards_the_v1_routes(server: str, server_log: Path) -> None:
    body = {"prompt": "Hello", "max_tokens": 2}
    before = call(server, "/stats")[1]["prefill_tokens"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, err = call(server, "/v1/completions", body, headers=headers)
        assert status == 401 and err["error"]["type"] == "authentication_error", err
        assert call(server, "/v1/models", headers=headers)[0] == 401
    assert call(server, "/stats")[1]["prefill_tokens"] == before  # rejected requests computed nothing
    assert call(server, "/health", headers={})[0] == 200  # probes need no key
    assert call(server, "/v1/completions", body)[0] == 200
    assert API_KEY not in server_log.read_text()


def test_oversized_requests_get_413(server: str) -> None:
    status, err = call(server, "/v1/completions", {"prompt": "x" * (80 << 10), "max_tokens": 2})
    assert status == 413 and err["error"]["type"] == "invalid_request_error", err
    assert call(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200


def test_requests_beyond_the_limit_get_503_overloaded(server: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    before = call(server, "/stats")[1]
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 48, "ignore_eos": True}
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda _: call(server, "/v1/completions", body), range(8)))
    ok = [b for s, b in answers if s == 200]
    overloaded = [b for s, b in answers if s == 503]
    assert len(ok) + len(overloaded) == 8 and 1 <= len(ok) and len(overloaded) >= 1, [s for s, _ in answers]
    assert all(b["error"]["code"] == "overloaded" and "overloaded" in b["error"]["message"] for b in overloaded)
    assert all(b["usage"]["completion_tokens"] == 48 for b in ok)
    after = call(server, "/stats")[1]
    assert after["http_rejected_overloaded"] - before["http_rejected_overloaded"] == len(overloaded)
    assert after["http_in_flight"] == 0
    assert call(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200


# ---- fuzzed input: malformed JSON and out-of-range fields --------------------------------

def _fuzz_bodies() -> st.SearchStrategy:
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False),
                       st.text(max_size=20))
    anything = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                            max_leaves=8)
    # max_tokens is never a large valid value: a valid body would then decode for a long time
    max_tokens = st.one_of(st.integers(1, 3), st.integers(-(1 << 40), 0), st.integers((1 << 20) + 1, 1 << 40),
                           st.text(max_size=4), st.floats(), st.booleans())
    prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(-(1 << 33), 1 << 33), max_size=8), anything)
    messages = st.one_of(anything, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]), "content": scalar}), max_size=3))
    fields = {"model": st.one_of(st.sampled_from(["smollm2-135m", "SmolLM2-135M-Instruct"]), anything),
              "n": anything, "stop": anything,
              "stop_token_ids": anything, "logprobs": anything, "top_logprobs": anything, "temperature": anything,
              "top_p": anything, "top_k": anything, "seed": anything, "cache_salt": anything,
              "stream": st.one_of(st.just(False), anything), "stream_options": anything,
              "return_token_ids": anything, "ignore_eos": st.just(False), "unknown_field": anything}
    body = st.fixed_dictionaries({"prompt": prompt, "messages": messages, "max_tokens": max_tokens},
                                 optional=fields)
    raw = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode))
    return st.one_of(body, anything, raw)


def test_fuzzed_requests_get_clear_errors_and_change_nothing(server: str) -> None:
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=_fuzz_bodies(), chat=st.booleans())
    def run(body: object, chat: bool) -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        before = call(server, "/stats")[1]
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, answer = call(server, path, data, timeout=60)
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400, 404), (status, answer, data[:200])
        if status in (400, 404):  # 404: a model this server does not serve
            kind = "invalid_request_error" if status == 400 else "NotFoundError"
            assert isinstance(answer, dict) and answer["error"]["type"] == kind
            assert answer["error"]["message"], answer
            after = call(server, "/stats")[1]
            assert after["prefill_tokens"] == before["prefill_tokens"]  # nothing was computed or cached
            assert after["num_requests_loading"] == 0

    run()
    assert seen.get(400, 0) + seen.get(404, 0) > 50, seen  # it reached the validation, not only the happy path
    assert call(server, "/health")[0] == 200
    assert call(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200


def test_cross_node_bench_against_a_node_with_an_api_key(server: str, tmp_path: Path) -> None:
    """`kvpool bench cross-node --urls` sends the key from --api-key-file (401s without it)."""
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    args = [sys.executable, "-m", "kvpool_cli", "bench", "cross-node", "--urls", server, "--users", "1", "--rounds", "2",
            "--groups", "1", "--system-tokens", "32", "--user-tokens", "8", "--output-tokens", "2", "--no-progress",
            "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "r.json")]
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_API_KEY"}
    ok = subprocess.run([*args, "--api-key-file", str(key_file)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    on = json.loads((tmp_path / "r.json").read_text())["configs"]["pool-on"]
    assert on["requests"] == 2 and on["errors"] == 0
    denied = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert denied.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["configs"]["pool-on"]["errors"] == 2
    assert all("HTTP 401" in r["error"] for r in report["requests"]["pool-on"])


# ---- clients that go away mid-request ----------------------------------------------------

def _load(base: str) -> dict[str, float]:
    """The running-requests gauge, generated tokens so far and KV usage from /metrics; the
    running requests and the admitted HTTP requests not answered yet from /stats."""
    _, text = call(base, "/metrics")
    assert isinstance(text, str)
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvpool:") and "{" in line}
    stats = call(base, "/stats")[1]
    return {"running": values["kvpool:num_requests_running"], "tokens": values["kvpool:generation_tokens_total"],
            "kv_usage": values["kvpool:kv_cache_usage_perc"], "stats_running": stats["num_requests_running"],
            "in_flight": stats["http_in_flight"]}


def _idle(base: str) -> dict[str, float] | None:
    """`_load` once nothing runs and no HTTP request is in flight; None before."""
    now = _load(base)
    return now if now["running"] == 0 and now["in_flight"] == 0 else None


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_goes_away_aborts_its_request(server: str, stream: bool) -> None:
    """The client sends a long request (2,000 tokens to generate) and closes its connection
    while the model decodes: the engine drops the request (it stops short of 2,000 tokens
    and frees its blocks) and /metrics and /stats show nothing running or in flight."""
    max_tokens = 2000
    # The gauges follow the engine's step, a moment after the last answer went out: wait.
    before = wait_for(lambda: _idle(server), timeout_s=60, interval_s=0.1)
    assert isinstance(before, dict)
    body = json.dumps({"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}).encode()
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=120)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), API_KEY.encode(), len(body), body))
        if stream:  # the stream has started: its first chunk came
            got = b""
            while b"data: " not in got:
                chunk = sock.recv(4096)
                assert chunk, got
                got += chunk
        wait_for(lambda: _load(server)["tokens"] >= before["tokens"] + 8, timeout_s=120, interval_s=0.1)
        busy = _load(server)
        assert busy["running"] == busy["stats_running"] == 1 and busy["in_flight"] == 1, busy
    finally:
        sock.close()
    idle = wait_for(lambda: _idle(server), timeout_s=60, interval_s=0.1)
    assert isinstance(idle, dict) and idle["stats_running"] == 0, idle
    assert idle["tokens"] - before["tokens"] < max_tokens, idle  # it stopped, not ran to its end
    assert idle["kv_usage"] == 0, idle  # its blocks went back to the pool
    assert call(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200
