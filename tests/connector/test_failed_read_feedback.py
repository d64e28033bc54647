"""Failed reads feed back to the metaserver: real etcd, metaserver, a source pool process and
two reader nodes (the connector's scheduler and worker halves, real pools and transfers).

After a source is SIGKILLed, the first reader pays one failed read and reports it; the
metaserver stops offering the source (suspect until its next keepalive, entries kept), so
the second reader pays none. A live source reported unreadable is offered again at its next
keepalive; a reported stale block leaves the index alone.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from connector.cache_layout import SlottedCache
from connector.pool_scheduler import PoolScheduler
from connector.pool_worker import PoolWorker
from connector.settings import PoolConnectorSettings
from kvpool.layout import HEADER_BYTES
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from tests.conftest import wait_for
from tests.kvpool.pool_node import block_hash
from tests.kvpool.test_pool import start_node

pytestmark = pytest.mark.slow

NS = "test-ns"      # tests.kvpool.pool_node's namespace
BB = 4096           # block bytes
BS = 4              # tokens per block (any: the chain is what is looked up)
N = 8               # blocks in the source's chain
CHAIN = [block_hash("chain", i) for i in range(N)]


class Reader:
    """One node's connector halves, driven as a host would drive them for one request at a time."""

    def __init__(self, ms: MetaserverProcess, node_id: str) -> None:
        extra = {"metaserver": ms.address, "node_id": node_id, "pool_size": "1MiB", "lookup_deadline_s": 5,
                 "transfer_timeout_s": 2, "progress_timeout_s": 1, "read_timeout_s": 5}
        self.settings = PoolConnectorSettings.from_extra(lambda k, d=None: extra.get(k, d), 30.0)
        self.scheduler = PoolScheduler(self.settings, NS, BS, consume=True, produce=False)
        self.worker = PoolWorker(self.settings, NS, BB)
        slot = BB + HEADER_BYTES
        self.cache = np.zeros(N * slot, dtype=np.uint8)
        self.worker.register_cache(self.cache.ctypes.data, self.cache.nbytes,
                                   SlottedCache(self.cache.ctypes.data, slot, HEADER_BYTES))
        self.failed_loads = 0
        self._n = 0

    def offered(self, rid: str = "peek") -> int:
        """The tokens a lookup of the chain offers now (nothing loaded)."""
        ps = self.scheduler
        ps.start_lookup(rid, CHAIN, N * BS + 1)
        n = wait_for(lambda: (n := ps.num_matched_tokens(rid, CHAIN, N * BS + 1, 0)) is not None and (n,))[0]
        if rid == "peek":
            ps.forget(rid)
        return n

    def request(self) -> int:
        """Look the chain up and load what is offered; returns the tokens offered."""
        self._n += 1
        rid, ps = f"r{self._n}", self.scheduler
        offered = self.offered(rid)
        if offered:
            ps.on_alloc(rid, list(range(N)), offered)
            self.worker.start_loads(ps.build_meta().loads)
            self.worker.wait_for_loads([rid], 15)
            done, errors = self.worker.finished_loads(), self.worker.take_load_errors()
            assert rid in done
            self.failed_loads += bool(errors)
            ps.on_worker_report(done, errors)
        ps.forget(rid)
        return offered

    def reports(self) -> float:
        return self.scheduler.counters()["lookup_failed_read_reports"]

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@pytest.fixture
def readers(metaserver: MetaserverProcess) -> Iterator[tuple[Reader, Reader]]:
    a, b = Reader(metaserver, "reader-a"), Reader(metaserver, "reader-b")
    yield a, b
    a.close()
    b.close()


def test_a_killed_source_costs_each_reader_at_most_one_failed_read(metaserver: MetaserverProcess,
                                                                   readers: tuple[Reader, Reader]) -> None:
    a, b = readers
    source = start_node(metaserver, "src", N, BB)
    try:
        wait_for(lambda: a.offered() == b.offered() == N * BS)     # both know the source's blocks
        assert a.request() == N * BS and a.failed_loads == 0      # the source answers: a remote hit
        os.kill(source.pid, signal.SIGKILL)
        source.wait(10)
        for _ in range(3):
            a.request()
        assert a.failed_loads == 1                                  # one failed read, then its own negative cache
        wait_for(lambda: a.reports() == 1)                          # ... and the metaserver heard of it
        wait_for(lambda: b.offered() == 0)                          # B hears it from the metaserver
        for _ in range(3):
            assert b.request() == 0                                 # never offered the dead source
        assert b.failed_loads == 0
        with MetaClient(metaserver.address) as client:
            assert client.stats().index.num_copies == N             # entries kept (the lease ends them)
            assert client.query_prefix(NS, CHAIN).num_matched == 0  # but not offered
    finally:
        if source.poll() is None:
            source.kill()
            source.wait(10)


def test_a_live_source_reported_unreadable_is_offered_again_at_its_keepalive_and_a_stale_block_leaves(
        metaserver: MetaserverProcess) -> None:
    source = start_node(metaserver, "src", N, BB)
    try:
        with MetaClient(metaserver.address) as client:
            assert client.report_failed_read("src", [], "reader-a") == (0, True)
            assert client.query_prefix(NS, CHAIN).num_matched == 0
            # The source's session keeps its lease alive (every third of the TTL): offered again.
            wait_for(lambda: client.query_prefix(NS, CHAIN).num_matched == N, timeout_s=15)
            assert client.report_failed_read("src", [CHAIN[3], CHAIN[3]], "reader-a") == (1, False)
            assert client.query_prefix(NS, CHAIN).num_matched == 3  # the chain now ends at block 3
            assert client.stats().index.num_copies == N - 1
    finally:
        source.terminate()
        source.wait(10)
