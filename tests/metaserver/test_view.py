"""The node-local read view (metaserver.view) against real metaserver replicas and etcd.

It answers as the metaserver does, follows publishes, removals, suspect marks and lease
expiry, sees only its namespace, resumes a broken stream without a snapshot, takes a new
snapshot from a restarted replica (new epoch), says it is not current while its stream
is silent (a frozen replica), and takes no snapshot from a replica still loading its index.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from metaserver.client import MetaClient
from metaserver.errors import Unavailable
from metaserver.types import BlockHash, BlockRecord
from metaserver.view import IndexView
from tests.conftest import health_status, wait_for

NS, OTHER = "ns-view", "ns-other"
CAP = 1 << 30


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def recs(ids: Iterable[int], gen: int = 1) -> list[BlockRecord]:
    return [BlockRecord(h(i), i * 4096, 4096, gen) for i in ids]


def chain(n: int) -> list[BlockHash]:
    return [h(i) for i in range(n)]


def same_answer(view: IndexView, client: MetaClient, n: int) -> bool:
    """The view answers the chain as the metaserver does (locations, in order)."""
    mine = view.query(chain(n))
    theirs = client.query_prefix(NS, chain(n), "reader")
    return mine is not None and mine.locations == theirs.locations


def test_the_view_follows_the_index_and_sees_only_its_namespace(metaserver: MetaserverProcess) -> None:
    with MetaClient(metaserver.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        c.register_node("o1", "127.0.0.1:9002", 0, CAP, OTHER, 30)
        c.publish("n1", recs(range(32)))
        c.publish("o1", recs(range(100, 164)))
        view = IndexView(c, NS, "reader")
        try:
            assert view.wait_current(10) and view.snapshots == 1
            assert view.num_copies() == 32                                    # not the other namespace's
            assert same_answer(view, c, 40) and view.query(chain(40)).num_matched == 32
            c.publish("n1", recs(range(32, 40)))                             # a change after the snapshot
            wait_for(lambda: view.query(chain(40)).num_matched == 40)
            c.unpublish("n1", [h(20)])
            wait_for(lambda: view.query(chain(40)).num_matched == 20)
            c.publish("n1", recs([20], gen=2))                                # republished, new generation
            wait_for(lambda: view.query(chain(40)).num_matched == 40)
            assert view.query(chain(40)).locations[20].generation == 2
            assert c.report_failed_read("n1", [], "someone") == (0, True)     # suspect: not offered
            wait_for(lambda: view.query(chain(40)).num_matched == 0)
            c.keepalive("n1", c.list_nodes()[0][0].lease_id)                  # alive again: offered
            wait_for(lambda: view.query(chain(40)).num_matched == 40)
            assert same_answer(view, c, 40) and view.snapshots == 1
            c.unpublish("n1", [h(0)])                                         # sparse: what lies behind a gap
            wait_for(lambda: view.query(chain(40)).num_matched == 0)
            mine = view.query(chain(40), sparse=True)
            assert mine is not None and mine.num_held == 39 and len(mine.run_from(1)) == 39
            assert mine.held == c.query_prefix(NS, chain(40), "reader", sparse=True).held
        finally:
            view.close()


def test_a_broken_stream_resumes_without_a_snapshot(metaserver: MetaserverProcess) -> None:
    with MetaClient(metaserver.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 30)
        c.publish("n1", recs(range(16)))
        view = IndexView(c, NS, "reader", retry_s=0.5)
        try:
            assert view.wait_current(10)
            call = view._call  # the stream breaks (as a dropped connection would)
            assert call is not None
            call.cancel()
            c.publish("n1", recs(range(16, 24)))                             # published while it is down
            wait_for(lambda: view.resumes == 1)
            wait_for(lambda: view.query(chain(30)).num_matched == 24)
            assert view.snapshots == 1                                        # replayed, not re-sent
        finally:
            view.close()


def test_a_restarted_replica_sends_a_new_snapshot_and_a_frozen_one_makes_the_view_stale(
        metaserver_factory: Callable[..., MetaserverProcess]) -> None:
    ms = metaserver_factory()
    with MetaClient(ms.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 60)
        c.publish("n1", recs(range(16)))
        wait_for(lambda: c.stats().pending_writes == 0)
        view = IndexView(c, NS, "reader", stale_after_s=1.0)
        try:
            assert view.wait_current(10)
            epoch = view.epoch
            os.kill(ms.pid, signal.SIGSTOP)                                    # frozen: no heartbeats
            try:
                wait_for(lambda: not view.current(), timeout_s=5)
                assert view.query(chain(16)) is None                          # callers fall back to RPCs
            finally:
                os.kill(ms.pid, signal.SIGCONT)
            wait_for(view.current, timeout_s=10)
            ms.kill()
            ms2 = metaserver_factory(port=ms.port)                             # rebuilt from etcd: new epoch
            wait_for(lambda: view.snapshots == 2, timeout_s=15)
            assert view.epoch != epoch and view.query(chain(16)).num_matched == 16
            assert ms2.address == ms.address
        finally:
            view.close()


def _health_answers(address: str, status: int) -> bool:
    """The replica at `address` answers a health check with `status` (False: no answer yet)."""
    try:
        return health_status(address) == status
    except grpc.RpcError:
        return False


def test_a_replica_still_loading_its_index_answers_no_index_read(
        etcd: EtcdProcess, metaserver_factory: Callable[..., MetaserverProcess], tmp_path: Path) -> None:
    """A replica listens before it has loaded the index from etcd (here etcd is down, so it
    stays loading). Index reads are UNAVAILABLE until then, not answered from an empty index:
    a query fails (a client moves to another replica), and a watch ends, so a view takes no
    snapshot (an empty one would be current, its lookups all misses). Once etcd is back the
    replica loads, and the view takes one snapshot, of every block."""
    ms = metaserver_factory()
    with MetaClient(ms.address) as c:
        c.register_node("n1", "127.0.0.1:9001", 0, CAP, NS, 600)
        c.publish("n1", recs(range(16)))
        wait_for(lambda: c.stats().pending_writes == 0)
    ms.kill()
    etcd.kill()
    etcd_down = True
    ms2 = MetaserverProcess(etcd.endpoint, tmp_path / "loading.log", port=ms.port)
    errors: list[BaseException] = []

    def start() -> None:  # returns once the replica is SERVING: after etcd is back
        try:
            ms2.start(timeout_s=600)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        wait_for(lambda: _health_answers(ms2.address, health_pb2.HealthCheckResponse.NOT_SERVING), timeout_s=120)
        with MetaClient(ms2.address, timeout_s=5) as c:
            with pytest.raises(grpc.RpcError) as err:
                next(iter(c.watch_index(NS)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in err.value.details()
            with pytest.raises(Unavailable, match="still loading"):
                c.query_prefix(NS, chain(16), "reader")
            view = IndexView(c, NS, "reader")
            try:
                # two watches logged: the view's first one ended (UNAVAILABLE) and it tried again
                log = tmp_path / "loading.log"
                wait_for(lambda: log.read_text().count("reader watches") >= 2, timeout_s=120)
                assert view.snapshots == 0 and not view.current() and view.query(chain(16)) is None
                etcd.start()
                etcd_down = False
                starter.join(600)
                assert not starter.is_alive() and not errors, errors
                assert view.wait_current(120) and view.snapshots == 1
                assert view.query(chain(16)).num_matched == 16
                assert c.query_prefix(NS, chain(16), "reader").num_matched == 16
            finally:
                view.close()
    finally:
        if etcd_down:
            etcd.start()
        starter.join(600)
        ms2.stop()


@pytest.mark.parametrize("empty", [True, False])
def test_the_rpc_rejects_a_bad_namespace(metaserver: MetaserverProcess, empty: bool) -> None:
    with MetaClient(metaserver.address) as c:
        stream = c.watch_index("" if empty else "x" * 300)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stream))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in err.value.details()
