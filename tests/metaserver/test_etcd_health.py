"""etcd health without writes (BUG-2 in docs/RELIABILITY.md): every failed etcd call and an
idle-time probe mark etcd unhealthy, and the probe brings health back once etcd answers.

The first tests drive `MetaService` on a fake etcd (fast, exact about which call reported
what); the last one kills and restarts a real etcd under a real, idle metaserver process.
"""
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from grpc_health.v1 import health_pb2

import metaserver.store as store_mod
from kvpool_harness.processes import EtcdProcess
from metaserver.client import MetaClient
from metaserver.config import MetaServerConfig
from metaserver.errors import Unavailable
from metaserver.etcd import EtcdUnavailable, KeyValue, Op
from metaserver.service import MetaService
from metaserver.types import BlockHash, BlockRecord
from tests.conftest import health_status, wait_for

NS = "ns-health"
CAP = 1 << 30


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


class FakeEtcd:
    """The calls MetaService makes, each failing with EtcdUnavailable while `down`; the
    watch fails (and says so) only while `watch_down`."""

    def __init__(self) -> None:
        self.down = False
        self.watch_down = False
        self.probe_delay_s = 0.0
        self.calls: list[str] = []
        self._next_lease = 100

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            raise EtcdUnavailable(f"{name}: fake etcd is down")

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        self._call("range")
        return [], 1

    async def probe(self, key: bytes, timeout_s: float | None = None) -> int:
        self.calls.append("probe")
        if self.probe_delay_s:
            await asyncio.sleep(self.probe_delay_s)
        self._call("probe-answer")
        return 1

    async def txn(self, ops: Sequence[Op]) -> int:
        self._call("txn")
        return 2

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        self._call("put")
        return 2

    async def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        self._call("lease-grant")
        self._next_lease += 1
        return self._next_lease, ttl_s

    async def lease_revoke(self, lease_id: int) -> None:
        self._call("lease-revoke")

    async def lease_keepalive(self, lease_id: int) -> int:
        self._call("keepalive")
        return 30

    async def watch_prefix(self, prefix: bytes, start_revision: int, retry_s: float = 0.2,
                           on_unavailable: Callable[[EtcdUnavailable], None] | None = None,
                           ) -> AsyncIterator[list]:
        while True:
            if self.watch_down and on_unavailable is not None:
                on_unavailable(EtcdUnavailable("watch: fake etcd is down"))
            await asyncio.sleep(retry_s)
        yield []  # an async generator that never yields


def run_service(body: Callable[[MetaService, FakeEtcd, list[bool]], object]) -> None:
    """Start a MetaService on a fake etcd, run `body(service, etcd, health_changes)`, stop."""
    async def main() -> None:
        etcd = FakeEtcd()
        service = MetaService(MetaServerConfig(etcd_retry_s=0.05), etcd)  # type: ignore[arg-type]
        changes: list[bool] = []
        service.store.on_health_change = changes.append
        await service.start()
        try:
            await body(service, etcd, changes)  # type: ignore[misc]
        finally:
            etcd.down = etcd.watch_down = False
            await service.stop()

    asyncio.run(main())


async def until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `predicate` held; fails the test at the deadline."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def test_failed_keepalive_reports_unhealthy_and_probe_restores_it() -> None:
    async def body(service: MetaService, etcd: FakeEtcd, changes: list[bool]) -> None:
        node, _ = await service.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        etcd.down = True
        # Degraded keepalive: the node keeps its lease in our eyes, health says etcd is down.
        assert await service.keepalive("n1", node.lease_id) == 30
        assert not service.store.healthy and changes == [False]
        etcd.down = False
        await until(lambda: service.store.healthy, timeout_s=2)  # no write needed
        assert changes == [False, True]

    run_service(body)


@pytest.mark.parametrize("call", ["register", "unregister"])
def test_failed_registration_calls_report_unhealthy(call: str) -> None:
    async def body(service: MetaService, etcd: FakeEtcd, changes: list[bool]) -> None:
        node, _ = await service.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        etcd.down = True
        with pytest.raises(Unavailable):
            if call == "register":
                await service.register_node("n2", "127.0.0.1:9002", 0, CAP, NS, 30)
            else:
                await service.unregister_node("n1", node.lease_id)
        assert not service.store.healthy and changes == [False]

    run_service(body)


def test_watch_failure_reports_unhealthy() -> None:
    async def body(service: MetaService, etcd: FakeEtcd, changes: list[bool]) -> None:
        etcd.watch_down = True
        await until(lambda: not service.store.healthy, timeout_s=1)
        etcd.watch_down = False
        await until(lambda: service.store.healthy, timeout_s=2)
        assert changes == [False, True]

    run_service(body)


def test_idle_probe_detects_outage_and_recovery_without_busy_looping() -> None:
    async def body(service: MetaService, etcd: FakeEtcd, changes: list[bool]) -> None:
        service.store.probes = 0
        await asyncio.sleep(1.5)  # idle and healthy: about one probe a second
        assert 1 <= service.store.probes <= 3, service.store.probes
        etcd.down = True  # nothing but the probe talks to etcd now
        detected = await until(lambda: not service.store.healthy, timeout_s=store_mod.PROBE_IDLE_S + 1)
        probes = service.store.probes
        await asyncio.sleep(2.0)  # down: backoff 0.05 s doubling up to PROBE_IDLE_S
        assert service.store.probes - probes <= 8, service.store.probes - probes
        etcd.down = False
        recovered = await until(lambda: service.store.healthy, timeout_s=store_mod.PROBE_IDLE_S + 1)
        print(f"\nfake etcd: outage detected after {detected:.2f} s, recovery after {recovered:.2f} s")
        assert changes == [False, True]

    run_service(body)


def test_queries_never_wait_for_a_hanging_probe() -> None:
    async def body(service: MetaService, etcd: FakeEtcd, changes: list[bool]) -> None:
        await service.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        service.publish("n1", [BlockRecord(h(i), i * 4096, 4096, 1) for i in range(4)])
        etcd.probe_delay_s = 30.0  # etcd frozen: a probe hangs (the real one has a 1 s deadline)
        await asyncio.sleep(store_mod.PROBE_IDLE_S + 0.2)
        assert "probe" in etcd.calls
        t0 = time.monotonic()
        for _ in range(100):
            assert service.query(NS, [h(i) for i in range(4)], "").num_matched == 4
        # A query that waited on the probe would wait out its 30 s hang: the bound is half of
        # that, not a speed (100 in-memory queries take milliseconds on any machine).
        assert time.monotonic() - t0 < etcd.probe_delay_s / 2

    run_service(body)


# ---- a real etcd killed under an idle metaserver ---------------------------------------------

def _health(address: str) -> int:
    return health_status(address, "kvpool.v1.MetaService.etcd")


@pytest.mark.slow
def test_idle_metaserver_reports_etcd_outage_and_recovery(metaserver_factory, etcd: EtcdProcess) -> None:
    a = metaserver_factory()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with MetaClient(a.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        c.publish("n1", [BlockRecord(h(i), i * 4096, 4096, 1) for i in range(4)])
        wait_for(lambda: (s := c.stats()).etcd_healthy and s.pending_writes == 0)
        time.sleep(0.5)  # idle from here on: no write, no keepalive
        t0 = time.monotonic()
        etcd.kill()
        wait_for(lambda: not c.stats().etcd_healthy and _health(a.address) == not_serving, timeout_s=5,
                 interval_s=0.05)
        detected = time.monotonic() - t0
        assert c.query_prefix(NS, [h(i) for i in range(4)]).num_matched == 4  # from memory
        t1 = time.monotonic()
        etcd.start()
        started = time.monotonic() - t1
        wait_for(lambda: c.stats().etcd_healthy and _health(a.address) == serving, timeout_s=10, interval_s=0.05)
        recovered = time.monotonic() - t1
        print(f"\nreal etcd, idle metaserver: kill -> reported {detected:.2f} s; "
              f"restart -> SERVING {recovered:.2f} s (etcd itself healthy after {started:.2f} s)")


@pytest.mark.slow
def test_idle_metaserver_reports_frozen_etcd(metaserver_factory, etcd: EtcdProcess) -> None:
    """A frozen etcd (SIGSTOP) breaks no connection, so the watch says nothing: the idle-time
    probe (count-only range, 1 s deadline) finds it."""
    a = metaserver_factory()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert etcd.proc is not None
    with MetaClient(a.address) as c:
        wait_for(lambda: c.stats().etcd_healthy and _health(a.address) == serving)
        t0 = time.monotonic()
        etcd.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: not c.stats().etcd_healthy and _health(a.address) == not_serving, timeout_s=5,
                     interval_s=0.05)
            detected = time.monotonic() - t0
            t1 = time.monotonic()
        finally:
            etcd.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: c.stats().etcd_healthy and _health(a.address) == serving, timeout_s=10, interval_s=0.05)
        recovered = time.monotonic() - t1
        print(f"\nreal etcd frozen under an idle metaserver: SIGSTOP -> reported {detected:.2f} s; "
              f"SIGCONT -> SERVING {recovered:.2f} s")
