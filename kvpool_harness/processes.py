"""Start and stop real etcd, metaserver and `kvpool` child processes on loopback (tests,
benchmarks, demo, `kvpool cluster`).

Each process binds 127.0.0.1 only, logs to a file the caller owns, and is ended by PID.
`EtcdProcess.restart()` keeps the data folder, so leases and keys survive as in production.
`EtcdCluster`: three (or N) members of one etcd cluster (`--initial-cluster`), for faults
that take a member or the quorum away (`kvpool bench chaos`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metaserver.credentials import ClientSecurity

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """A SIGTERM that arrives while a child is spawned takes effect once it is recorded: raised
    between the fork and `self.proc = ...` (a benchmark's SIGTERM is a SystemExit,
    kvpool_cli.main), it would leave the child running with nothing to stop it; raised after,
    the spawning code stops the child it has just recorded. Python runs signal handlers in the
    main thread only, so elsewhere there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if arrived:
            signal.raise_signal(signal.SIGTERM)


class EtcdProcess:
    """One etcd member on 127.0.0.1; use as a context manager or call start()/stop()."""

    def __init__(self, data_dir: Path, client_port: int | None = None, peer_port: int | None = None,
                 fast: bool = True, name: str = "kvpool-etcd", initial_cluster: str = "",
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """`name` and `initial_cluster` (NAME=PEER_URL,...): a member of a multi-member
        cluster (`EtcdCluster`); by default a cluster of one. `extra_args`: more etcd flags
        (e.g. auto-compaction, as deployed); `env`: more environment (e.g. GOMEMLIMIT)."""
        self.data_dir = Path(data_dir)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.fast = fast  # short heartbeat/election: healthy in ~0.1 s (tests)
        self.name = name
        self.initial_cluster = initial_cluster
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.with_suffix(".log")

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 15.0) -> EtcdProcess:
        try:
            self.launch()
            self._wait_healthy(timeout_s)
        except BaseException:  # a SystemExit from SIGTERM too: nothing else would stop it
            self.stop()
            raise
        assert self.proc is not None
        log.info("etcd pid %d serving on %s", self.proc.pid, self.endpoint)
        return self

    def launch(self) -> None:
        """Start the process without waiting (a member of a cluster is healthy only once a
        quorum of its peers runs too); `wait_healthy` waits."""
        exe = shutil.which("etcd")
        if exe is None:
            raise RuntimeError("etcd not found; run `make setup` (installs Debian etcd-server)")
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            exe, "--name", self.name, "--data-dir", str(self.data_dir), "--logger", "zap",
            "--log-level", "warn", "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            # A member of a cluster names all its peers (ignored once its data folder exists:
            # a member started again rejoins as itself).
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new",
        ]
        if self.fast:
            args += ["--heartbeat-interval", "10", "--election-timeout", "100"]
        args += list(self.extra_args)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf, sigterm_held():
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env} if self.env else None)

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.client_port}/health"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=0.5) as resp:
                    if b'"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not healthy within {timeout_s}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL (a crash); the data folder stays."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """`size` etcd members of one cluster on 127.0.0.1 (`--initial-cluster`), each with its
    own data folder RUN/etcd-<i> and free ports; a member started again (`members[i].start()`)
    keeps its folder and ports, so it rejoins as itself. `fast=False`: etcd's default
    heartbeat and election timeout (members that share busy cores with engine nodes would
    otherwise hold elections all the time). `extra_args`: more flags, `env`: more environment,
    for every member."""

    def __init__(self, run_dir: Path, size: int = 3, fast: bool = False, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        ports = [(free_port(), free_port()) for _ in range(size)]
        initial = ",".join(f"etcd-{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        self.members = [EtcdProcess(Path(run_dir) / f"etcd-{i}", client, peer, fast=fast, name=f"etcd-{i}",
                                    initial_cluster=initial, extra_args=extra_args, env=env) for i, (client, peer) in enumerate(ports)]

    @property
    def endpoints(self) -> str:
        """HOST:PORT,... of every member (the metaserver's `--etcd`)."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        try:
            for m in self.members:
                shutil.rmtree(m.data_dir, ignore_errors=True)  # a fresh cluster: no member data left over
                m.launch()
            for m in self.members:
                m.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_serving(address: str, timeout_s: float, service: str = "", security: ClientSecurity | None = None) -> None:
    """Poll grpc.health.v1 at `address` until `service` is SERVING; TimeoutError otherwise.
    `security`: TLS credentials for a TLS server (health needs no token)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from metaserver.credentials import ClientSecurity

    deadline = time.monotonic() + timeout_s
    with (security or ClientSecurity()).channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING within {timeout_s}s")


class ChildProcess:
    """A `python -m kvpool_cli ...` child (the `kvpool` command) on 127.0.0.1 with its log
    file, ended by PID."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spawn(self, args: list[str], env: dict[str, str] | None = None, module: str = "kvpool_cli",
              python: str = sys.executable, own_group: bool = False, drop_env: tuple[str, ...] = ()) -> None:
        """Run `python -m <module> <args>` (`python`: another virtualenv's interpreter). `env`:
        variables added to this process's environment for the child, `drop_env`: ones taken
        out of it. `own_group`: the child
        leads a process group of its own, so `kill()` ends the helpers it starts too.
        RuntimeError if its process still runs: a second one would be left running, untracked."""
        if self.alive():
            raise RuntimeError(f"{self.log_path.name}: already running (pid {self.pid}); stop it first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._own_group = own_group
        child_env = None
        if env or drop_env:
            child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop_env}
        try:
            with open(self.log_path, "ab") as logf, sigterm_held():
                self.proc = subprocess.Popen([python, "-m", module, *args], stdout=logf,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=child_env, start_new_session=own_group)
        except BaseException:  # the SIGTERM held above, raised once the child is recorded
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready_or_stopped(self, wait: Callable[[], object]) -> None:
        """`wait()` for the spawned child to be ready; if that fails in any way (a timeout, a
        SystemExit from SIGTERM), stop the child first: no `with` block holds it yet."""
        try:
            wait()
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL: a crash (of the whole process group the child leads, with `own_group`)."""
        if self.alive():
            assert self.proc is not None
            if getattr(self, "_own_group", False):
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (clean shutdown), SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_own_group", False):
            try:  # helpers the child started and left behind
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MetaserverProcess(ChildProcess):
    """One `kvpool metaserver` replica as a child process on 127.0.0.1 (`python -m metaserver`:
    the same command without loading the rest of kvpool).

    `security`: how to reach it for the readiness check when `extra_args` turn on TLS;
    `env`: extra environment variables (e.g. KVPOOL_ADMIN_TOKEN)."""

    def __init__(self, etcd_endpoints: str, log_path: Path, port: int | None = None,
                 extra_args: tuple[str, ...] = (), log_level: str = "INFO",
                 security: ClientSecurity | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__(log_path)
        self.etcd_endpoints = etcd_endpoints
        self.log_level = log_level
        self.port = port or free_port()
        self.extra_args = extra_args
        self.security = security
        self.env = env

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> MetaserverProcess:
        self.spawn(["--log-level", self.log_level, "metaserver", "--listen", self.address,
                    "--etcd", self.etcd_endpoints, *self.extra_args],
                   env=self.env, module="metaserver")
        try:
            self.ready_or_stopped(lambda: wait_serving(self.address, timeout_s, security=self.security))
        except TimeoutError:
            raise RuntimeError(f"metaserver on {self.address} not ready; see {self.log_path}") from None
        return self

    def __enter__(self) -> MetaserverProcess:
        return self.start()
