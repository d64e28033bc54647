"""Blocking client of the metadata service, and a node's registration session.

Where it sits: used by `kvpool` (node lifecycle, publish), by the connector (QueryPrefix)
and by `kvpool admin`. Every call has a deadline; a failed call raises the typed
`metaserver.errors` exception for its status. With several endpoints, a call that finds
its replica unreachable moves on to the next one.

Security (`ClientSecurity`): TLS (optionally with a client certificate) and a bearer token
sent with every call. The client keeps the session token each RegisterNode returns and
sends it (`kvpool-node-session` metadata) with that node's later calls, so a node token
can act for the nodes this client registered (see `metaserver.auth`).

Thread safety: MetaClient may be shared by threads (gRPC channels are thread-safe).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from kvpool_proto.kvpool.v1 import meta_pb2_grpc as pb_grpc
from metaserver.auth import SESSION_KEY
from metaserver.credentials import ClientSecurity
from metaserver.errors import MetaError, NotFound, Unavailable, from_rpc_error
from metaserver.store import node_from_pb, record_to_pb
from metaserver.types import (BlockHash, BlockLocation, BlockRecord, IndexStats, Medium, Namespace, NamespaceStats,
                              NodeRecord, QueryResult)

log = logging.getLogger(__name__)
T = TypeVar("T")

_FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# A local subchannel pool: a channel must not inherit another channel's reconnect backoff to
# the same address. Backoff between connection attempts: 100 ms, growing to 1 s.
_CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.use_local_subchannel_pool", 1)]
# A replica's channel is replaced by a fresh one at most this often (see _Replica.reset).
_RESET_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class ServerStats:
    index: IndexStats
    queries: int
    query_blocks: int
    query_hit_blocks: int
    published_blocks: int
    etcd_healthy: bool
    pending_writes: int
    replica_id: str


@dataclass(frozen=True, slots=True)
class Registration:
    lease_id: int
    lease_ttl_s: int
    session_token: str = field(default="", repr=False)  # proof of this registration; secret


def _query_result(hashes: Sequence[bytes], resp: pb.QueryPrefixResponse, sparse: bool) -> QueryResult:
    """The domain answer. A sparse query's blocks are placed by `chain_index`; a server that
    predates `sparse` answers the prefix only (no chain_index), which then stands as a sparse
    answer that knows nothing past the first gap."""
    nodes = [node_from_pb(n) for n in resp.nodes]
    index = resp.chain_index or range(len(resp.node_index))
    media = resp.media or [0] * len(resp.node_index)  # empty: all DRAM
    located = [BlockLocation(BlockHash(hashes[i]), nodes[k].node_id, off, size, gen, Medium(m))
               for i, k, off, size, gen, m in zip(index, resp.node_index, resp.offsets, resp.sizes_bytes,
                                                  resp.generations, media, strict=True)]
    by_node = {n.node_id: n for n in nodes}
    if not sparse or not located:
        return QueryResult(tuple(located), by_node)
    held: list[BlockLocation | None] = [None] * (index[-1] + 1)
    for i, loc in zip(index, located):
        held[i] = loc
    return QueryResult(tuple(located[:resp.num_matched]), by_node, tuple(held))


def _backing_off(ch: grpc.Channel) -> bool:
    """Whether `ch` waits out a reconnect backoff (TRANSIENT_FAILURE), read without a watch
    thread: grpc's Python API only offers `subscribe`, whose polling thread per channel raised
    at a short-lived CLI's exit. True where the state cannot be read (a fresh channel is the
    safe answer)."""
    try:
        from grpc import _common

        state = _common.CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY[
            ch._channel.check_connectivity_state(False)]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - another channel class, another grpcio: replace it
        return True
    return state is grpc.ChannelConnectivity.TRANSIENT_FAILURE


class _Replica:
    """One endpoint's channel. A channel whose connection failed waits out its reconnect
    backoff (up to a second) before it tries again, and until then fails every call at once,
    also after the replica is back: a node's first lookup after a metaserver restart failed
    so, although every replica was serving. gRPC's remedy (grpc_channel_reset_connect_backoff)
    is not in its Python API, so a call that fails UNAVAILABLE or past its deadline on a
    channel in TRANSIENT_FAILURE (`_backing_off`) replaces the channel by a fresh one (which
    connects at once) and is tried again on it. While the
    replica is really down the fresh channel's connection is refused at once, so calls still
    fail fast; replacements are at most one per _RESET_INTERVAL_S. A replaced channel is
    closed when the last call on it returns. (No connectivity watch: `Channel.subscribe`
    runs a polling thread per channel, which could raise at a short-lived CLI's exit.)"""

    def __init__(self, endpoint: str, security: ClientSecurity) -> None:
        self.endpoint = endpoint
        self._security = security
        self._lock = threading.Lock()
        self._calls: dict[grpc.Channel, int] = {}  # calls in flight per channel (current or replaced)
        self._closed = False
        self._open()

    def _open(self) -> None:
        """A fresh channel becomes current (under the lock, or in __init__)."""
        ch = self._security.channel(self.endpoint, _CHANNEL_OPTIONS)
        self.channel, self.stub, self._opened = ch, pb_grpc.MetaServiceStub(ch), time.monotonic()

    def acquire(self) -> tuple[grpc.Channel, pb_grpc.MetaServiceStub]:
        """The current channel and its stub for one call; `release` the channel after it."""
        with self._lock:
            ch = self.channel
            self._calls[ch] = self._calls.get(ch, 0) + 1
            return ch, self.stub

    def release(self, ch: grpc.Channel) -> None:
        with self._lock:
            left = self._calls[ch] - 1
            if left:
                self._calls[ch] = left
                return
            del self._calls[ch]
            if ch is self.channel and not self._closed:
                return
        ch.close()  # replaced, and no call on it any more

    def reset(self, ch: grpc.Channel) -> bool:
        """After a call on `ch` failed UNAVAILABLE or past its deadline: whether to try again on
        a fresh channel (`ch` may be waiting out a reconnect backoff; or it was already
        replaced meanwhile)."""
        with self._lock:
            if self._closed:
                return False
            if ch is not self.channel:
                return True
            if time.monotonic() - self._opened < _RESET_INTERVAL_S or not _backing_off(ch):
                return False
            self._open()  # `ch` is closed by the release of its last call (the caller's)
        log.debug("metaserver client: a call to %s failed; connecting afresh", self.endpoint)
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = self.channel not in self._calls
        if idle:
            self.channel.close()


class MetaClient:
    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 5.0,
                 security: ClientSecurity | None = None) -> None:
        """Channels are opened now (TLS files are read now: ValueError if unreadable)."""
        eps = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        self.endpoints = [e.strip() for e in eps if e.strip()]
        if not self.endpoints:
            raise ValueError("no metaserver endpoint given (HOST:PORT[,HOST:PORT])")
        self.timeout_s = timeout_s
        self.security = security or ClientSecurity()
        self._replicas = [_Replica(ep, self.security) for ep in self.endpoints]
        self._metadata = self.security.call_metadata()
        self._current = 0
        # Times a call moved to another replica: the one left may have died with acknowledged
        # changes not yet in etcd (`NodeSession` re-publishes after one).
        self.failovers = 0
        self._lock = threading.Lock()
        self._sessions: dict[str, str] = {}  # node id -> session token of its registration

    def close(self) -> None:
        for r in self._replicas:
            r.close()

    def __enter__(self) -> MetaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rpc(self, method: str, request: object, timeout_s: float | None = None,
             node_id: str | None = None) -> T:  # type: ignore[type-var]
        """Call `method` within one deadline. A replica that is unreachable is skipped for the
        next endpoint; when none answers, rounds repeat (briefly spaced) until the deadline.
        A replica whose channel was waiting out its reconnect backoff is tried again at once on
        a fresh channel (`_Replica`). With `node_id`, the session token of that node's
        registration goes along."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        with self._lock:
            start = self._current
            session = self._sessions.get(node_id, "") if node_id is not None else ""
        metadata = (*self._metadata, (SESSION_KEY, session)) if session else self._metadata
        last: grpc.RpcError | None = None
        n = len(self._replicas)
        while True:
            for i in range(n):
                idx = (start + i) % n
                replica = self._replicas[idx]
                for fresh in (False, True):  # once more on a fresh channel if it was backing off
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    ch, stub = replica.acquire()
                    try:
                        resp = getattr(stub, method)(request, timeout=remaining, metadata=metadata)
                    except grpc.RpcError as err:
                        if err.code() not in _FAILOVER_CODES:
                            raise from_rpc_error(err) from None
                        last = err
                        if not fresh and replica.reset(ch):
                            continue
                        break
                    finally:
                        replica.release(ch)
                    if idx != start:
                        with self._lock:
                            self._current = idx
                            self.failovers += 1
                        log.info("metaserver client: now using %s", self.endpoints[idx])
                    return resp
            if time.monotonic() + 0.05 >= deadline:
                break
            time.sleep(0.05)
        details = last.details() if last is not None else "deadline exceeded"
        raise Unavailable(f"no metaserver reachable at {','.join(self.endpoints)}: {details}")

    # ---- node lifecycle -------------------------------------------------------------

    def register_node(self, node_id: str, session_address: str, buffer_address: int, capacity_bytes: int,
                      layout_fingerprint: str, lease_ttl_s: int = 0, api_url: str = "",
                      stage_address: str = "") -> Registration:
        """Register (or replace this client's registration of) `node_id`; its new session
        token is kept for the node's later calls. `api_url`: the node's engine API, announced
        to routers (`kvpool router --discover`)."""
        resp = self._rpc("RegisterNode", pb.RegisterNodeRequest(
            node_id=node_id, session_address=session_address, buffer_address=buffer_address,
            capacity_bytes=capacity_bytes, layout_fingerprint=layout_fingerprint, lease_ttl_s=lease_ttl_s,
            api_url=api_url, stage_address=stage_address),
            node_id=node_id)
        with self._lock:
            self._sessions[node_id] = resp.session_token
        return Registration(resp.lease_id, resp.lease_ttl_s, resp.session_token)

    def keepalive(self, node_id: str, lease_id: int) -> int:
        return self._rpc("KeepAlive", pb.KeepAliveRequest(node_id=node_id, lease_id=lease_id),
                         node_id=node_id).lease_ttl_s

    def unregister_node(self, node_id: str, lease_id: int) -> int:
        n = self._rpc("UnregisterNode", pb.UnregisterNodeRequest(node_id=node_id, lease_id=lease_id),
                      node_id=node_id).num_blocks_removed
        with self._lock:
            self._sessions.pop(node_id, None)
        return n

    # ---- blocks ---------------------------------------------------------------------

    def publish(self, node_id: str, records: Sequence[BlockRecord]) -> int:
        msg = pb.PublishRequest(node_id=node_id, blocks=[record_to_pb(r) for r in records])
        return self._rpc("Publish", msg, node_id=node_id).num_published

    def unpublish(self, node_id: str, hashes: Sequence[bytes]) -> int:
        return self._rpc("Unpublish", pb.UnpublishRequest(node_id=node_id, block_hashes=list(hashes)),
                         node_id=node_id).num_removed

    def query_prefix(self, namespace: str, hashes: Sequence[bytes], requester_node_id: str = "",
                     timeout_s: float | None = None, sparse: bool = False) -> QueryResult:
        """The longest present prefix of the chain `hashes`; with `sparse`, also every other
        block of it the index holds (`QueryResult.held`, `QueryResult.run_from`)."""
        resp = self._rpc("QueryPrefix", pb.QueryPrefixRequest(
            namespace=namespace, block_hashes=list(hashes), requester_node_id=requester_node_id, sparse=sparse),
            timeout_s)
        return _query_result(hashes, resp, sparse)

    def query_prefix_batch(self, queries: Sequence[tuple[str, Sequence[bytes]]], requester_node_id: str = "",
                           timeout_s: float | None = None, sparse: bool = False) -> list[QueryResult]:
        """Many lookups in one RPC: (namespace, chain) each; result i answers query i as
        `query_prefix` would."""
        resp = self._rpc("QueryPrefixBatch", pb.QueryPrefixBatchRequest(queries=[
            pb.QueryPrefixRequest(namespace=ns, block_hashes=list(chain), requester_node_id=requester_node_id,
                                  sparse=sparse)
            for ns, chain in queries]), timeout_s)
        return [_query_result(chain, r, sparse) for (_, chain), r in zip(queries, resp.results, strict=True)]

    def report_failed_read(self, source_node_id: str, block_hashes: Sequence[bytes] = (),
                           reporter_node_id: str = "", timeout_s: float | None = None) -> tuple[int, bool]:
        """Tell the metaserver a read from the source failed (no hashes: the whole node did not
        answer); returns (copies dropped, source now suspect)."""
        resp = self._rpc("ReportFailedRead", pb.ReportFailedReadRequest(
            reporter_node_id=reporter_node_id, source_node_id=source_node_id, block_hashes=list(block_hashes)),
            timeout_s)
        return resp.num_removed, resp.source_suspect

    def watch_index(self, namespace: str, epoch: str = "", after_seq: int = 0, watcher_node_id: str = "",
                    replica: int = 0) -> grpc.Future:
        """Open a WatchIndex stream from endpoint `replica` (modulo their number): iterate it
        for `pb.IndexEvent`s, `.cancel()` it to stop; iterating raises grpc.RpcError when the
        stream breaks (metaserver.view resumes it)."""
        stub = self._replicas[replica % len(self._replicas)].stub
        return stub.WatchIndex(pb.WatchIndexRequest(namespace=namespace, epoch=epoch, after_seq=after_seq,
                                                    watcher_node_id=watcher_node_id), metadata=self._metadata)

    def invalidate(self, *, namespace: str = "", hashes: Sequence[bytes] | None = None, node_id: str = "",
                   by_namespace: bool = False, all: bool = False) -> int:  # noqa: A002 - mirrors the proto
        req = pb.InvalidateRequest(namespace=namespace)
        if hashes is not None:
            req.hashes.block_hashes.extend(hashes)
        elif node_id:
            req.node_id = node_id
        elif by_namespace:
            req.by_namespace = True
        elif all:
            req.all = True
        return self._rpc("Invalidate", req).num_removed

    def drain(self, node_id: str) -> int:
        """Stop offering the node as a source and refuse its publishes; returns the blocks
        removed from the index. NotFound for an unknown node id."""
        return self._rpc("Drain", pb.DrainRequest(node_id=node_id)).num_removed

    def undrain(self, node_id: str) -> bool:
        """Undo `drain`; returns whether the node was draining. NotFound for an unknown node id."""
        return self._rpc("Undrain", pb.UndrainRequest(node_id=node_id)).was_draining

    # ---- introspection --------------------------------------------------------------

    def stats(self) -> ServerStats:
        r = self._rpc("Stats", pb.StatsRequest())
        ns = tuple(NamespaceStats(Namespace(n.namespace), n.num_blocks, n.num_copies, n.num_disk_copies,
                                  n.dram_bytes, n.disk_bytes)
                   for n in r.namespaces)
        return ServerStats(IndexStats(r.num_nodes, r.num_blocks, r.num_copies, ns), r.queries, r.query_blocks,
                           r.query_hit_blocks, r.published_blocks, r.etcd_healthy, r.pending_writes, r.replica_id)

    def list_nodes(self) -> list[tuple[NodeRecord, int]]:
        return [(node_from_pb(n), n.num_blocks) for n in self._rpc("ListNodes", pb.ListNodesRequest()).nodes]


class NodeSession:
    """Keeps one node registered: register, keep the lease alive, and after the lease was
    lost (metaserver restart, partition, etcd outage) register again and re-publish.

    `holdings()` must return every block the node holds right now; it is called from the
    keepalive thread after each re-registration, and after the first successful keepalive
    that follows a failed one or a failed publish (`resync()`): the lease may have outlived
    an outage in which publishes were lost, or a metaserver crash lost acknowledged changes.
    A failover to another replica (`MetaClient.failovers` moved) counts as such a crash: the
    lease lives on in etcd, so no call fails, but the replica left behind may have died with
    acknowledged changes still queued for etcd.
    Nodes are the source of truth for what they hold, so this is what makes the index
    converge.
    """

    def __init__(self, client: MetaClient, node_id: str, session_address: str, buffer_address: int,
                 capacity_bytes: int, layout_fingerprint: str, holdings: Callable[[], Sequence[BlockRecord]],
                 lease_ttl_s: int = 10, publish_batch: int = 4096, api_url: str = "",
                 stage_address: str = "", on_published: Callable[[int], None] = lambda n: None,
                 before_publishing: Callable[[], None] = lambda: None) -> None:
        """`on_published(n)`: n records of the holdings were (re-)published, acknowledged.
        `before_publishing()`: called before every re-publication of the holdings (the node
        sends what it failed to unpublish meanwhile; a MetaError it raises is a failed resync)."""
        self.client = client
        self._on_published = on_published
        self._before_publishing = before_publishing
        self.node_id = node_id
        self._args = (node_id, session_address, buffer_address, capacity_bytes, layout_fingerprint, lease_ttl_s,
                      api_url, stage_address)
        self._holdings = holdings
        self._publish_batch = publish_batch
        self.registration: Registration | None = None
        self.registrations = 0  # how many times this session (re-)registered
        self._stop = threading.Event()
        self._resync = threading.Event()
        self._failovers = client.failovers  # the client's count at the last (re-)publish of everything
        self._thread: threading.Thread | None = None

    def resync(self) -> None:
        """Re-publish every holding after the next successful keepalive (thread-safe)."""
        self._resync.set()

    def start(self) -> None:
        """Register now (raises on failure), then keep alive from a daemon thread."""
        self._register()
        self._thread = threading.Thread(target=self._run, name=f"keepalive-{self.node_id}", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        self.registration = self.client.register_node(*self._args)
        self.registrations += 1
        self._resync.clear()
        self._failovers = self.client.failovers
        n = self._publish_holdings()
        log.info("node %s registered (lease %x), re-published %d blocks", self.node_id,
                 self.registration.lease_id, n)

    def _publish_holdings(self) -> int:
        self._before_publishing()
        records = list(self._holdings())
        for i in range(0, len(records), self._publish_batch):
            self._on_published(self.client.publish(self.node_id, records[i:i + self._publish_batch]))
        return len(records)

    def _run(self) -> None:
        assert self.registration is not None
        interval = max(self.registration.lease_ttl_s / 3, 0.2)
        while not self._stop.wait(interval):
            try:
                assert self.registration is not None
                self.client.keepalive(self.node_id, self.registration.lease_id)
                if self.client.failovers != self._failovers:  # see the class doc
                    self._failovers = self.client.failovers
                    self._resync.set()
                if self._resync.is_set():
                    self._resync.clear()
                    log.info("node %s: re-published %d blocks after an outage", self.node_id,
                             self._publish_holdings())
            except NotFound:
                log.warning("node %s: lease lost; registering again", self.node_id)
                self._try_register()
            except MetaError as err:
                self._resync.set()
                log.warning("node %s: keepalive or re-publish failed: %s", self.node_id, err)

    def _try_register(self) -> None:
        try:
            self._register()
        except MetaError as err:
            log.warning("node %s: re-registration failed (%s); will retry", self.node_id, err)

    def stop(self, unregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if unregister and self.registration is not None:
            try:
                self.client.unregister_node(self.node_id, self.registration.lease_id)
            except MetaError as err:
                log.warning("node %s: unregister failed: %s", self.node_id, err)
