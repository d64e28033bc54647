"""Durability and convergence with real processes: restart, replicas, leases, etcd outage."""
from __future__ import annotations

import threading
import time

import pytest
from grpc_health.v1 import health_pb2

from kvpool_harness.processes import EtcdProcess
from metaserver.client import MetaClient, NodeSession
from metaserver.errors import FailedPrecondition, MetaError
from metaserver.types import BlockHash, BlockRecord
from tests.conftest import health_status, wait_for

pytestmark = pytest.mark.slow

NS = "ns-durability"
CAP = 1 << 30


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def recs(ids, size: int = 4096) -> list[BlockRecord]:
    return [BlockRecord(h(i), i * size, size, 3) for i in ids]


def matched(c: MetaClient, ids) -> int:
    try:
        return c.query_prefix(NS, [h(i) for i in ids]).num_matched
    except MetaError:
        return -1


def flushed(c: MetaClient) -> bool:
    s = c.stats()
    return s.etcd_healthy and s.pending_writes == 0


@pytest.mark.parametrize("how", ["sigterm", "sigkill-after-flush"])
def test_restart_rebuilds_index_from_etcd(metaserver_factory, how: str) -> None:
    a = metaserver_factory()
    with MetaClient(a.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        for start in range(0, 1000, 250):
            c.publish("n1", recs(range(start, start + 250)))
        c.invalidate(namespace=NS, hashes=[h(500)])
        wait_for(lambda: flushed(c))
    if how == "sigterm":
        assert a.stop() == 0
    else:
        a.kill()
    b = metaserver_factory(port=a.port)
    with MetaClient(b.address) as c:
        assert c.stats().index.num_copies == 999
        assert matched(c, range(1000)) == 500
        assert matched(c, range(501, 1000)) == 499
        assert [n.node_id for n, k in c.list_nodes()] == ["n1"]


def test_two_replicas_converge_through_watch(metaserver_factory) -> None:
    a, b = metaserver_factory(), metaserver_factory()
    with MetaClient(a.address) as ca, MetaClient(b.address) as cb:
        ca.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        wait_for(lambda: cb.list_nodes())
        cb.publish("n1", recs(range(64)))  # a node may publish through any replica
        wait_for(lambda: matched(ca, range(64)) == 64, timeout_s=5)
        ca.invalidate(namespace=NS, hashes=[h(10)])
        wait_for(lambda: matched(cb, range(64)) == 10, timeout_s=5)
        cb.drain("n1")
        wait_for(lambda: matched(ca, range(64)) == 0 and ca.list_nodes()[0][0].draining, timeout_s=5)


def test_drain_and_undrain_are_kept_in_etcd(metaserver_factory) -> None:
    """Drain on one replica, undrain on another: each change reaches etcd (a replica started
    later loads the drain; the first replica sees the undrain through its watch), and the
    undrained node publishes and is a source again everywhere."""
    a = metaserver_factory()
    with MetaClient(a.address) as ca:
        ca.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 3600)  # no keepalive here: a lease no test outlives
        ca.publish("n1", recs(range(8)))
        assert ca.drain("n1") == 8
        b = metaserver_factory()
        with MetaClient(b.address) as cb:
            wait_for(lambda: cb.list_nodes() and cb.list_nodes()[0][0].draining)
            with pytest.raises(FailedPrecondition, match="draining"):
                cb.publish("n1", recs(range(8)))
            assert cb.undrain("n1") is True
            wait_for(lambda: not ca.list_nodes()[0][0].draining)
            assert ca.publish("n1", recs(range(8))) == 8
            wait_for(lambda: matched(cb, range(8)) == 8)
            assert {loc.node_id for loc in cb.query_prefix(NS, [h(i) for i in range(8)]).locations} == {"n1"}


def test_lease_expiry_drops_node_on_every_replica(metaserver_factory) -> None:
    a, b = metaserver_factory(), metaserver_factory()
    with MetaClient(a.address) as ca, MetaClient(b.address) as cb:
        # 4 s: long enough that replica B shows the records before they go on a loaded machine
        # (a 1 s lease could run out first), short enough to wait out.
        ca.register_node("short", "127.0.0.1:9001", 0, CAP, NS, 4)
        ca.register_node("long", "127.0.0.1:9002", 0, CAP, NS, 60)
        ca.publish("short", recs(range(32)))
        ca.publish("long", recs(range(100, 104)))
        wait_for(lambda: matched(cb, range(32)) == 32)
        # No keepalive: the lease runs out and etcd deletes the node's keys.
        wait_for(lambda: matched(ca, range(32)) <= 0 and matched(cb, range(32)) <= 0, timeout_s=30)
        for c in (ca, cb):
            assert [n.node_id for n, _ in c.list_nodes()] == ["long"]
            assert matched(c, range(100, 104)) == 4


def test_node_republishes_after_its_lease_was_lost(metaserver_factory, etcd: EtcdProcess) -> None:
    a = metaserver_factory()
    holdings = recs(range(40))
    with MetaClient(a.address) as c:
        session = NodeSession(c, "n1", "127.0.0.1:9001", 0, CAP, NS, lambda: holdings, lease_ttl_s=1)
        session.start()
        try:
            assert matched(c, range(40)) == 40
            port = a.port
            a.kill()  # the metaserver dies; without keepalives the lease expires in etcd
            time.sleep(2.5)
            b = metaserver_factory(port=port)
            with MetaClient(b.address) as cb:
                # The restarted replica loaded etcd: the node is gone. Its session gets NOT_FOUND
                # on the next keepalive, registers again and re-publishes what it holds.
                wait_for(lambda: matched(cb, range(40)) == 40, timeout_s=10)
                assert session.registrations >= 2
        finally:
            session.stop()


def test_node_republishes_after_failing_over_from_a_replica_that_died_with_queued_writes(
        metaserver_factory, etcd: EtcdProcess) -> None:
    """Found by `kvpool bench chaos --seed 1` (issue 42): replica A acknowledged a publish,
    queued its etcd write (etcd was down) and was killed before writing it. The node's lease
    lives on in etcd, so its next keepalive succeeds at once on replica B: no failed call,
    no re-registration, and without a resync B never learns of those blocks (the index
    lacked blocks the node held, for good). A failover must resync like a failed keepalive."""
    a, b = metaserver_factory(), metaserver_factory()
    holdings = recs(range(20))
    with MetaClient(f"{a.address},{b.address}") as c, MetaClient(b.address) as cb:
        session = NodeSession(c, "n1", "127.0.0.1:9001", 0, CAP, NS, lambda: holdings, lease_ttl_s=6)
        session.start()  # keepalives every 2 s, through A
        try:
            wait_for(lambda: matched(cb, range(20)) == 20, timeout_s=10)
            etcd.kill()
            late = recs(range(20, 30))
            c.publish("n1", late)  # acknowledged by A, queued there: etcd is down
            holdings = holdings + late
            assert matched(c, range(30)) == 30
            a.kill()               # the queued write dies with A
            etcd.start()           # the lease is still there: B answers the keepalives
            wait_for(lambda: matched(cb, range(30)) == 30, timeout_s=15)
            assert session.registrations == 1
        finally:
            session.stop()


def test_etcd_outage_keeps_queries_and_loses_no_acknowledged_publish(metaserver_factory, etcd: EtcdProcess) -> None:
    a = metaserver_factory()
    acked: list[int] = []
    stop = threading.Event()
    errors: list[str] = []
    with MetaClient(a.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        c.publish("n1", recs(range(10)))

        def publisher() -> None:
            i = 1000
            with MetaClient(a.address) as pc:
                while not stop.is_set():
                    try:
                        pc.publish("n1", recs(range(i, i + 20)))
                        acked.extend(range(i, i + 20))
                    except MetaError as err:
                        errors.append(str(err))
                    i += 20
                    time.sleep(0.005)

        t = threading.Thread(target=publisher)
        t.start()
        try:
            time.sleep(0.3)
            etcd.kill()
            during = len(acked)
            # Queries are answered from memory while etcd is down, and health says degraded.
            for _ in range(50):
                assert matched(c, range(10)) == 10
            wait_for(lambda: not c.stats().etcd_healthy, timeout_s=10)
            assert health_status(a.address, "kvpool.v1.MetaService.etcd") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert health_status(a.address, "") == health_pb2.HealthCheckResponse.SERVING
            wait_for(lambda: len(acked) > during + 100)  # publishes keep being accepted
            assert c.stats().pending_writes > 0
            etcd.start()
            time.sleep(0.3)
        finally:
            stop.set()
            t.join(10)
        assert not errors
        wait_for(lambda: flushed(c), timeout_s=20)
    # A fresh replica sees only what etcd holds: every acknowledged publish must be there.
    b = metaserver_factory()
    with MetaClient(b.address) as cb:
        held = cb.stats().index.num_copies
        assert held == 10 + len(acked)
        probe = acked[:: max(1, len(acked) // 50)]
        for i in probe:
            assert matched(cb, [i]) == 1, i
