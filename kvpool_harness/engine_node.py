"""Engine nodes (`kvpool serve`) as child processes on loopback, for tests, benchmarks and
`kvpool cluster`. Each binds 127.0.0.1, logs to its own file and is ended by PID.

Also the HTTP side both ends share: `http_json` (a client call) and `read_api_key` (the
API key `kvpool serve` requires and `kvpool bench cross-node` sends).
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpool_harness.processes import ChildProcess, free_port


def read_api_key(path: str) -> str:
    """The HTTP API key from a file (stripped) or KVPOOL_API_KEY; "" = no key."""
    if path:
        key = Path(path).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {path} is empty")
        return key
    return os.environ.get("KVPOOL_API_KEY", "").strip()


def http_json(url: str, body: object | None = None, timeout_s: float = 600) -> tuple[int, dict]:
    """GET (body None) or POST JSON; returns (status, parsed body; {} for an empty one)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def wait_healthy(node: ChildProcess, name: str, timeout_s: float) -> None:
    """Poll the HTTP node's /health until it answers 200; RuntimeError (and the node killed)
    if it exits or is not ready within `timeout_s`."""
    url = node.url  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not node.alive():
            raise RuntimeError(f"{name} exited; see {node.log_path}")
        try:
            if http_json(f"{url}/health", timeout_s=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    node.kill()
    raise RuntimeError(f"{name} not ready within {timeout_s:g}s; see {node.log_path}")


class EngineProcess(ChildProcess):
    """One `kvpool serve` node; with `metaserver` set it runs `--kv-connector mooncake`."""

    def __init__(self, log_path: Path, node_id: str, metaserver: str = "", model: str = "smollm2-135m",
                 port: int | None = None, pool_size: str = "1GiB", extra_args: tuple[str, ...] = (),
                 kv_transfer_config: dict | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__(log_path)
        self.env = env or {}
        self.node_id = node_id
        self.metaserver = metaserver
        self.model = model
        self.port = port or free_port()
        self.pool_size = pool_size
        self.extra_args = extra_args
        self.kv_transfer_config = kv_transfer_config

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--model", self.model, *self.extra_args]
        if self.metaserver:
            args += ["--kv-connector", "mooncake", "--metaserver", self.metaserver, "--node-id", self.node_id,
                     "--pool-size", self.pool_size]
            if self.kv_transfer_config is not None:
                args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args

    def start(self) -> EngineProcess:
        """Start without waiting (load models of several nodes in parallel); see wait_ready."""
        self.spawn(self.command(), env=self.env)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> EngineProcess:
        wait_healthy(self, f"engine node {self.node_id}", timeout_s)
        return self

    def __enter__(self) -> EngineProcess:
        self.start().ready_or_stopped(self.wait_ready)
        return self

    def complete(self, prompt: list[int] | str, max_tokens: int = 16, **fields: object) -> dict:
        """A greedy /v1/completions call; raises on a non-200 answer."""
        status, body = http_json(f"{self.url}/v1/completions", {
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **fields})
        if status != 200:
            raise RuntimeError(f"node {self.node_id}: HTTP {status}: {body}")
        return body

    def stats(self) -> dict:
        return http_json(f"{self.url}/stats", timeout_s=10)[1]
