"""Unit tests of the in-memory index (no network)."""
from metaserver.client import _query_result
from metaserver.index import BlockIndex
from metaserver.servicer import query_response
from metaserver.store import KeyCodec, record_from_pb, record_to_pb
from metaserver.types import BlockHash, BlockRecord, Medium, Namespace, NodeId, NodeRecord

NS = Namespace("model-a")


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def node(name: str, ns: str = NS, lease: int = 1) -> NodeRecord:
    return NodeRecord(NodeId(name), f"{name}:1", 0x1000, 1 << 20, Namespace(ns), lease, 10)


def publish(index: BlockIndex, name: str, hashes: list[int]) -> None:
    for i in hashes:
        assert index.add_block(NodeId(name), BlockRecord(h(i), i * 64, 64, 7))


def test_longest_prefix_stops_at_first_gap() -> None:
    idx = BlockIndex()
    idx.upsert_node(node("a"))
    publish(idx, "a", [0, 1, 2, 4, 5])
    r = idx.query(NS, [h(i) for i in range(6)])
    assert r.num_matched == 3
    assert [loc.block_hash for loc in r.locations] == [h(0), h(1), h(2)]
    assert r.locations[1].offset == 64 and r.locations[1].generation == 7
    assert idx.query(NS, [h(9), h(0)]).num_matched == 0


def test_namespaces_are_isolated() -> None:
    idx = BlockIndex()
    idx.upsert_node(node("a"))
    idx.upsert_node(node("b", ns="model-b"))
    publish(idx, "a", [0, 1])
    assert idx.query(Namespace("model-b"), [h(0)]).num_matched == 0
    assert idx.query(NS, [h(0), h(1)]).num_matched == 2


def test_requester_copy_first_else_spread_by_load() -> None:
    idx = BlockIndex()
    for n in "abc":
        idx.upsert_node(node(n))
        publish(idx, n, list(range(4)))
    r = idx.query(NS, [h(i) for i in range(4)], requester=NodeId("b"))
    assert {loc.node_id for loc in r.locations} == {"b"}
    sources = [loc.node_id for _ in range(30) for loc in idx.query(NS, [h(i) for i in range(4)]).locations]
    counts = {n: sources.count(n) for n in "abc"}
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_unknown_node_cannot_add_and_remove_node_drops_blocks() -> None:
    idx = BlockIndex()
    assert not idx.add_block(NodeId("ghost"), BlockRecord(h(0), 0, 64, 0))
    idx.upsert_node(node("a"))
    idx.upsert_node(node("b"))
    publish(idx, "a", [0, 1])
    publish(idx, "b", [0])
    assert sorted(idx.remove_node(NodeId("a"))) == [h(0), h(1)]
    r = idx.query(NS, [h(0), h(1)])
    assert r.num_matched == 1 and r.locations[0].node_id == "b"
    assert idx.stats().num_copies == idx.num_copies() == 1


def test_changes_are_idempotent() -> None:
    idx = BlockIndex()
    idx.upsert_node(node("a"))
    publish(idx, "a", [0])
    publish(idx, "a", [0])
    assert idx.stats().num_copies == idx.num_copies() == 1
    assert idx.remove_block(NodeId("a"), h(0))
    assert not idx.remove_block(NodeId("a"), h(0))
    assert idx.stats().num_blocks == 0


def test_reregistration_with_new_buffer_drops_old_blocks() -> None:
    idx = BlockIndex()
    idx.upsert_node(node("a"))
    publish(idx, "a", [0, 1])
    moved = NodeRecord(NodeId("a"), "a:2", 0x2000, 1 << 20, NS, 2, 10)
    assert sorted(idx.upsert_node(moved)) == [h(0), h(1)]
    assert idx.query(NS, [h(0)]).num_matched == 0 and idx.num_copies() == 0


def test_invalidate_by_hash_namespace_all() -> None:
    idx = BlockIndex()
    idx.upsert_node(node("a"))
    idx.upsert_node(node("b"))
    idx.upsert_node(node("c", ns="other"))
    publish(idx, "a", [0, 1, 2])
    publish(idx, "b", [1])
    publish(idx, "c", [5])
    assert idx.num_copies() == idx.stats().num_copies == 5
    assert len(idx.remove_hashes(NS, [h(1)])) == 2
    assert idx.query(NS, [h(0), h(1)]).num_matched == 1
    assert len(idx.remove_namespace(NS)) == 2
    assert idx.stats().num_copies == idx.num_copies() == 1
    assert len(idx.remove_all()) == 1
    assert idx.stats().num_copies == idx.num_copies() == 0 and idx.stats().num_nodes == 3


def test_prefix_by_node_counts_each_holders_own_run() -> None:
    """A router's question: the pool's longest prefix, and per node the blocks it holds from 0."""
    idx = BlockIndex()
    for n in "abc":
        idx.upsert_node(node(n))
    publish(idx, "a", [0, 1, 2, 3])
    publish(idx, "b", [0, 1, 4, 5])      # b's own run ends at block 2; a, then b, carry the chain to 6
    publish(idx, "c", [1, 2])            # c holds no block 0: no run of its own
    chain = [h(i) for i in range(8)]
    assert idx.prefix_by_node(NS, chain) == (6, {NodeId("a"): 4, NodeId("b"): 2})
    assert idx.prefix_by_node(NS, [h(9)] + chain) == (0, {})
    assert idx.prefix_by_node(Namespace("other"), chain) == (0, {})
    assert idx.present(NS, [h(9)] + chain) == [False, True, True, True, True, True, True, False, False]
    assert idx.present(Namespace("other"), chain[:2]) == [False, False]
    assert idx.mark_suspect(NodeId("a"), 30)  # not offered: block 3 is then missing
    assert idx.prefix_by_node(NS, chain) == (3, {NodeId("b"): 2})
    assert idx.present(NS, chain) == [True, True, True, False, True, True, False, False]


def test_sparse_query_answers_every_block_held_and_the_run_from_any_block() -> None:
    """A first block the pool dropped (a shared system prompt: a local hit on every engine, so
    never saved or read again) hides nothing behind it from a sparse query."""
    idx = BlockIndex()
    for n in "ab":
        idx.upsert_node(node(n))
    publish(idx, "a", [1, 2, 3, 6])
    publish(idx, "b", [4])
    chain = [h(i) for i in range(9)]
    assert idx.query(NS, chain) == idx.query(NS, chain, sparse=False)
    assert idx.query(NS, chain).held == () and idx.query(NS, chain).num_matched == 0
    r = idx.query(NS, chain, sparse=True)
    assert r.num_matched == 0 and r.num_held == 5 and set(r.nodes) == {"a", "b"}
    assert [loc and loc.block_hash for loc in r.held] == [None, h(1), h(2), h(3), h(4), None, h(6)]  # no trailing gap
    assert [loc.block_hash for loc in r.run_from(1)] == [h(1), h(2), h(3), h(4)]
    assert [loc.node_id for loc in r.run_from(3)] == ["a", "b"]
    assert r.run_from(0) == r.run_from(5) == r.run_from(7) == r.run_from(20) == ()
    assert [loc.block_hash for loc in r.run_from(6)] == [h(6)]

    publish(idx, "b", [0])
    r = idx.query(NS, chain, sparse=True)
    assert r.num_matched == 5 and r.locations == r.held[:5] == idx.query(NS, chain).locations
    assert r.run_from(2) == r.locations[2:]
    assert idx.mark_suspect(NodeId("b"), 30)  # a block only a suspect holds is a gap, not the end
    r = idx.query(NS, chain, sparse=True)
    assert [loc is not None for loc in r.held] == [False, True, True, True, False, False, True]
    assert set(r.nodes) == {"a"} and idx.query(NS, chain).num_matched == 0


def test_a_prefix_answer_stands_for_a_sparse_one_that_knows_nothing_past_the_gap() -> None:
    """Over the wire (servicer's conversion, then the client's): a sparse answer keeps each
    block's place in the chain; a prefix answer (what a server that predates `sparse` sends)
    reads as a sparse answer whose blocks are the prefix."""
    idx = BlockIndex()
    idx.upsert_node(node("a"))
    publish(idx, "a", [0, 1, 3, 4])
    chain = [h(i) for i in range(6)]
    sparse = idx.query(NS, chain, sparse=True)
    assert _query_result(chain, query_response(sparse), sparse=True) == sparse
    prefix = idx.query(NS, chain)
    assert _query_result(chain, query_response(prefix), sparse=False) == prefix
    old = _query_result(chain, query_response(prefix), sparse=True)
    assert old.locations == prefix.locations and old.run_from(0) == prefix.locations and old.run_from(3) == ()
    assert _query_result(chain, query_response(idx.query(NS, [h(9)], sparse=True)), sparse=True).num_held == 0


def _dram_and_disk_copies() -> BlockIndex:
    """Nodes a and b: block 0 DRAM on a; 1 DISK on a; 2 DISK on a and DRAM on b."""
    idx = BlockIndex()
    for n in "ab":
        idx.upsert_node(node(n))
    publish(idx, "a", [0])
    for i in (1, 2):
        assert idx.add_block(NodeId("a"), BlockRecord(h(i), i * 4096, 64, 3, Medium.DISK))
    publish(idx, "b", [2])
    return idx


def test_a_disk_copy_is_offered_to_its_holder_only() -> None:
    """Another node's DISK block is not in registered memory: not offered to other nodes
    unless its holder stages it (then after any DRAM copy). Its holder gets it (it reads its
    own disk), and a DRAM copy elsewhere is offered instead."""
    idx = _dram_and_disk_copies()
    chain = [h(i) for i in range(3)]
    mine = idx.query(NS, chain, requester=NodeId("a"))
    assert [(loc.node_id, loc.medium) for loc in mine.locations] == [("a", Medium.DRAM), ("a", Medium.DISK),
                                                                     ("a", Medium.DISK)]
    theirs = idx.query(NS, chain, requester=NodeId("b"))
    assert theirs.num_matched == 1 and theirs.locations[0].medium == Medium.DRAM
    sparse = idx.query(NS, chain, requester=NodeId("c"), sparse=True)
    assert [loc and (loc.node_id, loc.medium) for loc in sparse.held] == [("a", Medium.DRAM), None,
                                                                          ("b", Medium.DRAM)]
    # over the wire, and through etcd's stored value
    assert _query_result(chain, query_response(mine), sparse=False) == mine
    rec = BlockRecord(h(1), 4096, 64, 3, Medium.DISK)
    assert record_from_pb(record_to_pb(rec)) == rec
    change = KeyCodec("/kv/").decode(b"/kv/blocks/a/" + h(1).hex().encode(), KeyCodec.block_value(NS, rec), True, 1)
    assert change is not None and change.block == rec
    stats = idx.stats().namespaces[0]
    assert stats.num_copies == 4 and stats.num_disk_copies == 2
    assert (stats.dram_bytes, stats.disk_bytes) == (2 * 64, 2 * 64)   # a:0 and b:2 / a:1 and a:2
    assert idx.present(NS, chain) == [True, False, True]  # a router cannot have a's disk copy pulled

    # A holder that stages (kvpool.stage) is offered for its disk copies, after any DRAM copy.
    from dataclasses import replace

    idx.upsert_node(replace(idx.nodes[NodeId("a")], stage_address="127.0.0.1:9"))
    theirs = idx.query(NS, chain, requester=NodeId("b"))
    assert [(loc.node_id, loc.medium) for loc in theirs.locations] == [("a", Medium.DRAM), ("a", Medium.DISK),
                                                                       ("b", Medium.DRAM)]
    assert _query_result(chain, query_response(theirs), sparse=False).nodes["a"].stage_address == "127.0.0.1:9"
    assert idx.present(NS, chain) == [True, True, True]


def test_disk_says_which_blocks_a_router_prices_as_disk_reads() -> None:
    """Block 0 DRAM on a; 1 DISK on a only; 2 DISK on a and DRAM on b. Per block, whether
    every copy a reader can have is on a disk; per node, which of its own copies are."""
    from dataclasses import replace

    idx = _dram_and_disk_copies()
    chain = [h(i) for i in range(4)]
    # a does not stage: its disk copy of block 1 is usable by nobody else (present says so too)
    assert idx.disk(NS, chain) == ([False, False, False, False], {"a": {1, 2}})
    idx.upsert_node(replace(idx.nodes[NodeId("a")], stage_address="127.0.0.1:9"))
    assert idx.disk(NS, chain) == ([False, True, False, False], {"a": {1, 2}})
    assert idx.disk(Namespace("other"), chain) == ([False] * 4, {})
