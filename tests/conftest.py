"""Shared fixtures: a real etcd and real metaserver processes on free loopback ports."""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def tokens(seed: int, n: int) -> list[int]:
    """`n` ordinary token ids of the model's vocabulary, seeded (a prompt of its own)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def out_ids(body: dict) -> list[int]:
    """The generated token ids of a completion answered with `return_token_ids`."""
    return body["choices"][0]["token_ids"]


@contextmanager
def running(procs: dict[str, Any], timeout_s: float, later: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """Start every process (models load in parallel), wait until each is ready, and stop them
    all at the end, whatever happened. `later`: processes not waited for here (the test that
    uses one calls its `wait_ready`): a slow starter readies while the other tests run."""
    try:
        for p in procs.values():
            p.start()
        for name, p in procs.items():
            if name not in later:
                p.wait_ready(timeout_s=timeout_s)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


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
