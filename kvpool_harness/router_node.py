"""`kvpool router` as a child process on loopback (tests, benchmarks, `kvpool cluster up
--router`): binds 127.0.0.1, logs to its own file, ended by PID."""
from __future__ import annotations

from pathlib import Path

from kvpool_harness.engine_node import wait_healthy
from kvpool_harness.processes import ChildProcess, free_port


class RouterProcess(ChildProcess):
    def __init__(self, log_path: Path, nodes: list[str], policy: str = "prefix", metaserver: str = "",
                 port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(log_path)
        self.nodes = nodes
        self.policy = policy
        self.metaserver = metaserver
        self.port = port or free_port()
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = ["router", "--listen", f"127.0.0.1:{self.port}", "--nodes", ",".join(self.nodes),
                "--policy", self.policy, *self.extra_args]
        return args + (["--metaserver", self.metaserver] if self.metaserver else [])

    def start(self, timeout_s: float = 120.0) -> RouterProcess:
        self.spawn(self.command())
        wait_healthy(self, "router", timeout_s)
        return self

    def __enter__(self) -> RouterProcess:
        return self.start()
