"""Saves off the host's thread (connector.saver) with real node pools and a real metaserver:
what a reader gets under a block's hash is what was computed, or nothing, even when the host
reuses the cache block right after the step; a fence waits only for a copy in progress;
a full queue drops saves instead of blocking the host."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from connector.saver import Saver
from kvpool import NodePool
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from tests.conftest import wait_for
from tests.kvpool.pool_node import block_hash
from tests.kvpool.test_pool import BB, NS, make_pool

BLOCKS = 4


class Host:
    """A host's KV cache (BLOCKS blocks) saving into pool A through a Saver whose copies can
    be held at the start (`hold`) to stand for a slow copy."""

    def __init__(self, pool: NodePool, max_pending: int = 16) -> None:
        self.pool = pool
        self.cache = np.zeros((BLOCKS, BB), dtype=np.uint8)
        self.copying = threading.Event()   # a copy started
        self.release = threading.Event()   # let it go on
        self.release.set()
        self.saver = Saver(self._put, BB, max_pending)

    def _put(self, h: bytes, payload: int, n: int) -> bool:
        self.copying.set()
        self.release.wait(30)
        return self.pool.put(h, payload, n)

    def hold(self) -> None:
        self.copying.clear()
        self.release.clear()

    def compute(self, block: int, seed: int) -> bytes:
        """The step writes the block (after fencing it, as the worker half does)."""
        self.saver.fence([block])
        data = np.random.default_rng(seed).integers(0, 255, BB, dtype=np.uint8)
        self.cache[block] = data
        return data.tobytes()

    def save(self, block: int, h: bytes) -> None:
        self.saver.enqueue([(block, h, self.cache[block].ctypes.data)])


def read_back(reader: NodePool, h: bytes) -> bytes | None:
    """What another node reads under `h` through the index (None: not published)."""
    with MetaClient(reader.config.metaserver) as client:
        res = client.query_prefix(NS, [h], reader.config.node_id)
    if not res.locations:
        return None
    dest = np.zeros(BB, dtype=np.uint8)
    result = reader.get(res.locations, res.nodes, [dest.ctypes.data]).wait()
    assert not result.failed
    return dest.tobytes()


@pytest.fixture
def pools(metaserver: MetaserverProcess) -> Iterator[tuple[NodePool, NodePool]]:
    a, b = make_pool(metaserver, "A", 16), make_pool(metaserver, "B", 4)
    yield a, b
    b.close()
    a.close()


def test_a_block_reused_while_its_copy_runs_waits_for_that_copy_and_the_computed_bytes_are_published(
        pools: tuple[NodePool, NodePool]) -> None:
    a, b = pools
    host = Host(a)
    try:
        computed = host.compute(0, seed=1)
        host.hold()
        host.save(0, block_hash("s", 0))
        host.copying.wait(10)                                   # the copy of block 0 is under way
        reused = threading.Thread(target=host.compute, args=(0, 2))  # the next step writes block 0 again
        reused.start()
        wait_for(lambda: host.saver.stats.fence_waits == 1)      # ... and waits for that copy
        assert reused.is_alive() and (host.cache[0].tobytes() == computed)
        host.release.set()
        reused.join(10)
        assert host.saver.drain(10)
        a.flush_publishes()
        assert read_back(b, block_hash("s", 0)) == computed     # the bytes of the step that computed it
    finally:
        host.release.set()
        host.saver.close()


def test_a_queued_save_of_a_reused_block_is_dropped_and_never_published(pools: tuple[NodePool, NodePool]) -> None:
    a, b = pools
    host = Host(a)
    try:
        first = host.compute(0, seed=3)
        host.compute(1, seed=4)
        host.hold()
        host.save(0, block_hash("q", 0))
        host.copying.wait(10)                                   # the copier is busy with block 0
        host.save(1, block_hash("q", 1))                        # block 1 waits in the queue
        host.compute(1, seed=5)                                  # reused before its copy ran: dropped
        assert host.saver.stats.saves_dropped_reused == 1 and host.saver.stats.fence_waits == 0
        host.release.set()
        assert host.saver.drain(10)
        a.flush_publishes()
        assert read_back(b, block_hash("q", 0)) == first
        assert read_back(b, block_hash("q", 1)) is None and block_hash("q", 1) not in a
    finally:
        host.release.set()
        host.saver.close()


def test_a_full_queue_drops_saves_and_never_blocks_the_host(pools: tuple[NodePool, NodePool]) -> None:
    a, _ = pools
    host = Host(a, max_pending=2)
    try:
        for i in range(BLOCKS):
            host.compute(i, seed=10 + i)
        host.hold()
        host.save(0, block_hash("t", 0))
        host.copying.wait(10)                                   # held: the copier cannot take more
        for i in range(1, BLOCKS):                               # returns although nothing moves
            host.save(i, block_hash("t", i))
        st = host.saver.stats
        assert (st.saves_queued, st.saves_dropped_behind) == (3, 1) and host.saver.pending() == 3
        host.release.set()
        assert host.saver.drain(10)
        assert st.saves_copied == 3 and [block_hash("t", i) in a for i in range(BLOCKS)] == [True, True, True, False]
    finally:
        host.release.set()
        host.saver.close()


class HostStaging:
    """The staging contract of `connector.device_memory.CudaStaging` in host memory: `stage`
    copies at once into a slot, its "event" completes when the test lets it (a slow
    device-to-host copy), and the fence's device-side waits are recorded."""

    def __init__(self, slots: int) -> None:
        self.buf = np.zeros((slots, BB), dtype=np.uint8)
        self.free = list(range(slots))
        self.done = threading.Event()
        self.done.set()
        self.ordered: list[threading.Event] = []

    def stage(self, payloads):  # noqa: ANN001, ANN201
        take = [self.free.pop() for _ in payloads[:len(self.free)]]
        for payload, slot in zip(payloads, take):
            self.buf[slot] = np.frombuffer((np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * BB)
                                                                  .from_address(payload))), dtype=np.uint8)
        return [self.buf[s].ctypes.data for s in take], (self.done if take else None)

    def wait(self, event: threading.Event) -> None:
        assert event.wait(30)

    def order_before_writes(self, event: threading.Event) -> None:
        self.ordered.append(event)

    def release(self, addr: int) -> None:
        self.free.append((addr - self.buf.ctypes.data) // BB)


def test_staged_saves_keep_a_reused_blocks_bytes_and_the_fence_orders_the_device_instead(
        pools: tuple[NodePool, NodePool]) -> None:
    a, b = pools
    host = Host(a)
    staging = HostStaging(slots=3)
    host.saver.use_staging(staging)
    try:
        computed = [host.compute(i, seed=20 + i) for i in range(BLOCKS)]
        staging.done.clear()                                      # the device-to-host copies are slow
        for i in range(BLOCKS):                                   # 3 slots: the 4th save is dropped
            host.save(i, block_hash("g", i))
        st = host.saver.stats
        assert (st.saves_queued, st.saves_dropped_behind) == (3, 1) and staging.free == []
        host.compute(0, seed=99)                                  # the next step writes block 0 again
        assert staging.ordered == [staging.done]                  # the device waits; nothing dropped
        assert st.saves_dropped_reused == 0 and st.fence_waits == 0
        staging.done.set()
        assert host.saver.drain(10)
        a.flush_publishes()
        assert read_back(b, block_hash("g", 0)) == computed[0]    # the bytes staged after its step
        assert [read_back(b, block_hash("g", i)) == computed[i] for i in (1, 2)] == [True, True]
        assert block_hash("g", 3) not in a and sorted(staging.free) == [0, 1, 2]
    finally:
        staging.done.set()
        host.saver.close()
