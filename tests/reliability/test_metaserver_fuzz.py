"""Property-based fuzzing of every MetaService RPC against one real metaserver and etcd.

(a) random bytes (and byte-mutated valid requests) as the serialized request, through a raw
    channel with identity serializers;
(b) well-formed messages with random and out-of-range values: empty, short, long and
    oversized hashes, huge batches, extreme integers, unknown, empty and unicode ids.
Properties of every answer: the server stays SERVING; the status is OK or an expected error
with a message (never UNKNOWN or INTERNAL, as an unhandled exception would give); a rejected
request leaves the index exactly as it was (Stats, every node's lease and block count, and
the located chains); an accepted removal reports exactly what it removed.

The module's index starts from a known baseline (three nodes, chains in two namespaces);
after an accepted change the baseline is written back and the replica let settle.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from google.protobuf.message import Message

from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from metaserver.client import MetaClient
from metaserver.errors import NotFound
from metaserver.types import BlockHash, BlockRecord

pytestmark = pytest.mark.slow

NS, NS2 = "ns-fuzz|fp32|bs16", "ns-fuzz-2"
CAP = 1 << 20
BLOCK = 4096
SERVICE = pb.DESCRIPTOR.services_by_name["MetaService"]
METHODS = [m.name for m in SERVICE.methods]
STREAMS = {m.name for m in SERVICE.methods if m.server_streaming}
REQUEST = {m.name: getattr(pb, m.input_type.name) for m in SERVICE.methods}
RESPONSE = {m.name: getattr(pb, m.output_type.name) for m in SERVICE.methods}
EXPECTED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS,
                   grpc.StatusCode.PERMISSION_DENIED}
FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


@dataclass(frozen=True)
class Held:
    node_id: str
    namespace: str
    ids: range
    address: str


BASELINE = (Held("fz-a", NS, range(0, 8), "127.0.0.1:7001"), Held("fz-b", NS, range(4, 12), "127.0.0.1:7002"),
            Held("fz-c", NS2, range(0, 4), "127.0.0.1:7003"))
# Chains located by each snapshot; the requester's own copies come first, so the answer is
# deterministic (otherwise the index spreads reads over holders).
CHAINS = ((NS, [h(i) for i in range(13)], "fz-a"), (NS2, [h(i) for i in range(5)], "fz-c"))


@dataclass(frozen=True)
class Snapshot:
    index: tuple                  # Stats: nodes, blocks, copies, per namespace
    published_blocks: int
    queries: tuple[int, int, int]  # queries, query_blocks, query_hit_blocks
    nodes: tuple                  # (node id, lease, draining, blocks, namespace, address, capacity)
    chains: tuple                 # located chains: (node, offset, size, generation) per block

    def state(self) -> tuple:
        return self.index, self.nodes, self.chains

    def copies(self) -> int:
        return self.index[2]

    def blocks_of(self, node_id: str) -> int:
        return next((n[3] for n in self.nodes if n[0] == node_id), 0)

    def lease_of(self, node_id: str) -> int:
        return next((n[1] for n in self.nodes if n[0] == node_id), 0)


class Pool:
    """The module's metaserver, a client of it, and its known baseline."""

    def __init__(self, server: MetaserverProcess) -> None:
        self.server = server
        self.client = MetaClient(server.address, timeout_s=10)
        self.channel = grpc.insecure_channel(server.address)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._baseline: tuple | None = None

    def close(self) -> None:
        self.channel.close()
        self.client.close()

    def snapshot(self) -> Snapshot:
        s = self.client.stats()
        nodes = tuple(sorted((n.node_id, n.lease_id, n.draining, k, n.namespace, n.session_address, n.capacity_bytes)
                             for n, k in self.client.list_nodes()))
        chains = tuple(self._locate(ns, chain, requester) for ns, chain, requester in CHAINS)
        i = s.index
        return Snapshot((i.num_nodes, i.num_blocks, i.num_copies, i.namespaces), s.published_blocks,
                        (s.queries, s.query_blocks, s.query_hit_blocks), nodes, chains)

    def _locate(self, namespace: str, chain: list[BlockHash], requester: str) -> tuple | str:
        try:
            locations = self.client.query_prefix(namespace, chain, requester).locations
        except NotFound:
            return "unknown namespace"  # no node of it is registered
        return tuple((loc.node_id, loc.offset, loc.size_bytes, loc.generation) for loc in locations)

    def _baseline_state(self, snap: Snapshot) -> tuple:
        """The state without lease ids (a restored baseline has new leases)."""
        return snap.index, tuple(n[:1] + n[2:] for n in snap.nodes), snap.chains

    def settle(self, timeout_s: float = 10.0) -> Snapshot:
        """Wait until etcd has every change and the replica's watch has replayed its own
        writes: the state is unchanged over three polls (the watch lags by milliseconds)."""
        deadline = time.monotonic() + timeout_s
        seen: list[tuple] = []
        while time.monotonic() < deadline:
            if self.client.stats().pending_writes == 0:
                snap = self.snapshot()
                seen.append(snap.state())
                if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]:
                    return snap
            time.sleep(0.025)
        pytest.fail("the metaserver did not settle")

    def restore(self) -> Snapshot:
        """Bring the index back to the baseline if it is not there; returns a snapshot."""
        snap = self.snapshot()
        if self._baseline is not None and self._baseline_state(snap) == self._baseline:
            return snap
        c = self.client
        c.invalidate(all=True)
        wanted = {held.node_id: held for held in BASELINE}
        for node, _ in c.list_nodes():
            if node.node_id not in wanted:
                c.unregister_node(node.node_id, node.lease_id)
        current = {n[0]: n for n in snap.nodes}
        for held in BASELINE:
            n = current.get(held.node_id)
            if n is None or n[2] or n[4:] != (held.namespace, held.address, CAP):
                c.register_node(held.node_id, held.address, 0x7F0000000000, CAP, held.namespace, 600)
            else:
                c.keepalive(held.node_id, n[1])  # a node reported unreadable is offered again
            c.publish(held.node_id, [BlockRecord(h(i), i * BLOCK, BLOCK, 1) for i in held.ids])
        snap = self.settle()
        if self._baseline is None:
            self._baseline = self._baseline_state(snap)
        assert self._baseline_state(snap) == self._baseline
        return snap

    def raw(self, method: str, payload: bytes) -> tuple[grpc.StatusCode, str, bytes]:
        path = f"/{SERVICE.full_name}/{method}"
        try:
            if method in STREAMS:  # the first message of the stream (a snapshot's), then cancel
                stream = self.channel.unary_stream(path)(payload, timeout=10)
                first = next(stream)
                stream.cancel()
                return grpc.StatusCode.OK, "", first
            return grpc.StatusCode.OK, "", self.channel.unary_unary(path)(payload, timeout=10)  # bytes in, bytes out
        except grpc.RpcError as err:
            return err.code(), err.details() or "", b""

    def check(self, method: str, payload: bytes) -> None:
        """Send `payload` as `method`'s request and check every property."""
        before = self.restore()
        code, details, answer = self.raw(method, payload)
        event(code.name)
        status = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        if code != grpc.StatusCode.OK:
            assert code in EXPECTED_ERRORS, f"{method}: {code.name}: {details}"
            assert details.strip() and not details.startswith(("Stream removed", "Exception")), (code, details)
            after = self.snapshot()
            assert after.state() == before.state(), f"{method} was rejected ({code.name}: {details}), yet changed"
            assert after.published_blocks == before.published_blocks
            assert after.queries[0] == before.queries[0] + len(CHAINS)  # only the snapshot's own queries
            return
        request = REQUEST[method].FromString(payload)  # the server parsed it, so must we
        self.accepted(method, request, RESPONSE[method].FromString(answer), before)

    def accepted(self, method: str, request: Message, response: Message, before: Snapshot) -> None:
        """An accepted change reports what it did; fuzz-registered nodes are removed again."""
        after = self.snapshot()
        removed = before.copies() - after.copies()
        if method in ("Invalidate", "Drain", "Unpublish"):
            assert response.num_removed == removed, (method, request, response)
        elif method == "ReportFailedRead":
            assert response.num_removed == removed, (method, request, response)
            assert response.source_suspect == (not request.block_hashes)
            offered = {loc[0] for chain in after.chains if isinstance(chain, tuple) for loc in chain}
            assert not response.source_suspect or request.source_node_id not in offered
        elif method == "UnregisterNode":
            assert response.num_blocks_removed == before.blocks_of(request.node_id) == removed
        elif method == "Publish":
            assert response.num_published == len(request.blocks) >= -removed >= 0
        elif method == "RegisterNode":
            assert after.lease_of(request.node_id) == response.lease_id
            assert response.session_token and 1 <= response.lease_ttl_s <= 3600
            if request.node_id not in {held.node_id for held in BASELINE}:
                self.client.unregister_node(request.node_id, response.lease_id)
        elif method in ("QueryPrefix", "QueryPrefixBatch", "Stats", "ListNodes", "KeepAlive", "WatchIndex"):
            assert after.state() == before.state(), f"{method} changed the index"
        if method == "WatchIndex":  # a snapshot of the namespace starts the stream
            assert response.reset and response.epoch, response


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with EtcdProcess(tmp / "etcd") as etcd, MetaserverProcess(etcd.endpoint, tmp / "metaserver.log",
                                                              extra_args=("--lease-ttl", "600")) as server:
        p = Pool(server)
        p.restore()
        yield p
        p.close()
        log = server.log_path.read_text()
    assert "Traceback" not in log and "Exception calling application" not in log, log[-4000:]


# ---- strategies ------------------------------------------------------------------------

KNOWN = [h(i) for i in range(13)]
I64 = st.one_of(st.sampled_from([0, 1, -1, BLOCK, CAP - BLOCK, CAP, 2**31 - 1, -2**31, 2**63 - 1, -2**63]),
                st.integers(-2**63, 2**63 - 1))
U64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
I32 = st.one_of(st.sampled_from([0, 1, -1, 10, 3600, 3601, 2**31 - 1, -2**31]), st.integers(-2**31, 2**31 - 1))
TEXT = st.one_of(st.text(max_size=20), st.text(st.characters(codec="utf-8"), min_size=200, max_size=400))
# Known values get a branch of their own, so that a good share of requests gets past validation.
NODE_ID = st.one_of(st.sampled_from(["fz-a", "fz-b", "fz-c"]),
                    st.sampled_from(["ghost", "", "a/b", "x" * 256, "x" * 257, "ünï-🙂", "tab\tid", "nul\x00",
                                     "\u2028", " ", "fz-a\n"]), TEXT)
NAMESPACE = st.one_of(st.sampled_from([NS, NS2]), st.sampled_from(["", "no-such-ns", "n" * 257, "x" * 20000]), TEXT)
HASH = st.one_of(st.sampled_from(KNOWN), st.binary(min_size=32, max_size=32), st.binary(max_size=70),
                 st.just(100_000).map(lambda n: b"\xff" * n))
# Lists past the limits (16384 per query, 65536 per invalidate), built lazily: small reprs.
GOOD_HASH = st.one_of(st.sampled_from(KNOWN), st.binary(min_size=32, max_size=32))
HASHES = st.one_of(st.lists(HASH, max_size=12), st.lists(GOOD_HASH, min_size=1, max_size=30),
                   st.sampled_from([0, 16_385, 65_537]).map(lambda n: [h(i) for i in range(n)]))
GOOD_RECORD = st.builds(pb.BlockRecord, block_hash=GOOD_HASH, offset=st.sampled_from([0, BLOCK, CAP - 64, CAP - BLOCK]),
                        size_bytes=st.sampled_from([64, BLOCK]), generation=U64)
RECORD = st.one_of(st.builds(pb.BlockRecord, block_hash=HASH, offset=I64, size_bytes=I64, generation=U64), GOOD_RECORD)
OVERSIZED_PUBLISH = st.just(8_193).map(  # the limit is 8192 records
    lambda n: [pb.BlockRecord(block_hash=h(i), offset=0, size_bytes=64) for i in range(n)])
ADDRESS = st.one_of(st.sampled_from(["127.0.0.1:7000", "h:1", "nowhere", "", ":", "x:" * 200]), TEXT)


@st.composite
def invalidate_requests(draw: st.DrawFn) -> pb.InvalidateRequest:
    req = pb.InvalidateRequest(namespace=draw(NAMESPACE))
    target = draw(st.sampled_from(["none", "hashes", "node_id", "by_namespace", "all"]))
    if target == "hashes":
        req.hashes.SetInParent()
        req.hashes.block_hashes.extend(draw(HASHES))
    elif target == "node_id":
        req.node_id = draw(NODE_ID)
    elif target in ("by_namespace", "all"):
        setattr(req, target, draw(st.booleans()))
    return req


MESSAGES: dict[str, st.SearchStrategy[Message]] = {
    "RegisterNode": st.builds(pb.RegisterNodeRequest, node_id=NODE_ID, session_address=ADDRESS, buffer_address=U64,
                              capacity_bytes=st.one_of(st.just(CAP), I64), layout_fingerprint=NAMESPACE,
                              lease_ttl_s=I32),
    "KeepAlive": st.builds(pb.KeepAliveRequest, node_id=NODE_ID, lease_id=I64),
    "UnregisterNode": st.builds(pb.UnregisterNodeRequest, node_id=NODE_ID, lease_id=I64),
    "Publish": st.builds(pb.PublishRequest, node_id=NODE_ID,
                         blocks=st.one_of(st.lists(RECORD, max_size=8), st.lists(GOOD_RECORD, min_size=1, max_size=8),
                                          OVERSIZED_PUBLISH)),
    "Unpublish": st.builds(pb.UnpublishRequest, node_id=NODE_ID, block_hashes=HASHES),
    "QueryPrefix": st.builds(pb.QueryPrefixRequest, namespace=NAMESPACE, block_hashes=HASHES,
                             requester_node_id=NODE_ID),
    "QueryPrefixBatch": st.builds(pb.QueryPrefixBatchRequest, queries=st.lists(
        st.builds(pb.QueryPrefixRequest, namespace=NAMESPACE, block_hashes=HASHES, requester_node_id=NODE_ID),
        max_size=4)),
    "ReportFailedRead": st.builds(pb.ReportFailedReadRequest, reporter_node_id=NODE_ID,
                                  source_node_id=NODE_ID,
                                  block_hashes=HASHES),
    "WatchIndex": st.builds(pb.WatchIndexRequest, namespace=NAMESPACE, epoch=st.one_of(st.just(""), st.text(max_size=20)),
                            after_seq=U64, watcher_node_id=NODE_ID),
    "Invalidate": invalidate_requests(),
    "Drain": st.builds(pb.DrainRequest, node_id=NODE_ID),
    "Undrain": st.builds(pb.UndrainRequest, node_id=NODE_ID),
    "Stats": st.just(pb.StatsRequest()),
    "ListNodes": st.just(pb.ListNodesRequest()),
}
assert set(MESSAGES) == set(METHODS)


@st.composite
def mutated(draw: st.DrawFn, method: str) -> bytes:
    """A valid small request of `method` with a few bytes flipped, cut or appended."""
    data = bytearray(draw(MESSAGES[method].filter(lambda m: m.ByteSize() < 4096)).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "append"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif op == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        else:
            data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


# ---- the properties ----------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
def test_random_bytes_as_request(pool: Pool, method: str, data: st.DataObject) -> None:
    payload = data.draw(st.one_of(st.binary(max_size=300), mutated(method)), label="payload")
    pool.check(method, payload)


@pytest.mark.parametrize("method", METHODS)
@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_structured_requests_with_wild_values(pool: Pool, method: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGES[method], label="request")
    if method in ("KeepAlive", "UnregisterNode") and data.draw(st.booleans(), label="node's own lease"):
        message.lease_id = pool.snapshot().lease_of(message.node_id)  # reach past the lease check
    pool.check(method, message.SerializeToString())
