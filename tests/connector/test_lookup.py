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

    def query_prefix_batch(self, queries: Sequence[tuple[str, Sequence[bytes]]], requester_node_id: str = "",
                           timeout_s: float | None = None) -> list[QueryResult]:
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
