"""The gRPC service end to end: real metaserver process, real etcd."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from metaserver.errors import FailedPrecondition, InvalidArgument, MetaError, NotFound, ResourceExhausted
from metaserver.types import BlockHash, BlockRecord

NS = "smollm2-135m|fp32|bs16|L30|kv3|hd64"
CAP = 1 << 20


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def recs(ids: list[int], size: int = 4096) -> list[BlockRecord]:
    return [BlockRecord(h(i), i * size, size, 1) for i in ids]


@pytest.fixture
def client(metaserver: MetaserverProcess):
    with MetaClient(metaserver.address) as c:
        c.register_node("node-a", "127.0.0.1:7001", 0x7F0000000000, CAP, NS, 10)
        c.register_node("node-b", "127.0.0.1:7002", 0x7F1000000000, CAP, NS, 10)
        yield c


def test_publish_query_invalidate_round_trip(client: MetaClient) -> None:
    assert client.publish("node-a", recs([0, 1, 2, 3])) == 4
    r = client.query_prefix(NS, [h(i) for i in range(6)])
    assert r.num_matched == 4
    assert [loc.offset for loc in r.locations] == [0, 4096, 8192, 12288]
    assert r.nodes["node-a"].session_address == "127.0.0.1:7001"
    assert r.nodes["node-a"].buffer_address == 0x7F0000000000

    assert client.invalidate(namespace=NS, hashes=[h(2)]) == 1
    assert client.query_prefix(NS, [h(i) for i in range(4)]).num_matched == 2
    assert client.unpublish("node-a", [h(1)]) == 1
    assert client.query_prefix(NS, [h(0), h(1)]).num_matched == 1

    client.publish("node-b", recs([0, 1]))
    assert client.invalidate(node_id="node-a") == 2  # h0 and h3 were left on node-a
    r = client.query_prefix(NS, [h(0), h(1)])
    assert r.num_matched == 2 and {loc.node_id for loc in r.locations} == {"node-b"}
    assert client.invalidate(namespace=NS, by_namespace=True) == 2
    client.publish("node-a", recs([7]))
    assert client.invalidate(all=True) == 1
    assert client.stats().index.num_copies == 0
    assert len(client.list_nodes()) == 2  # invalidation keeps nodes registered


def test_batched_queries_answer_each_as_its_own_query_would(client: MetaClient) -> None:
    client.publish("node-a", recs([0, 1, 2]))
    client.publish("node-b", recs([10, 11]))
    chains = [[h(0), h(1), h(2), h(3)], [h(10), h(11)], [h(20)], [h(1)]]
    batch = client.query_prefix_batch([(NS, c) for c in chains], requester_node_id="node-b")
    assert [r.num_matched for r in batch] == [3, 2, 0, 1]
    for chain, got in zip(chains, batch):
        assert got == client.query_prefix(NS, chain, "node-b")
    with pytest.raises(InvalidArgument, match="at most 1024 queries"):
        client.query_prefix_batch([(NS, [h(0)])] * 1025)
    with pytest.raises(NotFound, match="unknown"):  # one bad query fails the call, as alone
        client.query_prefix_batch([(NS, [h(0)]), ("no-such-model", [h(0)])])


def test_break_in_chain_ends_match(client: MetaClient) -> None:
    client.publish("node-a", recs([0, 1, 3, 4]))
    client.publish("node-b", recs([2]))
    r = client.query_prefix(NS, [h(i) for i in range(5)])
    assert r.num_matched == 5  # the gap at 2 is filled by node-b
    assert [loc.node_id for loc in r.locations] == ["node-a", "node-a", "node-b", "node-a", "node-a"]
    client.unpublish("node-b", [h(2)])
    assert client.query_prefix(NS, [h(i) for i in range(5)]).num_matched == 2


def test_sparse_query_answers_the_blocks_behind_a_missing_first_block(client: MetaClient) -> None:
    client.publish("node-a", recs([1, 2, 3, 5]))
    client.publish("node-b", recs([0]))
    assert client.unpublish("node-b", [h(0)]) == 1        # block 0 left the pool (evicted there)
    chain = [h(i) for i in range(7)]
    assert client.query_prefix(NS, chain).num_matched == 0
    r = client.query_prefix(NS, chain, sparse=True)
    assert r.num_matched == 0 and r.num_held == 4
    assert [loc.block_hash for loc in r.run_from(1)] == chain[1:4]
    assert [loc.offset for loc in r.run_from(1)] == [4096, 8192, 12288]
    assert r.run_from(4) == () and [loc.block_hash for loc in r.run_from(5)] == [h(5)]
    assert r.nodes["node-a"].session_address == "127.0.0.1:7001"
    batch = client.query_prefix_batch([(NS, chain), (NS, chain[1:])], "node-b", sparse=True)
    assert batch[0] == client.query_prefix(NS, chain, "node-b", sparse=True)
    assert batch[1].num_matched == 3 and batch[1].run_from(0) == r.run_from(1)


def test_own_copy_first_then_spread_by_load(client: MetaClient) -> None:
    client.publish("node-a", recs(list(range(8))))
    client.publish("node-b", recs(list(range(8))))
    chain = [h(i) for i in range(8)]
    mine = client.query_prefix(NS, chain, requester_node_id="node-b")
    assert {loc.node_id for loc in mine.locations} == {"node-b"}
    sources = [loc.node_id for _ in range(10) for loc in client.query_prefix(NS, chain, "node-c").locations]
    assert abs(sources.count("node-a") - sources.count("node-b")) <= 1


def test_drain_stops_serving_and_publishing_until_undrain(client: MetaClient) -> None:
    client.publish("node-a", recs([0, 1]))
    assert client.drain("node-a") == 2
    assert client.query_prefix(NS, [h(0)]).num_matched == 0
    with pytest.raises(FailedPrecondition, match="draining"):
        client.publish("node-a", recs([0]))
    assert [n.draining for n, _ in client.list_nodes() if n.node_id == "node-a"] == [True]

    assert client.undrain("node-a") is True
    assert [n.draining for n, _ in client.list_nodes() if n.node_id == "node-a"] == [False]
    assert client.query_prefix(NS, [h(0)]).num_matched == 0  # drain dropped its blocks: re-published below
    assert client.publish("node-a", recs([0, 1])) == 2
    r = client.query_prefix(NS, [h(0), h(1)])
    assert r.num_matched == 2 and {loc.node_id for loc in r.locations} == {"node-a"}  # a source again
    assert client.undrain("node-a") is False  # not draining: nothing changes
    assert client.query_prefix(NS, [h(0), h(1)]).num_matched == 2


def test_unregister_removes_node_and_blocks(client: MetaClient) -> None:
    reg = client.register_node("node-c", "127.0.0.1:7003", 0, CAP, NS, 10)
    client.publish("node-c", recs([0]))
    assert client.unregister_node("node-c", reg.lease_id) == 1
    assert "node-c" not in {n.node_id for n, _ in client.list_nodes()}
    with pytest.raises(NotFound):
        client.keepalive("node-c", reg.lease_id)


def test_health_and_reflection(metaserver: MetaserverProcess) -> None:
    with grpc.insecure_channel(metaserver.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvpool.v1.MetaService", "kvpool.v1.MetaService.etcd"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"kvpool.v1.MetaService", "grpc.health.v1.Health"} <= names



def test_unknown_method_and_undecodable_request(metaserver: MetaserverProcess) -> None:
    """The service's handlers are registered methods: a method it lacks is UNIMPLEMENTED, and
    bytes that are not the request message are INVALID_ARGUMENT (not gRPC's INTERNAL)."""
    with grpc.insecure_channel(metaserver.address) as ch:
        for method in ("/kvpool.v1.MetaService/NoSuchMethod", "/no.such.Service/QueryPrefix"):
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(method)(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/kvpool.v1.MetaService/QueryPrefix")(b"\xff\xff\xff", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid kvpool.v1.QueryPrefixRequest" in err.value.details()


# ---- bad input: the right status, a message, and no change to the index -----------------

BAD_CASES = [
    ("hash of wrong length", lambda c: c.publish("node-a", [BlockRecord(BlockHash(b"\1" * 31), 0, 64, 0)]),
     InvalidArgument, "31 bytes, expected 32"),
    ("empty publish", lambda c: c.publish("node-a", []), InvalidArgument, "at least one"),
    ("oversized publish", lambda c: c.publish("node-a", recs(list(range(8193)), size=64)), ResourceExhausted,
     "exceed the limit"),
    ("oversized query", lambda c: c.query_prefix(NS, [h(i) for i in range(16385)]), ResourceExhausted, "limit"),
    ("empty query", lambda c: c.query_prefix(NS, []), InvalidArgument, "at least one"),
    ("unregistered node publishes", lambda c: c.publish("ghost", recs([0])), FailedPrecondition, "not registered"),
    ("unknown namespace query", lambda c: c.query_prefix("no-such-model", [h(0)]), NotFound, "unknown"),
    ("unknown namespace invalidate", lambda c: c.invalidate(namespace="nope", by_namespace=True), NotFound, "unknown"),
    ("negative size", lambda c: c.publish("node-a", [BlockRecord(h(0), 0, -5, 0)]), InvalidArgument, "outside"),
    ("negative offset", lambda c: c.publish("node-a", [BlockRecord(h(0), -64, 64, 0)]), InvalidArgument, "outside"),
    ("block past the pool", lambda c: c.publish("node-a", [BlockRecord(h(0), CAP - 10, 64, 0)]), InvalidArgument,
     "outside"),
    ("absurd capacity", lambda c: c.register_node("node-z", "127.0.0.1:1", 0, 1 << 62, NS), InvalidArgument,
     "capacity_bytes"),
    ("negative capacity", lambda c: c.register_node("node-z", "127.0.0.1:1", 0, -1, NS), InvalidArgument,
     "capacity_bytes"),
    ("bad node id", lambda c: c.register_node("a/b", "127.0.0.1:1", 0, 64, NS), InvalidArgument, "node_id"),
    ("bad session address", lambda c: c.register_node("node-z", "nowhere", 0, 64, NS), InvalidArgument,
     "session_address"),
    ("absurd lease ttl", lambda c: c.register_node("node-z", "127.0.0.1:1", 0, 64, NS, 10**6), InvalidArgument,
     "lease_ttl_s"),
    ("api url with a path", lambda c: c.register_node("node-z", "127.0.0.1:1", 0, 64, NS, api_url="http://h:80/v1"),
     InvalidArgument, "api_url"),
    ("api url of another scheme", lambda c: c.register_node("node-z", "127.0.0.1:1", 0, 64, NS, api_url="ftp://h:21"),
     InvalidArgument, "api_url"),
    ("invalidate without target", lambda c: c.invalidate(), InvalidArgument, "one target"),
    ("invalidate unknown node", lambda c: c.invalidate(node_id="ghost"), NotFound, "not registered"),
    ("keepalive of unknown node", lambda c: c.keepalive("ghost", 1), NotFound, "register again"),
    ("drain unknown node", lambda c: c.drain("ghost"), NotFound, "unknown node id 'ghost': it is not registered"),
    ("undrain unknown node", lambda c: c.undrain("ghost"), NotFound, "unknown node id 'ghost'"),
    ("undrain bad node id", lambda c: c.undrain(""), InvalidArgument, "node_id is required"),
    ("one bad record spoils the batch", lambda c: c.publish("node-a", recs([0, 1]) + [BlockRecord(h(2), 0, 0, 0)]),
     InvalidArgument, "block #2"),
]


def _snapshot(c: MetaClient) -> tuple:
    s = c.stats()
    return (s.index, tuple(sorted((n.node_id, k, n.draining) for n, k in c.list_nodes())),
            c.query_prefix(NS, [h(i) for i in range(4)]).num_matched)


@pytest.mark.parametrize("name,call,exc,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_rejected_without_change(client: MetaClient, name: str, call, exc: type[MetaError],
                                              message: str) -> None:
    client.publish("node-a", recs([0, 1]))
    before = _snapshot(client)
    with pytest.raises(exc, match=message) as info:
        call(client)
    assert info.value.code == exc.code
    assert _snapshot(client) == before
