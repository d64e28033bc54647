"""Lookups off the scheduler thread: batching, deadlines, the circuit breaker.

What is faked: the metaserver client (a scripted `query_prefix_batch` that records its calls
and can be held, failed or released). What is real: `connector.lookup.Lookups`, its thread
and its breaker. The real-process version (metaserver frozen and killed under two engine
nodes) is in tests/reliability/test_faults.py.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from connector.lookup import Lookups, LookupState
from metaserver.errors import Unavailable
from metaserver.types import BlockHash, BlockLocation, NodeId, QueryResult
from tests.conftest import wait_for


class ScriptedClient:
    """Answers every chain with its first block on node "a"; `gate` holds calls, `fail` fails them."""

    def __init__(self) -> None:
        self.calls: list[int] = []          # lookups per call (0 = a probe)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.reports: list[tuple[str, list[bytes], str]] = []   # (source, hashes, reporter)

    def close(self) -> None:
        """Nothing to release."""

    def report_failed_read(self, source_node_id: str, block_hashes: Sequence[bytes] = (), reporter_node_id: str = "",
                           timeout_s: float | None = None) -> tuple[int, bool]:
        if self.fail:
            raise Unavailable("no metaserver reachable")
        self.reports.append((source_node_id, list(block_hashes), reporter_node_id))
        return len(block_hashes), not block_hashes

    def query_prefix_batch(self, queries: Sequence[tuple[str, Sequence[bytes]]], requester_node_id: str = "",
                           timeout_s: float | None = None, sparse: bool = False) -> list[QueryResult]:
        self.gate.wait(10)
        self.calls.append(len(queries))
        if self.fail:
            raise Unavailable("no metaserver reachable")
        return [QueryResult((BlockLocation(BlockHash(chain[0]), NodeId("a"), 0, 64, 1),), {}) for _, chain in queries]


def chain(i: int) -> list[bytes]:
    return [bytes([i]) * 32, bytes([i + 1]) * 32]


@pytest.fixture
def client() -> ScriptedClient:
    return ScriptedClient()


def make(client: ScriptedClient, deadline_s: float = 5.0, probe_interval_s: float = 0.05) -> Lookups:
    return Lookups(client, "ns", "me", timeout_s=1.0, deadline_s=deadline_s, breaker_failures=3,
                   probe_interval_s=probe_interval_s)


def test_lookups_in_flight_together_go_as_one_call(client: ScriptedClient) -> None:
    lk = make(client)
    try:
        client.gate.clear()                 # the thread takes the first lookup and is held in its call
        lk.submit("r0", chain(0))
        wait_for(lambda: lk.stats.batches == 0 and not lk._queued)
        for i in range(1, 9):               # eight more arrive meanwhile
            lk.submit(f"r{i}", chain(i))
        assert lk.poll("r5")[0] is LookupState.PENDING
        client.gate.set()
        wait_for(lambda: all(lk.poll(f"r{i}")[0] is LookupState.DONE for i in range(9)))
        assert client.calls == [1, 8]       # two RPCs for nine lookups
        state, res = lk.poll("r3")
        assert state is LookupState.DONE and res is not None and res.locations[0].block_hash == chain(3)[0]
    finally:
        lk.close()


def test_past_the_deadline_a_lookup_is_a_miss_and_a_late_answer_is_dropped(client: ScriptedClient) -> None:
    lk = make(client, deadline_s=0.05)
    try:
        client.gate.clear()
        lk.submit("r", chain(1))
        wait_for(lambda: lk.poll("r")[0] is LookupState.MISS, timeout_s=5)
        client.gate.set()
        wait_for(lambda: lk.stats.batches == 1)
        assert lk.poll("r") == (LookupState.MISS, None) and lk.stats.deadline_misses == 1
    finally:
        lk.close()


def test_breaker_opens_after_failures_answers_at_once_and_closes_when_a_probe_succeeds(
        client: ScriptedClient) -> None:
    lk = make(client)
    try:
        client.fail = True
        for i in range(3):                  # three failed calls in a row
            lk.submit(f"f{i}", chain(i))
            wait_for(lambda i=i: lk.poll(f"f{i}")[0] is LookupState.MISS)
        wait_for(lambda: lk.stats.breaker_open == 1)
        assert lk.stats.breaker_opens == 1
        calls = sum(1 for c in client.calls if c)
        lk.submit("skipped", chain(9))      # open: answered at once, no lookup sent
        assert lk.poll("skipped") == (LookupState.MISS, None) and lk.stats.breaker_skips >= 1
        wait_for(lambda: 0 in client.calls)  # probes (empty calls) while open
        assert sum(1 for c in client.calls if c) == calls
        client.fail = False                 # the metaserver answers again: the next probe closes it
        wait_for(lambda: lk.stats.breaker_open == 0)
        assert lk.stats.breaker_closes == 1
        lk.submit("after", chain(4))
        wait_for(lambda: lk.poll("after")[0] is LookupState.DONE)
    finally:
        lk.close()


def test_forgotten_lookups_leave_nothing_behind(client: ScriptedClient) -> None:
    lk = make(client)
    try:
        for i in range(200):
            lk.submit(f"r{i}", chain(i % 50))
            wait_for(lambda i=i: lk.poll(f"r{i}")[0] is LookupState.DONE)
            lk.forget(f"r{i}")
        assert not lk._submitted and not lk._results and not lk._queued
    finally:
        lk.close()


# ---- the scheduler half over it: answers never block, failed reads feed back -------------

class TwoNodeClient(ScriptedClient):
    """Every block of a chain is present: blocks 0-1 on node "a", the rest on node "b"."""

    def query_prefix_batch(self, queries, requester_node_id="", timeout_s=None, sparse=False):  # noqa: ANN001, ANN201
        self.gate.wait(10)
        self.calls.append(len(queries))
        return [QueryResult(tuple(BlockLocation(BlockHash(h), NodeId("a" if i < 2 else "b"), i * 64, 64, 1)
                                  for i, h in enumerate(chain)), {}) for _, chain in queries]


class GappedClient(ScriptedClient):
    """Answers sparse lookups only: every block of a chain is on node "a" but blocks 0 and 4
    (block 0 as a shared system prompt: hot in every engine, so aged out of the pool)."""

    def query_prefix_batch(self, queries, requester_node_id="", timeout_s=None, sparse=False):  # noqa: ANN001, ANN201
        self.calls.append(len(queries))
        assert sparse, "the connector's lookups must ask for every block held"
        return [QueryResult((), {}, tuple(self.held(i, h) for i, h in enumerate(chain))) for _, chain in queries]

    @staticmethod
    def held(i: int, block_hash: bytes) -> BlockLocation | None:
        return None if i in (0, 4) else BlockLocation(BlockHash(block_hash), NodeId("a"), i * 64, 64, 1)


def scheduler(client: ScriptedClient):  # noqa: ANN201
    from connector.pool_scheduler import PoolScheduler
    from connector.settings import PoolConnectorSettings

    # A deadline no loaded machine reaches: these tests are about what an answer offers (the
    # default 0.1 s would turn a late lookup thread into a miss); deadlines: `make` above.
    extra = {"metaserver": "127.0.0.1:1", "node_id": "me", "suspect_s": 30, "lookup_view": False,
             "lookup_deadline_s": 30}
    settings = PoolConnectorSettings.from_extra(lambda k, d=None: extra.get(k, d), 30.0)
    return PoolScheduler(settings, "ns", 4, consume=True, produce=False, client=client)


def hashes(seed: int, n: int) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(n)]


def matched(ps, rid: str, chain: list[bytes], computed: int = 0) -> int:  # noqa: ANN001
    """Ask like a host does, step after step, until the answer is in (never blocking)."""
    ps.start_lookup(rid, chain, len(chain) * 4 + 1)
    return wait_for(lambda: (n := ps.num_matched_tokens(rid, chain, len(chain) * 4 + 1, computed)) is not None
                    and (n,))[0]


def test_an_answer_in_flight_is_ask_again_later_then_the_hit() -> None:
    client = TwoNodeClient()
    ps = scheduler(client)
    try:
        client.gate.clear()
        chain = hashes(1, 5)
        ps.start_lookup("r", chain, 21)
        assert ps.num_matched_tokens("r", chain, 21, 0) is None     # in flight: never blocks
        client.gate.set()
        assert matched(ps, "r", chain) == 20
        assert ps.num_matched_tokens("r", chain, 21, 8) == 12       # after a local hit of 2 blocks: no new RPC
        assert sum(client.calls) == 1
    finally:
        ps.close()


def test_a_dead_source_is_paid_for_once_and_a_bad_block_alone() -> None:
    client = TwoNodeClient()
    ps = scheduler(client)
    try:
        chain = hashes(2, 5)
        assert matched(ps, "r1", chain) == 20
        ps.on_alloc("r1", list(range(100, 105)), 20)
        ps.build_meta()
        ps.on_worker_report({"r1"}, {102, 103, 104})                # every block from node b failed
        assert ps.num_matched_tokens("r1", chain, 21, 0) == 0       # that request: no remote hit again
        assert matched(ps, "r2", hashes(3, 5)) == 8                 # any other: cut before node b's blocks
        assert ps.counters()["connector_suspect_nodes"] == 1
        assert matched(ps, "r3", hashes(4, 5)) == 20 - 12 and client.calls
        ps.on_alloc("r3", list(range(200, 205)), 8)
        ps.build_meta()
        ps.on_worker_report({"r3"}, {200})                          # one block of node a: only that block
        assert ps.counters()["connector_suspect_nodes"] == 1
        assert matched(ps, "r4", hashes(4, 5)) == 0                 # its first block is the bad one
        assert matched(ps, "r5", hashes(5, 5)) == 8                 # node a's other blocks still offered
        # The metaserver heard of both, off the host's thread: node b whole, node a's one block.
        wait_for(lambda: len(client.reports) == 2)
        assert client.reports == [("b", [], "me"), ("a", [hashes(4, 5)[0]], "me")]
        assert ps.counters()["lookup_failed_read_reports"] == 2
    finally:
        ps.close()


def test_the_run_after_the_local_hit_is_offered_whatever_the_pool_lacks_before_it() -> None:
    client = GappedClient()
    ps = scheduler(client)
    try:
        chain = hashes(6, 8)                                         # 8 blocks; the lookup covers all 8
        assert matched(ps, "r", chain) == 0                          # no local hit: block 0 is not in the pool
        assert ps.num_matched_tokens("r", chain, 33, 4) == 12        # local hit of block 0: blocks 1-3
        assert ps.num_matched_tokens("r", chain, 33, 8) == 8         # of blocks 0-1: blocks 2-3
        assert ps.num_matched_tokens("r", chain, 33, 16) == 0        # block 4 is a gap
        assert ps.num_matched_tokens("r", chain, 33, 20) == 12       # blocks 5-7
        assert sum(client.calls) == 1                                # one lookup answered every local hit
        assert ps.num_matched_tokens("r", chain, 33, 4) == 12
        ps.on_alloc("r", list(range(100, 108)), 12)
        (load,) = ps.build_meta().loads                              # chain blocks 1-3 into cache blocks 1-3
        assert load.block_ids == (101, 102, 103)
        assert [loc.block_hash for loc in load.locations] == chain[1:4]
        ps.on_worker_report({"r"}, {102})                            # chain block 2 failed on node a
        assert matched(ps, "r2", chain, computed=4) == 4             # the run stops before it
        assert ps.num_matched_tokens("r2", chain, 33, 4) == 4
        assert ps.counters()["connector_avoided_blocks"] == 2        # blocks 2-3, counted once
        assert matched(ps, "r3", chain, computed=20) == 12           # other runs are untouched
    finally:
        ps.close()


def test_a_local_hit_touches_its_blocks_and_re_offers_those_the_index_lacks() -> None:
    """Recency: the pool never sees a local hit, so the request's first step touches its
    local-hit blocks in this node's pool and saves again those the index held nowhere (block
    0 and 4 here), from the request's own cache blocks; once per request, never for a node
    that does not save."""
    client = GappedClient()
    ps = scheduler(client)
    ps.produce = True
    try:
        chain = hashes(7, 8)
        assert matched(ps, "r", chain, computed=24) == 8            # local hit of blocks 0-5; 6-7 from "a"
        ps.on_alloc("r", list(range(100, 108)), 8)
        ps.build_meta()
        ps.plan_save("r", 32, 1, list(range(100, 109)), chain)      # the first step, after the load
        meta = ps.build_meta()
        assert meta.touches == chain[:6]
        assert [(s.block_ids, list(s.block_hashes)) for s in meta.saves] == [((100, 104), [chain[0], chain[4]])]
        assert ps.counters()["connector_touched_blocks"] == 6 and ps.counters()["connector_reoffered_blocks"] == 2
        ps.plan_save("r", 33, 1, list(range(100, 109)), chain)      # later steps: nothing again
        meta = ps.build_meta()
        assert meta.touches == [] and meta.saves == []
        ps.produce = False
        assert matched(ps, "r2", hashes(8, 8), computed=24) == 8
        ps.plan_save("r2", 32, 1, list(range(200, 209)), hashes(8, 8))
        meta = ps.build_meta()
        assert meta.touches == [] and meta.saves == []
    finally:
        ps.close()


class PublishingClient(ScriptedClient):
    """A producer's blocks reach the index only after `published` is set: before, the index
    holds only the chain's first block; after, the first `n` blocks (on node "p")."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.published = threading.Event()

    def query_prefix_batch(self, queries, requester_node_id="", timeout_s=None, sparse=False):  # noqa: ANN001, ANN201
        self.calls.append(len(queries))
        k = self.n if self.published.is_set() else 1
        return [QueryResult((), {}, tuple(BlockLocation(BlockHash(h), NodeId("p"), i * 64, 64, 1)
                                          for i, h in enumerate(chain[:k]))) for _, chain in queries]


def test_a_decode_request_waits_for_a_vllm_producers_blocks_to_reach_the_index() -> None:
    """P/D from a vLLM producer: its answer names the blocks by count (its worker publishes
    them a moment later). The decode request asks again ("None") until the run reaches them,
    then loads them; past `handoff_wait_s` it takes what the index holds."""
    from connector import handoff

    client = PublishingClient(5)
    ps = scheduler(client)
    try:
        chain = hashes(9, 6)
        params = handoff.vllm_producer_params("p", "req-1", [3, 4, 5], 5, "ns")
        ps.start_lookup("d", chain, 25, params)
        wait_for(lambda: client.calls)
        assert all(ps.num_matched_tokens("d", chain, 25, 0) is None for _ in range(3))  # 1 block of 5: wait
        client.published.set()
        assert wait_for(lambda: ps.num_matched_tokens("d", chain, 25, 0)) == 20        # all 5 blocks
        assert ps.counters()["connector_handoff_loads"] == 1
        # Another layout's producer: nothing expected, a plain lookup.
        other = handoff.vllm_producer_params("p", "req-2", [3], 5, "other-layout")
        client.published.clear()
        ps.start_lookup("e", chain, 25, other)
        assert wait_for(lambda: ps.num_matched_tokens("e", chain, 25, 0) is not None and 1) and \
            ps.num_matched_tokens("e", chain, 25, 0) == 4
        with pytest.raises(ValueError, match="kvpool_num_blocks"):
            handoff.expected_blocks({**params, "kvpool_num_blocks": -1}, "ns")
    finally:
        ps.close()


def test_past_the_wait_a_decode_request_takes_what_the_index_holds() -> None:
    from connector import handoff

    client = PublishingClient(5)
    extra = {"metaserver": "127.0.0.1:1", "node_id": "me", "lookup_view": False, "handoff_wait_s": 0.2}
    from connector.pool_scheduler import PoolScheduler
    from connector.settings import PoolConnectorSettings
    ps = PoolScheduler(PoolConnectorSettings.from_extra(lambda k, d=None: extra.get(k, d), 30.0), "ns", 4,
                       consume=True, produce=False, client=client)
    try:
        chain = hashes(10, 6)
        ps.start_lookup("d", chain, 25, handoff.vllm_producer_params("p", "r", [1], 5, "ns"))
        assert wait_for(lambda: ps.num_matched_tokens("d", chain, 25, 0), timeout_s=10) == 4   # never published
    finally:
        ps.close()
