"""A Publish and an Unpublish of the same block, in flight at once: the index must end as
the pool holds. The metaserver applies them in the order they arrive (by hash, no
generation check), so an eviction's Unpublish that overtakes the Publish of the block it
evicts would leave the block indexed for good (seen as `kvpool bench soak`'s
"index = holdings ... MISMATCH"). A fake metaserver client holds the Publish in flight
until the eviction has either sent its Unpublish (the bug) or is waiting for the Publish."""
from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpool import NodePool, PoolConfig
from kvpool.layout import slot_bytes_for
from metaserver.client import Registration
from metaserver.types import BlockHash, BlockRecord
from tests.conftest import wait_for
from tests.kvpool.hooks import put_bytes
from tests.kvpool.pool_node import block_content, block_hash

BB = 4096


class OrderedIndex:
    """The blocks a node's records leave in the index, applied in arrival order as the
    metaserver does; a Publish waits for `release` once it has arrived (an RPC in flight)."""

    timeout_s = 5.0
    failovers = 0  # MetaClient's count of calls moved to another replica (NodeSession reads it)

    def __init__(self) -> None:
        self.held: dict[BlockHash, BlockRecord] = {}
        self.publishing = threading.Event()
        self.release = threading.Event()
        self.unpublished = threading.Event()
        self._lock = threading.Lock()

    def register_node(self, *args: object, **kw: object) -> Registration:
        return Registration(1, 30)

    def keepalive(self, node_id: str, lease_id: int) -> int:
        return 30

    def unregister_node(self, node_id: str, lease_id: int) -> int:
        return 0

    def publish(self, node_id: str, records: Sequence[BlockRecord]) -> int:
        self.publishing.set()
        assert self.release.wait(30), "test never released the publish"
        with self._lock:
            for r in records:
                self.held[r.block_hash] = r
        return len(records)

    def unpublish(self, node_id: str, hashes: Sequence[bytes]) -> int:
        with self._lock:
            n = sum(self.held.pop(BlockHash(h), None) is not None for h in hashes)
        self.unpublished.set()
        return n


def test_an_eviction_does_not_unpublish_ahead_of_the_blocks_publish() -> None:
    index = OrderedIndex()
    pool = NodePool(PoolConfig("n", 2 * slot_bytes_for(BB), BB, "ns", "fake:1", evict_batch=1),
                    index)  # type: ignore[arg-type]
    pool.start()
    try:
        first, *more = [block_hash("order", i) for i in range(3)]
        assert put_bytes(pool, first, block_content(first, BB))
        wait_for(index.publishing.is_set)  # its record was found current; the Publish is in flight

        def evict() -> None:  # two more blocks into two slots: `first` is evicted
            for h in more:
                assert put_bytes(pool, h, block_content(h, BB))
        t = threading.Thread(target=evict)
        t.start()
        # Until the eviction either unpublished `first` or holds its Unpublish back.
        wait_for(lambda: index.unpublished.is_set() or pool.stats.unpublish_waits > 0)
        index.release.set()
        t.join()
        assert pool.flush_publishes(timeout_s=60)
        with pool._lock:
            pooled = set(pool._lru)
        assert first not in pooled
        assert set(index.held) == pooled, "the index lists a block the pool evicted"
        assert pool.stats.unpublish_waits == 1
    finally:
        index.release.set()
        pool.close()
