"""A node-local read view of one namespace of the index: lookups with no RPC.

Where it sits: the connector's scheduler half asks `query()` for a request's chain on the
host's thread; the answer is a walk of a local `BlockIndex` (tens of microseconds for 64
hashes), chosen as the metaserver would choose (own copies first, then the least-read
holder). A thread keeps the view in step with a metaserver replica's WatchIndex stream
(metaserver.feed): a snapshot, then the changes as the replica applies them.

Staleness: a change reaches the view one stream hop after the replica applies it (for a
block published through another replica, after etcd's watch too). The view is `current()`
only while its stream is up and delivered something (changes or a heartbeat) within
`stale_after_s` (a frozen replica keeps the connection but goes silent); otherwise `query()` answers None and the caller falls back to the batched RPC path. A stale
entry costs at most a failed read: the reader validates every block it reads, and reports the
failure (ReportFailedRead), which the feed then carries to every view.

Resume: after a broken stream the thread reconnects (the next endpoint, after a short
pause) with the epoch and position it reached; the replica replays the missed changes while
its feed still holds them, else sends a new snapshot.

Thread-safe: one lock guards the local index between the stream thread and `query()`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import cast

import grpc

from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from metaserver.client import MetaClient
from metaserver.index import BlockIndex
from metaserver.store import node_from_pb, record_from_pb
from metaserver.types import BlockHash, Namespace, NodeId, QueryResult

log = logging.getLogger(__name__)


class IndexView:
    def __init__(self, client: MetaClient, namespace: str, node_id: str = "", stale_after_s: float = 2.0,
                 retry_s: float = 0.2) -> None:
        self._client = client
        self.namespace = Namespace(namespace)
        self.node_id = node_id
        self.stale_after_s = stale_after_s
        self._requester = NodeId(node_id) if node_id else None
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._index = BlockIndex()
        self._building = BlockIndex()   # a snapshot being received (swapped in when complete)
        self._in_snapshot = False
        self._connected = False         # the stream is up (cleared when it breaks)
        self._complete = False          # the view holds a complete snapshot (and changes after it)
        self._heard = 0.0               # monotonic time of the last event
        self.epoch, self.seq = "", 0
        self.snapshots = 0              # snapshots received (counter)
        self.resumes = 0                # reconnects that replayed changes instead (counter)
        self._call: grpc.Future | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"index-view-{namespace[:16]}", daemon=True)
        self._thread.start()

    # ---- the host's side ------------------------------------------------------------

    def current(self) -> bool:
        """A complete view, its stream connected and heard from within stale_after_s."""
        return self._complete and self._connected and time.monotonic() - self._heard < self.stale_after_s

    def query(self, chain: Sequence[bytes], sparse: bool = False) -> QueryResult | None:
        """The longest present prefix of `chain` (with `sparse`, every block of it present), as
        the metaserver would answer it; None while the view is not current (no snapshot yet,
        or the stream has been silent)."""
        if not self.current():
            return None
        with self._lock:
            return self._index.query(self.namespace, cast(Sequence[BlockHash], chain), self._requester, sparse)

    def prefix_by_node(self, chain: Sequence[bytes]) -> tuple[int, dict[NodeId, int]] | None:
        """`BlockIndex.prefix_by_node` on the view (a router's question: who holds how much of
        this chain); None while the view is not current."""
        if not self.current():
            return None
        with self._lock:
            return self._index.prefix_by_node(self.namespace, cast(Sequence[BlockHash], chain))

    def present(self, chain: Sequence[bytes]) -> list[bool] | None:
        """`BlockIndex.present` on the view; None while the view is not current."""
        if not self.current():
            return None
        with self._lock:
            return self._index.present(self.namespace, cast(Sequence[BlockHash], chain))

    def disk(self, chain: Sequence[bytes]) -> tuple[list[bool], dict[NodeId, set[int]]] | None:
        """`BlockIndex.disk` on the view; None while the view is not current."""
        if not self.current():
            return None
        with self._lock:
            return self._index.disk(self.namespace, cast(Sequence[BlockHash], chain))

    def wait_current(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.current():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def num_copies(self) -> int:
        with self._lock:
            return self._index.num_copies()

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(5)

    # ---- the stream thread ----------------------------------------------------------

    def _run(self) -> None:
        replica = 0
        while not self._stop.is_set():
            resuming = bool(self.epoch)
            try:
                self._call = self._client.watch_index(self.namespace, self.epoch, self.seq, self.node_id, replica)
                for ev in self._call:
                    if resuming:
                        self.resumes += not ev.reset
                        resuming = False
                    self._apply(ev)
            except grpc.RpcError as err:
                self._connected = False  # a replica that went away: fall back at once, not after stale_after_s
                if self._stop.is_set():
                    return
                log.info("index view of %s: stream from replica %d broke (%s); resuming",
                         self.namespace, replica, err.code().name)
            except Exception:  # noqa: BLE001 - the view must outlive a bad event; lookups fall back meanwhile
                self._connected = False
                log.exception("index view of %s: stream from replica %d failed; resuming", self.namespace, replica)
            replica += 1
            self._stop.wait(self._retry_s)

    def _apply(self, ev: pb.IndexEvent) -> None:
        """Apply one event in the order IndexEvent documents. A snapshot builds a new local
        index beside the view, which keeps answering until the snapshot is complete."""
        if ev.reset:
            self._building, self._in_snapshot = BlockIndex(), True
        target = self._building if self._in_snapshot else self._index
        # A snapshot being built is this thread's alone: queries wait only for changes to the view.
        with self._lock if target is self._index else contextlib.nullcontext():
            for msg in ev.nodes:
                target.upsert_node(node_from_pb(msg))
            for node_id, h in zip(ev.removed_block_nodes, ev.removed_hashes):
                target.remove_block(NodeId(node_id), BlockHash(h))
            for node_id, b in zip(ev.block_nodes, ev.blocks):
                target.add_block(NodeId(node_id), record_from_pb(b))
            for node_id in ev.removed_nodes:
                target.remove_node(NodeId(node_id))
            for node_id, for_s in zip(ev.suspect_nodes, ev.suspect_for_s):
                target.mark_suspect(NodeId(node_id), for_s)
            for node_id in ev.trusted_nodes:
                target.clear_suspect(NodeId(node_id))
        if self._in_snapshot and ev.current:
            with self._lock:
                self._index, self._building, self._in_snapshot = target, BlockIndex(), False
            self.snapshots += 1
            self._complete = True
        self.epoch, self.seq = ev.epoch, ev.seq
        self._heard = time.monotonic()
        self._connected = True
