"""Prefetch on lookup: other nodes' disk blocks in an offered run are staged ahead of the load.

What is faked: the metaserver client (a scripted lookup answer with DRAM and DISK copies on
this and other nodes) and the stage call (records its requests; can be held). What is real:
`connector.prefetch.Prefetcher`, its thread and queue, and `PoolScheduler` offering it runs.
The real-process version (a reader's remote disk hit, staged before its load) is in
tests/connector/test_disk_tier_e2e.py.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from connector.prefetch import Prefetcher
from metaserver.types import BlockHash, BlockLocation, Medium, NodeId, NodeRecord, QueryResult
from tests.conftest import wait_for
from tests.connector.test_lookup import ScriptedClient, hashes, matched
from tests.connector.test_lookup import scheduler as lookup_scheduler


class FakeStage:
    """Records stage requests; answers every block staged unless `fail`; `gate` holds calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    def __call__(self, address: str, hashes: Sequence[bytes], timeout_s: float) -> list:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append((address, list(hashes)))
        return [None if self.fail else (i * 64, 1) for i in range(len(hashes))]


def node(node_id: str, stage_address: str = "") -> NodeRecord:
    return NodeRecord(NodeId(node_id), f"{node_id}:1", 0, 1 << 20, "ns", 1, 10, stage_address=stage_address)


class MixedClient(ScriptedClient):
    """Every block of a chain is held: 0 DRAM on "a", 1-2 DISK on "b" (stages), 3 DISK on
    this node ("me"), 4 DISK on "c" (does not stage: the index would not offer it, but the
    scheduler must not ask anyway), 5 DRAM on "b"."""

    PLACES = [("a", Medium.DRAM), ("b", Medium.DISK), ("b", Medium.DISK), ("me", Medium.DISK),
              ("c", Medium.DISK), ("b", Medium.DRAM)]

    def query_prefix_batch(self, queries, requester_node_id="", timeout_s=None, sparse=False):  # noqa: ANN001, ANN201
        self.calls.append(len(queries))
        nodes = {NodeId("a"): node("a", "a:9"), NodeId("b"): node("b", "b:9"), NodeId("me"): node("me", "me:9"),
                 NodeId("c"): node("c")}
        return [QueryResult(tuple(BlockLocation(BlockHash(h), NodeId(n), i * 64, 64, 1, m)
                                  for i, (h, (n, m)) in enumerate(zip(chain, self.PLACES))), nodes)
                for _, chain in queries]


def scheduler(client: ScriptedClient, fake: FakeStage):  # noqa: ANN201
    ps = lookup_scheduler(client)
    assert ps._prefetch is not None
    ps._prefetch.close()
    ps._prefetch = Prefetcher(1.0, stage_fn=fake)
    return ps


def test_only_other_nodes_disk_copies_are_prefetched() -> None:
    fake = FakeStage()
    ps = scheduler(MixedClient(), fake)
    try:
        chain = hashes(1, 7)  # 6 blocks looked up (the last token is computed)
        assert matched(ps, "r", chain) == 24
        wait_for(lambda: ps.counters()["connector_prefetch_staged"] == 2)
        assert fake.calls == [("b:9", chain[1:3])]   # not DRAM ("a", "b"), not its own disk, not a non-stager
        c = ps.counters()
        assert (c["connector_prefetch_requests"], c["connector_prefetch_blocks"], c["connector_prefetch_failed"],
                c["connector_prefetch_dropped"]) == (1, 2, 0, 0)
        # Asked again (the host asks at every step until it schedules): not staged twice.
        assert ps.num_matched_tokens("r", chain, 29, 0) == 24
        assert ps.num_matched_tokens("r", chain, 29, 8) == 16   # after a local hit: the run starts at block 2
        time.sleep(0.05)
        assert len(fake.calls) == 1
    finally:
        ps.close()


def test_no_prefetch_after_a_local_hit_past_the_disk_blocks() -> None:
    fake = FakeStage()
    ps = scheduler(MixedClient(), fake)
    try:
        chain = hashes(2, 7)
        assert matched(ps, "r", chain, computed=12) == 12   # blocks 3-5 offered: own disk, "c", DRAM
        time.sleep(0.05)
        assert fake.calls == [] and ps.counters()["connector_prefetch_requests"] == 0
    finally:
        ps.close()


def test_offer_never_blocks_and_drops_when_the_queue_is_full() -> None:
    fake = FakeStage()
    fake.gate.clear()
    pf = Prefetcher(1.0, max_queued=1, stage_fn=fake)
    try:
        assert pf.offer("b:9", [b"1" * 32])
        assert fake.entered.wait(5)                       # the thread holds the first request
        offers: list[bool] = []                           # made while the stage call is held, for good:
        caller = threading.Thread(target=lambda: offers.extend(  # an offer that waited on it never returns
            [pf.offer("b:9", [b"2" * 32]), pf.offer("b:9", [b"3" * 32])]))
        caller.start()
        caller.join(60)
        assert not caller.is_alive(), "offer waited on the stage call in progress"
        assert offers == [True, False]                    # queued, then full: dropped
        assert pf.counters()["connector_prefetch_dropped"] == 1
        fake.gate.set()
        wait_for(lambda: pf.counters()["connector_prefetch_staged"] == 2)
        assert [h for _, hs in fake.calls for h in hs] == [b"1" * 32, b"2" * 32]
        assert pf.offer("b:9", [b"3" * 32])               # room again: the dropped block can be asked later
    finally:
        fake.gate.set()
        pf.close()


def test_a_block_not_staged_is_counted_failed_and_may_be_asked_again() -> None:
    fake = FakeStage()
    fake.fail = True
    pf = Prefetcher(1.0, stage_fn=fake)
    try:
        assert pf.offer("b:9", [b"1" * 32])
        wait_for(lambda: pf.counters()["connector_prefetch_failed"] == 1)
        fake.fail = False
        assert pf.offer("b:9", [b"1" * 32])
        wait_for(lambda: pf.counters()["connector_prefetch_staged"] == 1)
        assert not pf.offer("b:9", [b"1" * 32])           # staged lately: not asked again
    finally:
        pf.close()


def test_a_stage_error_is_a_failed_prefetch() -> None:
    from kvpool.stage import StageError

    def boom(address: str, hashes: Sequence[bytes], timeout_s: float) -> list:
        raise StageError("no answer")

    pf = Prefetcher(1.0, stage_fn=boom)
    try:
        assert pf.offer("b:9", [b"1" * 32, b"2" * 32])
        wait_for(lambda: pf.counters()["connector_prefetch_failed"] == 2)
    finally:
        pf.close()
