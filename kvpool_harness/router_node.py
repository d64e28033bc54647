"""`kvpool router` as a child process on loopback (tests, benchmarks, `kvpool cluster up
--router`): binds 127.0.0.1, logs to its own file, ended by PID."""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from kvpool_harness.engine_node import wait_healthy
from kvpool_harness.processes import ChildProcess, free_port


class RouterProcess(ChildProcess):
    def __init__(self, log_path: Path, nodes: list[str], policy: str = "prefix", metaserver: str = "",
                 port: int | None = None, extra_args: tuple[str, ...] = (), prefill: list[str] | None = None,
                 decode: list[str] | None = None) -> None:
        """`nodes` empty: --discover; `prefill` and `decode` given: --pd with them."""
        super().__init__(log_path)
        self.nodes = nodes
        self.prefill, self.decode = prefill or [], decode or []
        self.policy = policy
        self.metaserver = metaserver
        self.port = port or free_port()
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = ["router", "--listen", f"127.0.0.1:{self.port}", "--policy", self.policy, *self.extra_args]
        if self.prefill:
            args += ["--pd", "--prefill", ",".join(self.prefill), "--decode", ",".join(self.decode)]
        else:
            args += ["--nodes", ",".join(self.nodes)] if self.nodes else ["--discover"]  # none: the node registry's
        return args + (["--metaserver", self.metaserver] if self.metaserver else [])

    def start(self, timeout_s: float = 120.0) -> RouterProcess:
        self.spawn(self.command())
        self.ready_or_stopped(lambda: wait_healthy(self, "router", timeout_s))
        return self

    def __enter__(self) -> RouterProcess:
        return self.start()


class VllmRouterProcess(ChildProcess):
    """PyPI vllm-router (the reference router; scripts/install_vllm_router.sh puts it in
    .venv-vllm-router) in front of `nodes` with one of its policies, on 127.0.0.1."""

    VENV = Path(__file__).resolve().parents[1] / ".venv-vllm-router"

    def __init__(self, log_path: Path, nodes: list[str], policy: str = "cache_aware", port: int | None = None) -> None:
        super().__init__(log_path)
        self.nodes = nodes
        self.policy = policy
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> VllmRouterProcess:
        python = self.VENV / "bin" / "python"
        if not python.exists():
            raise RuntimeError(f"vllm-router is not installed ({python} missing): run scripts/install_vllm_router.sh")
        self.spawn(["--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.nodes,
                    "--policy", self.policy, "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(free_port()), "--log-level", "warning"],
                   module="vllm_router.launch_router", python=str(python), own_group=True)
        self.ready_or_stopped(lambda: self._wait_healthy(timeout_s))
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():  # its /health answers plain text, not JSON
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router not ready within {timeout_s:g}s; see {self.log_path}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def __enter__(self) -> VllmRouterProcess:
        return self.start()
