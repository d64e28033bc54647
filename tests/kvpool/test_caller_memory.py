"""The pool reaches a caller's memory only through its `CallerMemory` (kvpool.layout): what a
KV cache in GPU memory needs (connector.device_memory), checked on CPU with a caller memory
that redirects every address. The caller names addresses in a decoy buffer; the memory maps
them to another buffer. Had any path (a put's source, a local hit, a remote read, a disk read)
copied to or from a caller address itself, the decoy would hold bytes or the real buffer
would miss them."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import NodePool
from kvpool.layout import HEADER_BYTES, CallerMemory, Payload
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from metaserver.types import BlockHash, BlockLocation, NodeId
from tests.kvpool.pool_node import block_content, block_hash
from tests.kvpool.test_disk import make_pool as make_disk_pool
from tests.kvpool.test_pool import BB, NS, make_pool

N = 6


class Redirect(CallerMemory):
    """Caller addresses inside `decoy` stand for the same offsets in `real`."""

    def __init__(self, blocks: int) -> None:
        self.decoy = np.zeros(blocks * BB, dtype=np.uint8)
        self.real = np.zeros(blocks * BB, dtype=np.uint8)
        self.calls = {"write": 0, "read": 0}

    def addr(self, block: int) -> int:
        return self.decoy.ctypes.data + block * BB

    def _map(self, payload: Payload) -> Payload:
        shift = self.real.ctypes.data - self.decoy.ctypes.data
        assert isinstance(payload, int) and 0 <= payload - self.decoy.ctypes.data < self.decoy.nbytes
        return payload + shift

    def write(self, dest: Payload, src: int, nbytes: int) -> None:
        self.calls["write"] += 1
        super().write(self._map(dest), src, nbytes)

    def read(self, dst: int, src: Payload, nbytes: int) -> None:
        self.calls["read"] += 1
        super().read(dst, self._map(src), nbytes)

    def block(self, i: int) -> bytes:
        return self.real[i * BB:(i + 1) * BB].tobytes()


@pytest.fixture
def pools(metaserver: MetaserverProcess) -> Iterator[tuple[NodePool, NodePool]]:
    a = make_pool(metaserver, "A", 4 * N)
    b = make_pool(metaserver, "B", 4 * N)
    yield a, b
    b.close()
    a.close()


def test_puts_and_every_read_path_go_through_the_callers_memory(pools, metaserver: MetaserverProcess) -> None:
    a, b = pools
    mem_a, mem_b = Redirect(N), Redirect(2 * N)
    a.use_caller_memory(mem_a)
    b.use_caller_memory(mem_b)
    hashes = [block_hash("redirect", i) for i in range(N)]
    for i, h in enumerate(hashes):
        mem_a.real[i * BB:(i + 1) * BB] = block_content(h, BB)
        assert a.put(h, mem_a.addr(i), BB)
    assert mem_a.calls["read"] == N
    assert a.flush_publishes(timeout_s=60)
    with MetaClient(metaserver.address) as client:
        r = client.query_prefix(NS, hashes, "B")
        assert r.num_matched == N
        # A remote read (landing slots, validated, then copied out) into B's caller memory.
        res = b.get(r.locations, r.nodes, [mem_b.addr(i) for i in range(N)]).wait(timeout_s=60)
        assert len(res.ok) == N and mem_b.calls["write"] == N
        # A local hit on A into A's caller memory, over what A's cache held.
        mem_a.real[:] = 0
        res = a.get(r.locations, r.nodes, [mem_a.addr(i) for i in range(N)]).wait(timeout_s=60)
        assert len(res.ok) == N and mem_a.calls["write"] == N
    for i, h in enumerate(hashes):
        assert mem_b.block(i) == bytes(block_content(h, BB)) == mem_a.block(i)
    assert not mem_a.decoy.any() and not mem_b.decoy.any()


def test_disk_hits_go_through_the_callers_memory(tmp_path: Path) -> None:
    """Blocks evicted to the disk tier are read back (and put back into DRAM from the
    destination) through the caller's memory too."""
    pool = make_disk_pool(tmp_path / "disk")
    try:
        mem = Redirect(2 * N)
        pool.use_caller_memory(mem)
        hashes = [block_hash("redirect-disk", i) for i in range(2 * N)]  # twice what DRAM holds
        for i, h in enumerate(hashes):
            mem.real[i * BB:(i + 1) * BB] = block_content(h, BB)
            assert pool.put(h, mem.addr(i), BB)
        assert pool.disk is not None and pool.disk.flush()
        on_disk = [h for h in hashes if h not in pool]
        assert len(on_disk) >= N
        mem.real[:] = 0
        locs = [BlockLocation(BlockHash(h), NodeId("A"), 0, HEADER_BYTES + BB, 0) for h in on_disk]
        res = pool.get(locs, {}, [mem.addr(i) for i in range(len(on_disk))]).wait(timeout_s=30)
        assert len(res.ok) == len(on_disk)
        for i, h in enumerate(on_disk):
            assert mem.block(i) == bytes(block_content(h, BB))
        assert not mem.decoy.any()
    finally:
        pool.close()
