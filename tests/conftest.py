"""Shared fixtures: a real etcd and real metaserver processes on free loopback ports."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool_harness.processes import EtcdProcess, MetaserverProcess


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
