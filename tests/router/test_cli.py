"""`kvpool router` start-up errors, with the real CLI in a subprocess: one line on stderr and
exit code 2, before it serves anything. The nodes are scripted `/kv_layout` answers (what is
checked is the router's refusal, not the nodes)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from engine.loader import load_model
from kvpool_harness.processes import free_port


class LayoutNodes:
    """Nodes on loopback that answer /kv_layout with the given bodies (None: 404)."""

    def __init__(self, layouts: list[dict | None]) -> None:
        self.layouts = layouts
        self.ports = [free_port() for _ in layouts]
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        for layout, port in zip(self.layouts, self.ports, strict=True):
            app = web.Application()

            async def kv_layout(request: web.Request, body: dict | None = layout) -> web.Response:
                return web.json_response(body) if body is not None else web.Response(status=404)

            async def health(request: web.Request) -> web.Response:
                return web.json_response({"status": "ok"})

            app.router.add_get("/kv_layout", kv_layout)
            app.router.add_get("/health", health)
            runner = web.AppRunner(app)
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
            self.runners.append(runner)
        self.ready.set()
        self.loop.run_forever()

    @property
    def urls(self) -> str:
        return ",".join(f"http://127.0.0.1:{p}" for p in self.ports)

    def __enter__(self) -> LayoutNodes:
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for r in self.runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def layout(block_size: int = 16, model: str = "smollm2-135m") -> dict:
    cfg = load_model(model, weights=False).config
    return {"model": cfg.name, "fingerprint": cfg.layout_fingerprint("float32", block_size), "dtype": "float32",
            "block_size": block_size, "node_id": f"n-bs{block_size}"}


def run_router(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", "router", "--listen", f"127.0.0.1:{free_port()}",
                           "--startup-timeout", "10", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def good() -> Iterator[dict]:
    yield layout()


def test_a_node_with_another_layout_is_refused(good: dict) -> None:
    odd = {**layout(32), "fingerprint": good["fingerprint"].replace("bs16", "bs32")}
    with LayoutNodes([good, odd]) as nodes:
        proc = run_router("--nodes", nodes.urls, "--policy", "prefix")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"kvpool router: error: node http://127.0.0.1:{nodes.ports[1]} has KV layout ")
    assert "bs32" in err and "the router hashes prompts for" in err and "bs16" in err


def test_nodes_of_one_kernel_tag_are_served_and_a_node_of_another_is_refused(good: dict) -> None:
    from engine.kernel_tags import TAG_PREFIX

    tagged = {**good, "fingerprint": good["fingerprint"] + TAG_PREFIX + "down"}
    with LayoutNodes([tagged, good]) as nodes:
        proc = run_router("--nodes", nodes.urls, "--policy", "prefix")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert f"node http://127.0.0.1:{nodes.ports[1]} has KV layout" in err
    assert "the nodes' CPU classes or kernel choices differ" in err and "one --kernels" in err
    with LayoutNodes([tagged, tagged]) as nodes:
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "kvpool_cli", "router", "--listen", f"127.0.0.1:{port}",
                                   "--startup-timeout", "10", "--nodes", nodes.urls, "--policy", "prefix"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert serves(f"http://127.0.0.1:{port}/health", router), router.stderr and router.stderr.read()
        finally:
            router.terminate()
            router.wait(30)


def serves(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> bool:
    """Whether `url` answers 200 before `proc` exits (or `timeout_s`: a bound, not a speed)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            time.sleep(0.2)
    return False


def test_a_node_that_is_not_a_kvpool_engine_is_refused_for_prefix(good: dict) -> None:
    with LayoutNodes([good, None]) as nodes:
        proc = run_router("--nodes", nodes.urls, "--policy", "prefix")
    assert proc.returncode == 2
    assert "has no /kv_layout (not a kvpool engine node): policy prefix needs kvpool nodes" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (("--listen", "nowhere"), "--listen takes HOST:PORT, got 'nowhere'"),
    (("--pull-value", "2"), "need --load-weight >= 0, 0 <= --pull-value <= 1 and --disk-cost >= 0"),
    (("--disk-cost", "-1"), "need --load-weight >= 0, 0 <= --pull-value <= 1 and --disk-cost >= 0"),
    (("--nodes", ""), "give the nodes: --nodes URL,.. or --discover (with --metaserver)"),
    (("--discover",), "--discover reads the node registry: it needs --metaserver HOST:PORT"),
])
def test_bad_flags_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    proc = run_router("--nodes", "http://127.0.0.1:9", *args)  # a later --nodes wins
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
