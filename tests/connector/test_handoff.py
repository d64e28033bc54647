"""P/D hand-off in pieces: the transfer params a producer answers with and a consumer reads
(`connector.handoff`), and the scheduler holding a producer's answer until its send is
reported (with a scripted connector: what is checked is the scheduler's bookkeeping). The
whole path with real nodes, pools and a router is in tests/router/test_pd_e2e.py."""
from __future__ import annotations

import re

import pytest

from connector import handoff
from connector.pool_scheduler import PoolScheduler
from connector.settings import PoolConnectorSettings
from engine.kv_connector.base import KVConnectorOutput
from engine.request import Request, RequestStatus, SamplingParams
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from metaserver.types import BlockHash, BlockRecord, Namespace, NodeId, NodeRecord
from tests.engine.test_scheduler_loads import ScriptedConnector, finish_step, make

FP = "fp-test"
NODE = NodeRecord(NodeId("prefill-0"), "127.0.0.1:7001", 0x7F0000000000, 1 << 30, Namespace(FP), 0, 0)


def hashes(n: int, salt: str = "") -> list[bytes]:
    return [bytes([i]) * 31 + salt.encode()[:1].ljust(1, b".") for i in range(n)]


def params(n: int) -> dict:
    recs = [BlockRecord(BlockHash(h), i * 4160, 4160, 3 + i) for i, h in enumerate(hashes(n))]
    return handoff.producer_params(NODE, recs)


def test_a_consumer_reads_the_locations_the_producer_named() -> None:
    p = params(5)
    assert handoff.is_remote_prefill(p) and not handoff.wants_remote_decode(p)
    locations, nodes = handoff.consumer_hit(p, FP, hashes(4))      # its chain is shorter: 4 blocks taken
    assert [(loc.node_id, loc.offset, loc.size_bytes, loc.generation) for loc in locations] == \
        [("prefill-0", i * 4160, 4160, 3 + i) for i in range(4)]
    assert [loc.block_hash for loc in locations] == hashes(4)
    assert nodes == {NodeId("prefill-0"): NODE}


def test_a_consumer_takes_nothing_of_another_prompt_or_layout() -> None:
    other = hashes(5)
    other[2] = b"x" * 32                                             # the chains part at block 2
    assert len(handoff.consumer_hit(params(5), FP, other)[0]) == 2
    assert handoff.consumer_hit(params(5), "another-layout", hashes(5)) == ((), {})


@pytest.mark.parametrize("broken, message", [
    ({"remote_node_id": 7}, "remote_node_id"),
    ({"remote_buffer": -1}, "remote_buffer"),
    ({"remote_blocks": "all of them"}, "remote_blocks"),
    ({"remote_blocks": [["zz", 0, 1, 1]]}, "remote_blocks[0] must be [HASH_HEX"),
    ({"remote_blocks": [[hashes(1)[0].hex(), -5, 1, 1]]}, "remote_blocks[0] has a bad offset"),
])
def test_malformed_params_are_one_line_errors(broken: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        handoff.consumer_hit({**params(1), **broken}, FP, hashes(1))
    with pytest.raises(ValueError, match="remote_session"):
        handoff.consumer_hit({k: v for k, v in params(1).items() if k != "remote_session"}, FP, hashes(1))


class Producer(ScriptedConnector):
    """Holds the blocks of a request that asks for a remote decode (as the pool connector does)."""

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        super().request_finished(request, block_ids)
        return handoff.wants_remote_decode(request.kv_transfer_params), None


def test_a_producers_answer_waits_for_its_send_and_carries_its_params() -> None:
    sched, _, pool = make()
    conn = Producer()
    sched.remote.connector = conn
    free = pool.num_free
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    b = Request("b", list(range(100, 109)), SamplingParams(max_tokens=1))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    outputs = finish_step(sched, out)
    assert [o.request_id for o in outputs] == ["b"]                 # a finished but is not answered yet
    assert a.status is RequestStatus.FINISHED_LENGTH and sched.has_unfinished()
    assert pool.num_free < free                                      # its blocks are held
    assert sched.schedule().loads_to_wait == frozenset({"a"})        # the runner waits on the send, not spins
    sent = {"do_remote_prefill": True, "remote_blocks": []}
    outputs = finish_step(sched, sched.schedule(), report=KVConnectorOutput(finished_sending={"a"},
                                                                             kv_transfer_params={"a": sent}))
    assert [(o.request_id, o.finished, o.kv_transfer_params) for o in outputs] == [("a", True, sent)]
    assert pool.num_free == free and not sched.has_unfinished()


def test_a_send_that_never_reports_is_answered_without_params_at_the_timeout() -> None:
    sched, _, _ = make(timeout_s=30.0)
    now = [1000.0]
    sched.remote.clock = lambda: now[0]
    sched.remote.connector = Producer()
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    sched.add_request(a)
    assert finish_step(sched, sched.schedule()) == []
    assert finish_step(sched, sched.schedule()) == []      # held: its send has not reported
    now[0] += 30.5
    outputs = finish_step(sched, sched.schedule())
    assert [(o.request_id, o.finished, o.kv_transfer_params) for o in outputs] == [("a", True, None)]


@pytest.mark.parametrize("produce", [True, False])
def test_a_producer_sends_only_the_computed_full_prompt_blocks(metaserver: MetaserverProcess, produce: bool) -> None:
    """`PoolScheduler.finish_request`: a producer's request asking for a remote decode keeps
    its blocks and sends its full prompt blocks and, with the prompt's tokens, its last
    partial block as the tail (under `handoff.tail_hash`); one aborted in its prefill only the
    full blocks computed; a request without the ask, or a consumer, sends nothing."""
    extra = {"metaserver": metaserver.address}
    settings = PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)
    sched = PoolScheduler(settings, FP, 16, consume=True, produce=produce, client=MetaClient(metaserver.address))
    ask = {"do_remote_decode": True}
    table, chain, prompt = [5, 6, 7, 8], hashes(4), list(range(100, 160))
    none = (0, 0)
    try:
        assert sched.finish_request("done", ask, table, chain, num_prompt_tokens=60, num_computed_tokens=60,
                                    prompt_tokens=prompt) == ((3, 12) if produce else none)
        assert sched.finish_request("no-tokens", ask, table, chain, num_prompt_tokens=60,
                                    num_computed_tokens=60) == ((3, 0) if produce else none)
        assert sched.finish_request("aborted", ask, table, chain, num_prompt_tokens=60, num_computed_tokens=20,
                                    prompt_tokens=prompt) == ((1, 0) if produce else none)
        assert sched.finish_request("no-ask", None, table, chain, num_prompt_tokens=60, num_computed_tokens=60,
                                    prompt_tokens=prompt) == none
        assert not sched.finish_request("no-ask", None, table, chain, num_prompt_tokens=60, num_computed_tokens=60)
        assert sched.finish_request("short", ask, [5], chain[:1], num_prompt_tokens=9, num_computed_tokens=9,
                                    prompt_tokens=prompt[:9]) == ((0, 9) if produce else none)
        assert sched.finish_request("one-token-tail", ask, [5, 6], chain[:2], num_prompt_tokens=17,
                                    num_computed_tokens=17, prompt_tokens=prompt[:17]) == ((1, 0) if produce else none)
        sends = [(s.request_id, s.block_ids, s.block_hashes, s.tail_tokens) for s in sched.build_meta().sends]
        tail = handoff.tail_hash(FP, "done", chain[2], prompt[48:60])
        assert sends == ([("done", (5, 6, 7, 8), (*chain[:3], tail), 12),
                          ("no-tokens", (5, 6, 7), tuple(chain[:3]), 0),
                          ("aborted", (5,), tuple(chain[:1]), 0),
                          ("short", (5,), (handoff.tail_hash(FP, "short", None, prompt[:9]),), 9),
                          ("one-token-tail", (5,), tuple(chain[:1]), 0)]
                         if produce else [])
    finally:
        sched.close()


def test_the_tail_a_consumer_loads() -> None:
    """`handoff.consumer_tail`: the decode node's own name for the producer's last block and
    the tokens it loads from it (all but the prompt's last token); none for a prompt whose last
    block holds only that token, or whose producer declared a tail of another length."""
    chain, prompt = hashes(4), list(range(100, 164))
    declared = {"remote_request_id": "p-1", "kvpool_tail_tokens": 12}
    assert handoff.consumer_tail(declared, FP, chain, 60, 16, prompt[:60]) == \
        (handoff.tail_hash(FP, "p-1", chain[2], prompt[48:60]), 11)
    assert handoff.consumer_tail({}, FP, chain, 64, 16, prompt) == (chain[3], 15)   # a full last block
    assert handoff.consumer_tail(declared, FP, chain, 49, 16, prompt[:49]) is None  # the last token alone
    assert handoff.consumer_tail({**declared, "kvpool_tail_tokens": 5}, FP, chain, 60, 16, prompt[:60]) is None
    assert handoff.consumer_tail({}, FP, chain, 60, 16, prompt[:60]) is None        # no tail handed off
    assert handoff.consumer_tail(declared, FP, chain, 60, 16, None) is None
    assert handoff.tail_hash(FP, "p-1", chain[2], prompt[48:60]) != handoff.tail_hash(FP, "p-2", chain[2],
                                                                                          prompt[48:60])
    with pytest.raises(ValueError, match="remote_request_id"):
        handoff.consumer_tail({"kvpool_tail_tokens": 12}, FP, chain, 60, 16, prompt[:60])


def test_a_consumer_loads_the_named_tail_and_leaves_only_the_last_token(metaserver: MetaserverProcess) -> None:
    """A decode node given a producer's locations with a tail offers every prompt token but
    the last, and plans the load of the tail into the block after the full ones."""
    extra = {"metaserver": metaserver.address, "lookup_view": False}
    settings = PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)
    sched = PoolScheduler(settings, FP, 16, consume=True, produce=False, client=MetaClient(metaserver.address))
    chain, prompt = hashes(3), list(range(100, 160))
    tail = handoff.tail_hash(FP, "p-1", chain[2], prompt[48:60])
    recs = [BlockRecord(BlockHash(h), i * 4160, 4160, 3 + i) for i, h in enumerate([*chain, tail])]
    p = handoff.producer_params(NODE, recs, "p-1", 12)
    try:
        sched.start_lookup("d-1", chain, 60, p, prompt)
        assert sched.num_matched_tokens("d-1", chain, 60, 0) == 59
        assert sched.num_matched_tokens("d-1", chain, 60, 16) == 43     # after a local hit of one block
        sched.on_alloc("d-1", [9, 10, 11, 12], 43)
        (load,) = sched.build_meta().loads
        assert load.block_ids == (10, 11, 12) and [loc.block_hash for loc in load.locations] == [*chain[1:], tail]
        sched.start_lookup("d-2", chain, 60, {**p, "kvpool_tail_tokens": 7}, prompt)  # not this prompt's tail
        assert sched.num_matched_tokens("d-2", chain, 60, 0) == 48
    finally:
        sched.close()
