"""The index's change feed: what WatchIndex streams to node-local read views.

Where it sits: `BlockIndex` appends every change it applies (node upserted or gone, block
added or removed, node suspect or trusted) while the service holds its lock; a WatchIndex
stream (one handler thread per watcher) sends a namespace's snapshot, then waits here for
changes after the last position it sent and sends them coalesced (`encode_changes`).

Positions: `seq` grows by one per change, over all namespaces; `epoch` names this incarnation
of the index (a replica that rebuilds its index from etcd starts a new epoch, and watchers
take a new snapshot). The feed keeps the changes of the last `keep_s` seconds (at most
`max_events` of them), so a watcher that reconnects soon after a disconnect resumes without
a snapshot, and one further behind takes a snapshot, as a new watcher does. Bounded by time
and not by count alone because a count sized for a busy cluster is, at a quiet one's change
rate, hours of changes held for no watcher (~230 bytes each).

Thread-safe: its own condition guards it (taken inside the service lock, never around it).
"""
from __future__ import annotations

import enum
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from metaserver.store import node_to_pb, record_to_pb
from metaserver.types import BlockHash, BlockLocation, BlockRecord, Namespace, NodeId, NodeRecord

SNAPSHOT_CHUNK = 8192  # blocks per snapshot message (a 1M-block namespace: ~120 messages)
KEEP_S = 300.0         # seconds of changes a reconnecting watcher can resume from


class Kind(enum.Enum):
    NODE = 1        # payload: NodeRecord
    NODE_GONE = 2   # payload: None
    ADD = 3         # payload: BlockRecord
    REMOVE = 4      # payload: BlockHash
    SUSPECT = 5     # payload: seconds
    TRUST = 6       # payload: None


@dataclass(frozen=True, slots=True)
class Change:
    seq: int
    namespace: Namespace
    kind: Kind
    node_id: NodeId
    payload: object
    at: float = 0.0  # the feed's clock when appended


class IndexFeed:
    def __init__(self, max_events: int = 262_144, keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._events: deque[Change] = deque(maxlen=max_events)
        self._keep_s, self._clock = keep_s, clock
        self.epoch = secrets.token_hex(8)
        self.seq = 0

    def __len__(self) -> int:
        return len(self._events)

    def append(self, namespace: Namespace, kind: Kind, node_id: NodeId, payload: object = None) -> None:
        with self._cond:
            self.seq += 1
            now = self._clock()
            events = self._events
            events.append(Change(self.seq, namespace, kind, node_id, payload, now))
            while events[0].at < now - self._keep_s:  # the newest is never older than that
                events.popleft()
            self._cond.notify_all()

    def restart(self) -> None:
        """A new index incarnation: watchers must take a new snapshot."""
        with self._cond:
            self.epoch = secrets.token_hex(8)
            self._events.clear()
            self._cond.notify_all()

    def position(self) -> tuple[str, int]:
        with self._cond:
            return self.epoch, self.seq

    def since(self, epoch: str, after_seq: int, namespace: Namespace) -> tuple[list[Change], int] | None:
        """The namespace's changes after `after_seq`, and the position they bring a view to;
        None if they cannot be replayed (another epoch, or older changes than the feed holds)."""
        with self._cond:
            if epoch != self.epoch or after_seq > self.seq:
                return None
            first = self._events[0].seq if self._events else self.seq + 1
            if after_seq < first - 1:
                return None
            tail = itertools.islice(self._events, after_seq - first + 1, None)
            return [c for c in tail if c.namespace == namespace], self.seq

    def wait(self, epoch: str, after_seq: int, timeout_s: float) -> None:
        """Until a change after `after_seq` (or a new epoch) exists, or `timeout_s` passed."""
        with self._cond:
            self._cond.wait_for(lambda: self.seq > after_seq or self.epoch != epoch, timeout_s)


def encode_changes(changes: Iterable[Change], epoch: str, seq: int) -> pb.IndexEvent:
    """One IndexEvent bringing a view to `seq`: each node and block at its final state."""
    nodes: dict[NodeId, NodeRecord | None] = {}
    blocks: dict[tuple[NodeId, BlockHash], BlockRecord | None] = {}
    marks: dict[NodeId, float | None] = {}
    for c in changes:
        if c.kind is Kind.NODE:
            nodes[c.node_id] = c.payload  # type: ignore[assignment]
        elif c.kind is Kind.NODE_GONE:
            nodes[c.node_id] = None
        elif c.kind is Kind.ADD:
            rec: BlockRecord = c.payload  # type: ignore[assignment]
            blocks[(c.node_id, rec.block_hash)] = rec
        elif c.kind is Kind.REMOVE:
            blocks[(c.node_id, c.payload)] = None  # type: ignore[index]
        elif c.kind is Kind.SUSPECT:
            marks[c.node_id] = c.payload  # type: ignore[assignment]
        else:
            marks[c.node_id] = None
    ev = pb.IndexEvent(epoch=epoch, seq=seq, current=True,
                       nodes=[node_to_pb(n) for n in nodes.values() if n is not None],
                       removed_nodes=[n for n, rec in nodes.items() if rec is None],
                       trusted_nodes=[n for n, t in marks.items() if t is None])
    for (node_id, h), rec in blocks.items():
        if rec is None:
            ev.removed_block_nodes.append(node_id)
            ev.removed_hashes.append(h)
        else:
            ev.block_nodes.append(node_id)
            ev.blocks.append(record_to_pb(rec))
    for node_id, t in marks.items():
        if t is not None:
            ev.suspect_nodes.append(node_id)
            ev.suspect_for_s.append(t)
    return ev


def encode_snapshot(nodes: list[NodeRecord], blocks: list[BlockLocation], suspects: dict[NodeId, float],
                    epoch: str, seq: int) -> Iterator[pb.IndexEvent]:
    """A namespace's state as events: the first resets the view, the last makes it current."""
    first = pb.IndexEvent(epoch=epoch, seq=seq, reset=True, nodes=[node_to_pb(n) for n in nodes],
                          suspect_nodes=list(suspects), suspect_for_s=list(suspects.values()))
    chunks = [blocks[i:i + SNAPSHOT_CHUNK] for i in range(0, len(blocks), SNAPSHOT_CHUNK)] or [[]]
    for i, chunk in enumerate(chunks):
        ev = first if i == 0 else pb.IndexEvent(epoch=epoch, seq=seq)
        ev.block_nodes.extend(loc.node_id for loc in chunk)
        ev.blocks.extend(record_to_pb(loc) for loc in chunk)
        ev.current = i == len(chunks) - 1
        yield ev
