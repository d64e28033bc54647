"""The metadata service's domain logic: validate, change the index, queue the etcd change.

Where it sits: called by the thin gRPC servicer (`metaserver.servicer`); owns the in-memory
`BlockIndex` and the `DurableStore`, and applies the etcd watch so that replicas converge.
Every method validates its whole input before changing anything, so a rejected request
changes nothing. Errors are `metaserver.errors` types.

Node identity: each registration gets a random session token (returned to the node, its
SHA-256 kept in the node record and in etcd). Methods acting for a node take `proof`: None
when no proof is required (the server checks no tokens, or an admin calls), otherwise the
session token the caller sent, which must match the node's (see `metaserver.auth`).

Threading: the async methods and the etcd watch run on the server's event loop thread;
the plain methods are called from gRPC handler threads. Every access to the index and the
write queue holds `self.lock` (the plain public methods take it themselves), and no lock is
held across an await.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar, cast

from metaserver.auth import new_session_token, session_digest, session_matches
from metaserver.compactor import HistoryCompactor
from metaserver.config import MetaServerConfig
from metaserver.errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
                               Unavailable)
from metaserver.etcd import EtcdClient, EtcdError, EtcdUnavailable, LeaseNotFound, WatchCompacted
from metaserver.feed import IndexFeed
from metaserver.index import BlockIndex
from metaserver.store import Change, DurableStore, Snapshot
from metaserver.types import (BlockHash, BlockLocation, BlockRecord, IndexStats, Medium, Namespace, NodeId, NodeRecord,
                              QueryResult)

log = logging.getLogger(__name__)

_MAX_ID_LEN = 256
_API_URL = re.compile(r"https?://(?:\[[0-9a-fA-F:.]+\]|[^/\s:\[\]]+):[0-9]{1,5}/?")  # a node's API: scheme, host and port
_MAX_SHOWN = 64  # characters of a rejected value repeated in an error message
P = ParamSpec("P")
R = TypeVar("R")


def _show(value: str) -> str:
    """`value` for an error message, cut short: a status message travels in a gRPC trailer,
    which the client refuses beyond 16 KiB (it would see RESOURCE_EXHAUSTED, not our message)."""
    if len(value) <= _MAX_SHOWN:
        return repr(value)
    return f"{value[:_MAX_SHOWN]!r}... ({len(value)} characters)"


def _locked(notify: bool) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the method holding `self.lock`; with `notify`, wake the etcd flusher afterwards."""

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            self = args[0]
            with self.lock:  # type: ignore[attr-defined]
                result = method(*args, **kwargs)
            if notify:
                self.store.notify()  # type: ignore[attr-defined]
            return result

        return wrapper

    return decorate


reader = _locked(notify=False)
writer = _locked(notify=True)


MAX_BATCH_QUERIES = 1024  # lookups in one QueryPrefixBatch (each still bounded by max_query_hashes)


@dataclass
class Counters:
    queries: int = 0
    query_blocks: int = 0
    query_hit_blocks: int = 0
    published_blocks: int = 0


class MetaService:
    def __init__(self, config: MetaServerConfig, etcd: EtcdClient) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.feed = IndexFeed()
        self.index = BlockIndex(self.feed)
        self.store = DurableStore(config, etcd, self.lock, on_lease_lost=self._lease_lost)
        self.counters = Counters()
        self._watch_task: asyncio.Task[None] | None = None
        self.compactor = HistoryCompactor(etcd, config.etcd_compact_interval_s, config.etcd_compact_keep)
        # False until start() has rebuilt the index from etcd: the server takes RPCs from the
        # moment it listens, and an index read before then would answer from an empty index
        # (a watcher's view would even call that snapshot current).
        self.loaded = False

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild the index from etcd, then follow etcd's changes. Raises EtcdUnavailable."""
        snap = await self.store.load()
        with self.lock:
            self._rebuild(snap)
            self.loaded = True
        self.store.start()
        self._watch_task = asyncio.create_task(self._follow(snap.revision + 1), name="etcd-watch")
        self.compactor.start()
        log.info("index loaded from etcd at revision %d: %d nodes, %d block copies",
                 snap.revision, len(snap.nodes), len(snap.blocks))

    async def stop(self) -> None:
        """Write the queue through (bounded by shutdown_flush_s), then stop background tasks."""
        if not await self.store.flush(self.config.shutdown_flush_s):
            log.warning("shutdown: %d changes not written to etcd", self.store.pending_writes)
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        await self.compactor.stop()
        await self.store.stop()

    def _rebuild(self, snap: Snapshot) -> None:
        self.index = BlockIndex()
        for node in snap.nodes:
            self.index.upsert_node(node)
        for node_id, rec, lease in snap.blocks:
            if self._current_lease(node_id, lease):
                self.index.add_block(node_id, rec)
        # A new incarnation: watchers take a new snapshot (not a million replayed changes).
        self.index.feed = self.feed
        self.feed.restart()

    def _current_lease(self, node_id: NodeId, lease: int) -> bool:
        """True if `lease` is the lease of the node's current registration. Watch events of
        an older registration (revoked on re-register) arrive late and must not touch the new one."""
        node = self.index.nodes.get(node_id)
        return node is not None and node.lease_id == lease

    async def _follow(self, revision: int) -> None:
        while True:
            try:
                async for changes in self.store.watch(revision):
                    with self.lock:
                        for change, key in changes:
                            if not self.store.has_pending(key):
                                self._apply(change)
                return
            except WatchCompacted:
                log.warning("etcd history compacted; reloading the index")
            except EtcdError as err:
                log.warning("etcd watch failed (%s); reloading the index", err)
            while True:
                try:
                    snap = await self.store.load()
                    break
                except EtcdUnavailable:
                    self.store.report_unreachable()
                    await asyncio.sleep(self.config.etcd_retry_s)
            with self.lock:
                self._rebuild(snap)
            revision = snap.revision + 1

    def _apply(self, change: Change) -> None:
        if change.block_hash is None:
            if change.is_put:
                assert change.node is not None
                self.index.upsert_node(change.node)
            elif self._current_lease(change.node_id, change.lease):
                self.index.remove_node(change.node_id)
        elif not self._current_lease(change.node_id, change.lease):
            return
        elif change.is_put:
            assert change.block is not None
            self.index.add_block(change.node_id, change.block)
        else:
            self.index.remove_block(change.node_id, change.block_hash)

    def _lease_lost(self, lease_id: int) -> None:
        """Drop the node(s) of an expired lease. Caller holds the lock."""
        for node in [n for n in self.index.nodes.values() if n.lease_id == lease_id]:
            log.info("node %s: lease expired; dropping it and its blocks", node.node_id)
            self.index.remove_node(node.node_id)

    # ---- validation -----------------------------------------------------------------

    def _check_id(self, what: str, value: str) -> None:
        if not value:
            raise InvalidArgument(f"{what} is required")
        if len(value) > _MAX_ID_LEN or "/" in value or not value.isprintable():
            raise InvalidArgument(f"{what} must be 1..{_MAX_ID_LEN} printable characters without '/'")

    def _check_hashes(self, hashes: Sequence[bytes], limit: int, what: str) -> None:
        if not hashes:
            raise InvalidArgument(f"{what}: at least one block hash is required")
        if len(hashes) > limit:
            raise ResourceExhausted(f"{what}: {len(hashes)} hashes exceed the limit of {limit}")
        n = self.config.hash_bytes
        for i, h in enumerate(hashes):
            if len(h) != n:
                raise InvalidArgument(f"{what}: block hash #{i} is {len(h)} bytes, expected {n}")

    def _node(self, node_id: str) -> NodeRecord:
        """The registered node a node's own call acts for; FailedPrecondition if none (the
        node itself must register first)."""
        self._check_id("node_id", node_id)
        node = self.index.nodes.get(NodeId(node_id))
        if node is None:
            raise FailedPrecondition(f"node {node_id!r} is not registered (or its lease expired); register first")
        return node

    def _known_node(self, node_id: str) -> NodeRecord:
        """The registered node an admin call names; NotFound if no node has this id."""
        self._check_id("node_id", node_id)
        node = self.index.nodes.get(NodeId(node_id))
        if node is None:
            raise NotFound(f"unknown node id {node_id!r}: it is not registered (or its lease expired); "
                           "`kvpool admin nodes` lists the registered nodes")
        return node

    @staticmethod
    def _check_proof(node: NodeRecord, proof: str | None) -> None:
        """PermissionDenied unless `proof` is None (not required) or the node's session token."""
        if proof is None or session_matches(node.session_digest, proof):
            return
        sent = "a different session token" if proof else "no session token"
        raise PermissionDenied(f"node {node.node_id!r}: the call carries {sent}; with the node token a node may "
                               "only act for itself (send the kvpool-node-session its RegisterNode returned)")

    def _check_namespace(self, namespace: str) -> Namespace:
        if not namespace:
            raise InvalidArgument("namespace is required")
        if len(namespace) > _MAX_ID_LEN:
            raise InvalidArgument(f"namespace must be at most {_MAX_ID_LEN} characters, got {len(namespace)}")
        if not self.index.knows_namespace(Namespace(namespace)):
            raise NotFound(f"namespace {namespace!r} is unknown: no node registered with it")
        return Namespace(namespace)

    # ---- node lifecycle -------------------------------------------------------------

    async def register_node(self, node_id: str, session_address: str, buffer_address: int,
                            capacity_bytes: int, namespace: str, lease_ttl_s: int,
                            proof: str | None = None, api_url: str = "",
                            stage_address: str = "") -> tuple[NodeRecord, str]:
        """(Re-)register a node under a new lease; returns it and its new session token.
        `api_url` ("" or http(s)://HOST:PORT) is where its engine serves, for routers.

        A node already registered under this id is replaced and its old blocks are dropped:
        a restarted node has new slots. Replacing a live registration that has a session
        needs its `proof` (unless None); otherwise wait for its lease to expire."""
        self._check_id("node_id", node_id)
        if not session_address or len(session_address) > _MAX_ID_LEN or ":" not in session_address:
            raise InvalidArgument(f"session_address must be HOST:PORT, got {_show(session_address)}")
        if not 0 < capacity_bytes <= self.config.max_capacity_bytes:
            raise InvalidArgument(f"capacity_bytes must be in 1..{self.config.max_capacity_bytes}, got {capacity_bytes}")
        if not namespace or len(namespace) > _MAX_ID_LEN:
            raise InvalidArgument("layout_fingerprint is required (at most 256 characters)")
        if api_url and (len(api_url) > _MAX_ID_LEN or not _API_URL.fullmatch(api_url)):
            raise InvalidArgument(f"api_url must be empty or http(s)://HOST:PORT, got {_show(api_url)}")
        if stage_address and (len(stage_address) > _MAX_ID_LEN or ":" not in stage_address):
            raise InvalidArgument(f"stage_address must be empty or HOST:PORT, got {_show(stage_address)}")
        ttl = lease_ttl_s or self.config.default_lease_ttl_s
        if not 1 <= ttl <= self.config.max_lease_ttl_s:
            raise InvalidArgument(f"lease_ttl_s must be in 1..{self.config.max_lease_ttl_s}, got {lease_ttl_s}")
        with self.lock:
            old = self.index.nodes.get(NodeId(node_id))
        if old is not None and proof is not None and old.session_digest \
                and not session_matches(old.session_digest, proof):
            raise PermissionDenied(
                f"node {node_id!r} is registered under a live lease and the call carries no proof of that "
                f"registration; with the node token a node may only act for itself: wait for the lease to "
                f"expire (ttl {old.lease_ttl_s}s) or ask an admin to unregister it")
        token = new_session_token()
        try:
            lease_id, granted = await self.store.etcd.lease_grant(ttl)
            if old is not None:
                await self.store.etcd.lease_revoke(old.lease_id)
            node = NodeRecord(NodeId(node_id), session_address, buffer_address, capacity_bytes,
                              Namespace(namespace), lease_id, granted, api_url=api_url,
                              session_digest=session_digest(token), stage_address=stage_address)
            await self.store.write_node(node)
        except EtcdError as err:
            if isinstance(err, EtcdUnavailable):
                self.store.report_unreachable()
            raise Unavailable(f"cannot register node {node_id!r} while etcd is unavailable: {err}") from None
        with self.lock:
            if old is not None:
                self.store.drop_lease_ops(old.lease_id)
                self.index.remove_node(old.node_id)
            self.index.upsert_node(node)
        log.info("node %s registered (lease %x, ttl %ds, %s, %d bytes)", node_id, lease_id, granted,
                 session_address, capacity_bytes)
        return node, token

    async def keepalive(self, node_id: str, lease_id: int, proof: str | None = None) -> int:
        """Refresh the node's lease; NotFound means: register again and re-publish."""
        self._check_id("node_id", node_id)
        with self.lock:
            node = self.index.nodes.get(NodeId(node_id))
        if node is None or node.lease_id != lease_id:
            raise NotFound(f"node {node_id!r} has no lease {lease_id:x}; register again")
        self._check_proof(node, proof)
        with self.lock:
            if self.index.clear_suspect(node.node_id):
                log.info("node %s keeps its lease: offered as a source again", node_id)
        try:
            return await self.store.etcd.lease_keepalive(lease_id)
        except LeaseNotFound:
            with self.lock:
                self._lease_lost(lease_id)
            raise NotFound(f"lease of node {node_id!r} expired; register again") from None
        except EtcdUnavailable:
            # Degraded: etcd renews every lease to its full TTL when it comes back. Health says
            # so (the store probes etcd until it answers again).
            self.store.report_unreachable()
            return node.lease_ttl_s

    async def unregister_node(self, node_id: str, lease_id: int, proof: str | None = None) -> int:
        """Revoke the node's lease; returns how many of its blocks left the index."""
        with self.lock:
            node = self._node(node_id)
            # Counted before the revoke: the watch may drop the blocks before we do.
            num_blocks = self.index.num_blocks_of(node.node_id)
        if node.lease_id != lease_id:
            raise FailedPrecondition(f"node {node_id!r} is registered under another lease")
        self._check_proof(node, proof)
        try:
            await self.store.etcd.lease_revoke(lease_id)
        except EtcdUnavailable as err:
            self.store.report_unreachable()
            raise Unavailable(f"cannot unregister while etcd is unreachable: {err}") from None
        with self.lock:
            self.store.drop_lease_ops(lease_id)
            self.index.remove_node(node.node_id)
        log.info("node %s unregistered (%d blocks dropped)", node_id, num_blocks)
        return num_blocks

    # ---- blocks ---------------------------------------------------------------------

    @writer
    def publish(self, node_id: str, records: Sequence[BlockRecord], proof: str | None = None) -> int:
        node = self._node(node_id)
        self._check_proof(node, proof)
        if node.draining:
            raise FailedPrecondition(f"node {node_id!r} is draining; it cannot publish")
        self._check_hashes([r.block_hash for r in records], self.config.max_publish_batch, "publish")
        for i, r in enumerate(records):
            # A DISK copy's offset is in the node's disk tier, which only the node reads.
            limit = node.capacity_bytes if r.medium == Medium.DRAM else 1 << 62
            if r.size_bytes <= 0 or r.offset < 0 or r.offset + r.size_bytes > limit:
                raise InvalidArgument(
                    f"publish: block #{i} (offset {r.offset}, size {r.size_bytes}) is outside the node's "
                    f"{node.capacity_bytes}-byte pool")
        if not self.store.room_for(len(records)):
            raise ResourceExhausted(f"{self.store.pending_writes} changes already queued for etcd; retry later")
        for r in records:
            self.index.add_block(node.node_id, r)
            self.store.put_block(node, r)
        self.counters.published_blocks += len(records)
        return len(records)

    @writer
    def unpublish(self, node_id: str, hashes: Sequence[bytes], proof: str | None = None) -> int:
        node = self._node(node_id)
        self._check_proof(node, proof)
        self._check_hashes(hashes, self.config.max_publish_batch, "unpublish")
        removed = 0
        for h in hashes:
            if self.index.remove_block(node.node_id, BlockHash(h)):
                self.store.delete_block(node.node_id, h)
                removed += 1
        return removed

    def _check_loaded(self) -> None:
        """Index reads wait for the index: Unavailable (the caller retries, or asks another
        replica) until start() has loaded it from etcd."""
        if not self.loaded:
            raise Unavailable("this replica is still loading the index from etcd; retry or ask another replica")

    @reader
    def query(self, namespace: str, hashes: Sequence[bytes], requester: str, sparse: bool = False) -> QueryResult:
        """Longest present prefix (with `sparse`, every block present); never waits for etcd
        (see BlockIndex.query). Unavailable before the index is loaded."""
        self._check_loaded()
        return self._query(namespace, hashes, requester, sparse)

    def _query(self, namespace: str, hashes: Sequence[bytes], requester: str, sparse: bool) -> QueryResult:
        self._check_hashes(hashes, self.config.max_query_hashes, "query")
        ns = self._check_namespace(namespace)
        result = self.index.query(ns, cast(list[BlockHash], hashes), NodeId(requester) if requester else None,
                                  sparse)
        self.counters.queries += 1
        self.counters.query_blocks += len(hashes)
        self.counters.query_hit_blocks += result.num_held
        return result

    @reader
    def query_batch(self, queries: Sequence[tuple[str, Sequence[bytes], str, bool]]) -> list[QueryResult]:
        """Many `query` calls (namespace, hashes, requester, sparse) as one: all checked first,
        so a bad one fails the whole batch and none is answered or counted."""
        self._check_loaded()
        if len(queries) > MAX_BATCH_QUERIES:
            raise InvalidArgument(f"QueryPrefixBatch takes at most {MAX_BATCH_QUERIES} queries, got {len(queries)}")
        for namespace, hashes, _, _ in queries:
            self._check_hashes(hashes, self.config.max_query_hashes, "query")
            self._check_namespace(namespace)
        return [self._query(ns, hashes, requester, sparse) for ns, hashes, requester, sparse in queries]

    @writer
    def report_failed_read(self, reporter: str, source: str, hashes: Sequence[bytes]) -> tuple[int, bool]:
        """A reader could not read from `source`. No hashes: the node did not answer; it is
        suspect on this replica (not offered) until its next keepalive here or one lease TTL,
        whichever comes first, its entries kept. Hashes: those copies on `source` are stale
        (evicted or overwritten there) and leave the index, durably. Returns (copies removed,
        source suspect). Any caller may report: the worst a false report does is cost hits."""
        if reporter:
            self._check_id("reporter_node_id", reporter)
        node = self._node(source)
        if not hashes:
            self.index.mark_suspect(node.node_id, node.lease_ttl_s)
            log.warning("reads from node %s failed (reported by %s): not offered until its next keepalive",
                        source, reporter or "?")
            return 0, True
        self._check_hashes(hashes, self.config.max_publish_batch, "report")
        removed = 0
        for h in dict.fromkeys(hashes):
            if self.index.remove_block(node.node_id, BlockHash(h)):
                self.store.delete_block(node.node_id, h)
                removed += 1
        log.info("%d stale copies on node %s dropped (reported by %s)", removed, source, reporter or "?")
        return removed, False

    @reader
    def watch_snapshot(self, namespace: str) -> tuple[str, int, list[NodeRecord], list[BlockLocation],
                                                      dict[NodeId, float]]:
        """A WatchIndex snapshot of the namespace (possibly empty: a node may watch before any
        node of its namespace registered) and the feed position it is at. Unavailable before
        the index is loaded: a snapshot then would be empty, and the watcher's view current."""
        if not namespace or len(namespace) > _MAX_ID_LEN:
            raise InvalidArgument(f"namespace must be 1..{_MAX_ID_LEN} characters")
        self._check_loaded()
        epoch, seq = self.feed.position()
        return (epoch, seq, *self.index.namespace_state(Namespace(namespace)))

    def _delete_copies(self, dropped: Sequence[tuple[NodeId, BlockHash]]) -> int:
        for node_id, h in dropped:
            self.store.delete_block(node_id, h)
        return len(dropped)

    @writer
    def invalidate_hashes(self, namespace: str, hashes: Sequence[bytes]) -> int:
        self._check_hashes(hashes, self.config.max_invalidate_hashes, "invalidate")
        ns = self._check_namespace(namespace)
        return self._delete_copies(self.index.remove_hashes(ns, [BlockHash(h) for h in hashes]))

    @writer
    def invalidate_node(self, node_id: str) -> int:
        node = self._known_node(node_id)
        return self._delete_copies([(node.node_id, h) for h in self.index.remove_node_blocks(node.node_id)])

    @writer
    def invalidate_namespace(self, namespace: str) -> int:
        return self._delete_copies(self.index.remove_namespace(self._check_namespace(namespace)))

    @writer
    def invalidate_all(self) -> int:
        return self._delete_copies(self.index.remove_all())

    @writer
    def drain(self, node_id: str) -> int:
        """Stop using a node as a source and refuse its publishes (before it shuts down);
        returns how many of its blocks left the index. NotFound for an unknown node."""
        node = self._known_node(node_id)
        hashes = self.index.remove_node_blocks(node.node_id)
        drained = dataclasses.replace(node, draining=True)
        self.index.upsert_node(drained)
        self.store.put_node(drained)
        log.info("node %s draining (%d blocks dropped)", node_id, len(hashes))
        return self._delete_copies([(node.node_id, h) for h in hashes])

    @writer
    def undrain(self, node_id: str) -> bool:
        """Undo `drain`: the node is a source again and its publishes are accepted. Returns
        False (and changes nothing) if it was not draining; NotFound for an unknown node.
        The blocks drain dropped come back as the node publishes them again."""
        node = self._known_node(node_id)
        if not node.draining:
            return False
        active = dataclasses.replace(node, draining=False)
        self.index.upsert_node(active)
        self.store.put_node(active)
        log.info("node %s undrained: a source again, its publishes accepted", node_id)
        return True

    # ---- introspection --------------------------------------------------------------

    @reader
    def nodes(self) -> list[tuple[NodeRecord, int]]:
        return [(n, self.index.num_blocks_of(n.node_id)) for n in sorted(self.index.nodes.values(),
                                                                          key=lambda n: n.node_id)]

    @reader
    def index_stats(self) -> IndexStats:
        return self.index.stats()
