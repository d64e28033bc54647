"""Shared fixtures: a real etcd and real metaserver processes on free loopback ports, and one
vLLM server alone (no plug-in) as the session's reference."""
from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.vllm_node import VllmProcess, export_model


def health_status(address: str, service: str = "") -> int:
    """grpc.health.v1's status of `service` at `address` (raises grpc.RpcError if it does not answer)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.01) -> object:
    """Poll `predicate` until it returns a truthy value; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def tokens(seed: int, n: int) -> list[int]:
    """`n` ordinary token ids of the model's vocabulary, seeded (a prompt of its own)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def out_ids(body: dict) -> list[int]:
    """The generated token ids of a completion answered with `return_token_ids`."""
    return body["choices"][0]["token_ids"]


@contextmanager
def running(procs: dict[str, Any], timeout_s: float, later: tuple[str, ...] = (),
            shared: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """Start every process (models load in parallel), wait until each is ready, and stop them
    all at the end, whatever happened. `later`: processes not waited for here (the test that
    uses one calls its `wait_ready`): a slow starter readies while the other tests run.
    `shared`: processes a wider fixture started and stops (`vllm_alone`): only waited for."""
    try:
        for name, p in procs.items():
            if name not in shared:
                p.start()
        for name, p in procs.items():
            if name not in later:
                p.wait_ready(timeout_s=timeout_s)
        yield procs
    finally:
        for name, p in procs.items():
            if name not in shared:
                p.stop()


SESSION_PREFIX = "session-"  # the folders of session fixtures: `module_folders_removed` keeps them


@pytest.fixture(scope="module", autouse=True)
def module_folders_removed(request: pytest.FixtureRequest,
                           tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Remove the folders a module's fixtures made (`tmp_path_factory.mktemp`) once the module
    is done, unless one of its tests failed (its logs are then kept). Autouse and module-scoped,
    so it is set up before the module's other fixtures and torn down after them. pytest's
    `tmp_path_retention_policy = "failed"` does this for `tmp_path` alone; without it a run
    leaves ~11 GB (an etcd WAL alone preallocates 61 MB), more than a CI machine may have free.
    A session fixture's folder, made in whichever module first asks for it, is named with
    SESSION_PREFIX and kept."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for path in set(base.iterdir()) - before:
        if path.is_dir() and not path.name.startswith(SESSION_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vLLM without the plug-in: the reference the vLLM tests compare answers with, one server
    for the whole session. Started, not waited for: the first module's fixture waits for it
    beside its own nodes (`running(..., shared=...)`), so their starts overlap. One thread on
    core 0: the nodes under test (one core each) compute beside it."""
    proc = VllmProcess(tmp_path_factory.mktemp(SESSION_PREFIX + "vllm-alone") / "C.log", export_model(), "vllm-c", cpus="0",
                       uni_executor=True).start()
    yield proc
    proc.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path / "etcd").start()
    yield proc
    proc.stop()


@pytest.fixture
def metaserver_factory(etcd: EtcdProcess, tmp_path: Path) -> Iterator[Callable[..., MetaserverProcess]]:
    started: list[MetaserverProcess] = []

    def make(*extra_args: str, port: int | None = None) -> MetaserverProcess:
        proc = MetaserverProcess(etcd.endpoint, tmp_path / f"metaserver-{len(started)}.log", port=port,
                                 extra_args=extra_args).start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def metaserver(metaserver_factory: Callable[..., MetaserverProcess]) -> MetaserverProcess:
    return metaserver_factory()
