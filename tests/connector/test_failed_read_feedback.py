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

import pytest

from kvpool_harness.pool_reader import PoolReader
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from tests.conftest import wait_for
from tests.kvpool.pool_node import block_hash
from tests.kvpool.test_pool import start_node

pytestmark = pytest.mark.slow

NS = "test-ns"      # tests.kvpool.pool_node's namespace
BB = 4096           # block bytes
N = 8               # blocks in the source's chain
CHAIN = [block_hash("chain", i) for i in range(N)]


@pytest.fixture(params=[True, False], ids=["view", "rpc"])
def readers(metaserver: MetaserverProcess, request: pytest.FixtureRequest) -> Iterator[tuple[PoolReader, PoolReader]]:
    """Two readers looking up through their index views, or by RPC."""
    a, b = (PoolReader(metaserver.address, node_id, NS, BB, N, lookup_view=request.param)
            for node_id in ("reader-a", "reader-b"))
    yield a, b
    a.close()
    b.close()


def test_a_killed_source_costs_each_reader_at_most_one_failed_read(metaserver: MetaserverProcess,
                                                                   readers: tuple[PoolReader, PoolReader]) -> None:
    a, b = readers
    source = start_node(metaserver, "src", N, BB)
    try:
        all_tokens = N * a.block_size
        wait_for(lambda: a.offered(CHAIN) == b.offered(CHAIN) == all_tokens)  # both know the source's blocks
        assert a.request(CHAIN) == all_tokens and a.failed_loads == 0       # the source answers: a remote hit
        os.kill(source.pid, signal.SIGKILL)
        source.wait(10)
        for _ in range(3):
            a.request(CHAIN)
        assert a.failed_loads == 1                                  # one failed read, then its own negative cache
        wait_for(lambda: a.reports() == 1)                          # ... and the metaserver heard of it
        wait_for(lambda: b.offered(CHAIN) == 0)                     # B hears it from the metaserver
        for _ in range(3):
            assert b.request(CHAIN) == 0                            # never offered the dead source
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
