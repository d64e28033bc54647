"""Another node's disk blocks, with a real metaserver and etcd: the index offers them (the
holder stages), the reader has the holder promote them into DRAM and reads them from there;
a holder that does not answer in time costs a recompute, never a wrong block."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import NodePool, PoolConfig
from kvpool.disk import disk_slot_bytes
from kvpool.layout import slot_bytes_for
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from metaserver.types import Medium
from tests.conftest import wait_for
from tests.kvpool.hooks import put_bytes
from tests.kvpool.pool_node import block_content, block_hash

NS = "test-ns"
BB = 64 * 1024
DRAM_BLOCKS = 8


@pytest.fixture
def pools(metaserver: MetaserverProcess, tmp_path: Path) -> Iterator[tuple[NodePool, NodePool, MetaClient]]:
    a = NodePool(PoolConfig("A", DRAM_BLOCKS * slot_bytes_for(BB), BB, NS, metaserver.address, evict_batch=1,
                            disk_dir=str(tmp_path / "disk-a"), disk_size_bytes=32 * disk_slot_bytes(BB)),
                 MetaClient(metaserver.address))
    # B's stage requests wait half its read timeout: long enough for a loaded 2-core machine to
    # stage 4 blocks (a test that needs a holder's answer in 2 s is a test of the machine's
    # speed), short enough that the stuck-holder test below waits it out quickly.
    b = NodePool(PoolConfig("B", DRAM_BLOCKS * slot_bytes_for(BB), BB, NS, metaserver.address, read_timeout_s=12),
                 MetaClient(metaserver.address))
    client = MetaClient(metaserver.address)
    a.start()
    b.start()
    yield a, b, client
    client.close()
    b.close()
    a.close()


def fill_a(a: NodePool, client: MetaClient, n: int) -> list[bytes]:
    hashes = [block_hash("chain", i) for i in range(n)]
    for h in hashes:
        assert put_bytes(a, h, block_content(h, BB))
    assert a.disk is not None and a.disk.flush() and a.flush_publishes(timeout_s=60)
    # (a publish that missed its deadline on a loaded host is made good by the node's resync)
    wait_for(lambda: client.query_prefix(NS, hashes, "A", sparse=True).num_held == n, timeout_s=30)
    return hashes


def read(b: NodePool, client: MetaClient, hashes: list[bytes]):
    r = client.query_prefix(NS, hashes, "B")
    dest = np.zeros(len(hashes) * BB, dtype=np.uint8)
    res = b.get(r.locations, r.nodes, [dest.ctypes.data + i * BB for i in range(r.num_matched)]).wait(60)
    return r, res, dest


def test_a_disk_block_of_another_node_is_staged_and_read(pools) -> None:
    a, b, client = pools
    hashes = fill_a(a, client, DRAM_BLOCKS + 4)
    on_disk = hashes[:4]
    r, res, dest = read(b, client, on_disk)
    assert r.num_matched == 4 and all(loc.node_id == "A" and loc.medium == Medium.DISK for loc in r.locations)
    assert res.ok == (0, 1, 2, 3) and res.failed == ()
    for i, h in enumerate(on_disk):
        assert np.array_equal(dest[i * BB:(i + 1) * BB], block_content(h, BB))
    assert a.stats.disk_staged == 4 and b.stats.remote_hits == 4
    assert a.flush_publishes(timeout_s=60)
    def promoted() -> bool:  # DRAM copies now
        q = client.query_prefix(NS, on_disk, "B")
        return q.num_matched == 4 and all(loc.medium == Medium.DRAM for loc in q.locations)

    wait_for(promoted, timeout_s=30)


def test_a_holder_that_does_not_stage_in_time_costs_a_recompute(pools) -> None:
    a, b, client = pools
    hashes = fill_a(a, client, DRAM_BLOCKS + 4)
    release = threading.Event()
    stage_fn = a._stager._server.stage_fn  # type: ignore[union-attr]

    def stuck(hs):  # a holder whose disk does not answer until released
        release.wait(30)
        return stage_fn(hs)

    a._stager._server.stage_fn = stuck  # type: ignore[union-attr]
    try:
        r, res, dest = read(b, client, hashes[:2])
        assert r.num_matched == 2 and res.failed == (0, 1) and res.ok == ()
        assert not dest.any()
    finally:
        release.set()
    # Gone altogether: refused at once. (Other blocks: released, A staged the first two late.)
    a._stager.close()  # type: ignore[union-attr]
    r, res, _ = read(b, client, hashes[2:4])
    assert r.num_matched == 2 and all(loc.medium == Medium.DISK for loc in r.locations) and res.failed == (0, 1)
