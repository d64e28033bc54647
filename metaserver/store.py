"""Durability of the index in etcd: key layout, write-behind queue, load and watch.

Where it sits: between `metaserver.service` (which changes the in-memory index first and
then hands the matching etcd change here) and `metaserver.etcd`.

Key layout under the configured prefix P:
    P nodes/<node_id>              NodeInfo       under the node's lease
    P blocks/<node_id>/<hash hex>  StoredBlock    under the node's lease
Putting blocks under their node's lease makes etcd delete them when the node's lease
expires; every replica sees the deletes through its watch.

Writes are queued, coalesced per key (the last change to a key wins) and flushed in
transactions of at most `max_txn_ops` operations, several in flight at once but never two
for one key. While etcd is unreachable the queue is kept and retried with backoff, and
`healthy` is False; nothing is lost unless this process dies, in which case the nodes
re-publish what they hold when they re-register.

Health: `healthy` turns False when a write fails with EtcdUnavailable, or when another etcd
call does (lease keepalive, registration, the watch: their callers `report_unreachable()`),
or when the prober's check fails. The prober (a cheap count-only range with a short
deadline) runs when nothing reached etcd for PROBE_IDLE_S, so an outage is noticed without
any traffic, and, while unhealthy, with backoff until etcd answers again, so health comes
back without writes. QueryPrefix never waits for any of this: it reads memory only.

Threading: the flusher, load and watch run on the metaserver's event loop; `enqueue` and
friends are called from gRPC handler threads. Both sides hold the shared `lock` while they
touch the queue; callers of the queue methods must hold it. After queueing, a caller calls
`notify()` (thread-safe) once to wake the flusher.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from metaserver.config import MetaServerConfig
from metaserver.etcd import Delete, EtcdClient, EtcdError, EtcdUnavailable, LeaseNotFound, Op, Put, WatchEvent
from metaserver.types import BlockHash, BlockLocation, BlockRecord, Medium, Namespace, NodeId, NodeRecord

log = logging.getLogger(__name__)

PROBE_IDLE_S = 1.0     # probe etcd when no write or probe succeeded for this long (and, at most,
                       # the probes' backoff while etcd is unreachable)
PROBE_TIMEOUT_S = 1.0  # a probe's deadline (at most the configured etcd_timeout_s)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything under the prefix at one revision."""

    nodes: list[NodeRecord]
    blocks: list[tuple[NodeId, BlockRecord, int]]  # (holder, block, lease)
    revision: int


@dataclass(frozen=True, slots=True)
class Change:
    """One decoded watch event. Exactly one of node / block_hash is set."""

    is_put: bool
    node_id: NodeId
    lease: int                              # the key's lease (for deletes: before the delete)
    node: NodeRecord | None = None          # node put
    block_hash: BlockHash | None = None     # block put/delete
    block: BlockRecord | None = None        # block put


def node_to_pb(node: NodeRecord, *, stored: bool = False) -> pb.NodeInfo:
    """The node as NodeInfo; `stored` (etcd values only) adds its session digest, which
    RPC answers never carry."""
    return pb.NodeInfo(node_id=node.node_id, session_address=node.session_address,
                       buffer_address=node.buffer_address, capacity_bytes=node.capacity_bytes,
                       layout_fingerprint=node.namespace, lease_id=node.lease_id,
                       lease_ttl_s=node.lease_ttl_s, draining=node.draining, api_url=node.api_url,
                       stage_address=node.stage_address,
                       session_digest=node.session_digest if stored else b"")


def record_to_pb(rec: BlockRecord | BlockLocation) -> pb.BlockRecord:
    """A block record (or one copy's location: the same fields but the holder) as BlockRecord."""
    return pb.BlockRecord(block_hash=rec.block_hash, offset=rec.offset, size_bytes=rec.size_bytes,
                          generation=rec.generation, medium=int(rec.medium))


def record_from_pb(msg: pb.BlockRecord) -> BlockRecord:
    return BlockRecord(BlockHash(msg.block_hash), msg.offset, msg.size_bytes, msg.generation, Medium(msg.medium))


def node_from_pb(msg: pb.NodeInfo) -> NodeRecord:
    return NodeRecord(NodeId(msg.node_id), msg.session_address, msg.buffer_address, msg.capacity_bytes,
                      Namespace(msg.layout_fingerprint), msg.lease_id, msg.lease_ttl_s, msg.draining,
                      msg.api_url, msg.session_digest, msg.stage_address)


class KeyCodec:
    """etcd keys and values of nodes and blocks."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.encode()
        self.nodes = self.prefix + b"nodes/"
        self.blocks = self.prefix + b"blocks/"

    def node_key(self, node_id: str) -> bytes:
        return self.nodes + node_id.encode()

    def block_key(self, node_id: str, block_hash: bytes) -> bytes:
        return b"%s%s/%s" % (self.blocks, node_id.encode(), block_hash.hex().encode())

    @staticmethod
    def block_value(namespace: str, rec: BlockRecord) -> bytes:
        return pb.StoredBlock(namespace=namespace, offset=rec.offset, size_bytes=rec.size_bytes,
                              generation=rec.generation, medium=int(rec.medium)).SerializeToString()

    def decode(self, key: bytes, value: bytes, is_put: bool, lease: int) -> Change | None:
        if key.startswith(self.nodes):
            node_id = NodeId(key[len(self.nodes):].decode())
            node = node_from_pb(pb.NodeInfo.FromString(value)) if is_put else None
            return Change(is_put, node_id, lease, node=node)
        if key.startswith(self.blocks):
            node_part, _, hash_hex = key[len(self.blocks):].rpartition(b"/")
            node_id, block_hash = NodeId(node_part.decode()), BlockHash(bytes.fromhex(hash_hex.decode()))
            block = None
            if is_put:
                sb = pb.StoredBlock.FromString(value)
                block = BlockRecord(block_hash, sb.offset, sb.size_bytes, sb.generation, Medium(sb.medium))
            return Change(is_put, node_id, lease, block_hash=block_hash, block=block)
        return None


class DurableStore:
    """The write-behind queue to etcd plus load/watch of the current state."""

    def __init__(self, config: MetaServerConfig, etcd: EtcdClient, lock: threading.RLock,
                 on_lease_lost: Callable[[int], None]) -> None:
        self.config = config
        self.etcd = etcd
        self.lock = lock
        self._loop: asyncio.AbstractEventLoop | None = None
        self.keys = KeyCodec(config.key_prefix)
        self._on_lease_lost = on_lease_lost
        self._pending: dict[bytes, Op] = {}
        self._inflight: set[bytes] = set()
        self._wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._probe_now = asyncio.Event()  # cut the prober's wait short (health turned bad)
        self._last_ok = time.monotonic()   # when etcd last answered a write or a probe
        self.probes = 0                    # probes sent (tests, logs)
        self.healthy = True
        self.on_health_change: Callable[[bool], None] = lambda healthy: None

    # ---- queue ----------------------------------------------------------------------

    @property
    def pending_writes(self) -> int:
        return len(self._pending) + len(self._inflight)

    def has_pending(self, key: bytes) -> bool:
        """True while this replica still has a change of `key` to write: watch events for
        the key are older than that change and are skipped."""
        return key in self._pending or key in self._inflight

    def room_for(self, num_ops: int) -> bool:
        return self.pending_writes + num_ops <= self.config.max_pending_writes

    def enqueue(self, op: Op) -> None:
        self._pending.pop(op.key, None)  # re-insert at the end: the newest change wins
        self._pending[op.key] = op

    def notify(self) -> None:
        """Wake the flusher after queueing (any thread; lock not needed)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def put_block(self, node: NodeRecord, rec: BlockRecord) -> None:
        self.enqueue(Put(self.keys.block_key(node.node_id, rec.block_hash),
                         self.keys.block_value(node.namespace, rec), node.lease_id))

    def delete_block(self, node_id: str, block_hash: bytes) -> None:
        self.enqueue(Delete(self.keys.block_key(node_id, block_hash)))

    def put_node(self, node: NodeRecord) -> None:
        value = node_to_pb(node, stored=True).SerializeToString()
        self.enqueue(Put(self.keys.node_key(node.node_id), value, node.lease_id))

    async def write_node(self, node: NodeRecord) -> None:
        """Write a node record now (not queued): other replicas must know a node as soon as
        its registration is acknowledged. Raises EtcdUnavailable / LeaseNotFound."""
        value = node_to_pb(node, stored=True).SerializeToString()
        await self.etcd.put(self.keys.node_key(node.node_id), value, node.lease_id)

    def drop_lease_ops(self, lease_id: int) -> None:
        """Forget queued puts under a lease that no longer exists."""
        for key in [k for k, op in self._pending.items() if isinstance(op, Put) and op.lease == lease_id]:
            del self._pending[key]

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued change is written; False if `timeout_s` ran out first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.pending_writes:
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def start(self) -> None:
        """Start the flusher and the prober on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._last_ok = time.monotonic()  # load() has just read etcd
        self._flusher = asyncio.create_task(self._flush_loop(), name="etcd-flusher")
        self._prober = asyncio.create_task(self._probe_loop(), name="etcd-prober")

    async def stop(self) -> None:
        tasks = [t for t in (self._flusher, self._prober, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def report_unreachable(self) -> None:
        """An etcd call outside the flusher (lease keepalive, registration, the watch) failed
        with EtcdUnavailable: mark etcd unhealthy; the prober brings it back once etcd answers.
        Any thread (the service calls it on the loop thread)."""
        loop = self._loop
        if loop is not None and not _running_on(loop):
            loop.call_soon_threadsafe(self._set_healthy, False)
        else:
            self._set_healthy(False)

    def _set_healthy(self, healthy: bool) -> None:
        """Loop thread (or before start)."""
        if healthy:
            self._last_ok = time.monotonic()
        if healthy != self.healthy:
            self.healthy = healthy
            log.warning("etcd %s; %d changes queued", "reachable again" if healthy else "unreachable",
                        self.pending_writes)
            if not healthy:
                self._probe_now.set()  # start probing with the short backoff
            self.on_health_change(healthy)

    async def _probe(self) -> bool:
        """One cheap check that etcd answers (a count-only linearizable range on a key that
        does not exist, with a short deadline); updates `healthy`."""
        self.probes += 1
        try:
            await self.etcd.probe(self.keys.prefix, min(PROBE_TIMEOUT_S, self.config.etcd_timeout_s))
        except EtcdUnavailable as err:
            if self.healthy:
                log.info("etcd probe failed: %s", err)
            self._set_healthy(False)
            return False
        except EtcdError as err:  # etcd answered, with an error: it is reachable
            log.error("etcd probe answered with an error: %s", err)
        self._set_healthy(True)
        return True

    async def _probe_loop(self) -> None:
        """While healthy: probe whenever etcd has not answered a write or a probe for
        PROBE_IDLE_S (an idle replica notices an outage within about PROBE_IDLE_S + the probe
        deadline). While unhealthy: probe with backoff (etcd_retry_s doubling up to
        PROBE_IDLE_S) until etcd answers, writes or no writes."""
        backoff = self.config.etcd_retry_s
        while True:
            delay = self._last_ok + PROBE_IDLE_S - time.monotonic() if self.healthy else backoff
            woken = False
            if delay > 0:
                try:
                    # Not asyncio.wait_for: in 3.11 it can swallow a cancel that arrives as the
                    # event is set, and stop() would wait for this task forever.
                    async with asyncio.timeout(delay):
                        await self._probe_now.wait()
                    woken = True
                except TimeoutError:
                    pass
            self._probe_now.clear()
            if woken:  # health just turned bad: probe again soon, then back off
                backoff = self.config.etcd_retry_s
                continue
            if self.healthy:
                backoff = self.config.etcd_retry_s
                if time.monotonic() - self._last_ok < PROBE_IDLE_S:
                    continue  # a write succeeded meanwhile: no probe needed
            else:
                backoff = min(backoff * 2, PROBE_IDLE_S)
            await self._probe()

    def _take_batch(self) -> list[Op]:
        """Up to max_txn_ops queued ops, all deletes or all puts under one lease."""
        batch: list[Op] = []
        group: int | None = None
        for key, op in self._pending.items():
            if key in self._inflight:
                continue
            lease = op.lease if isinstance(op, Put) else -1
            if group is None:
                group = lease
            if lease == group:
                batch.append(op)
                if len(batch) >= self.config.max_txn_ops:
                    break
        for op in batch:
            del self._pending[op.key]
            self._inflight.add(op.key)
        return batch

    def _take_batch_locked(self) -> list[Op]:
        with self.lock:
            return self._take_batch()

    async def _flush_loop(self) -> None:
        backoff = self.config.etcd_retry_s
        slots = asyncio.Semaphore(self.config.max_inflight_txns)
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                await slots.acquire()
                batch = self._take_batch_locked()
                if not batch:
                    slots.release()
                    break  # the rest waits for in-flight keys; their completion wakes us
                task = asyncio.create_task(self._write(batch, slots))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                if self.healthy:
                    backoff = self.config.etcd_retry_s
                    continue
                await task  # etcd is down: probe with one batch at a time, backing off
                if not self.healthy:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)

    async def _write(self, batch: list[Op], slots: asyncio.Semaphore) -> None:
        try:
            await self.etcd.txn(batch)
            self._set_healthy(True)
        except LeaseNotFound:
            lease = batch[0].lease if isinstance(batch[0], Put) else 0
            log.info("lease %x expired with %d queued puts; dropping them", lease, len(batch))
            with self.lock:
                self.drop_lease_ops(lease)
                self._on_lease_lost(lease)
        except EtcdError as err:
            # The txn may or may not have been applied; puts and deletes are idempotent, so
            # write them again unless a newer change of the key was queued meanwhile.
            if isinstance(err, EtcdUnavailable):
                self._set_healthy(False)
            else:
                log.error("etcd txn failed: %s", err)
            with self.lock:
                for op in batch:
                    if op.key not in self._pending:
                        self._pending[op.key] = op
        finally:
            with self.lock:
                for op in batch:
                    self._inflight.discard(op.key)
            slots.release()
            self._wakeup.set()

    # ---- load and watch -------------------------------------------------------------

    async def load(self) -> Snapshot:
        kvs, revision = await self.etcd.get_prefix(self.keys.prefix)
        nodes, blocks = [], []
        for kv in kvs:
            change = self.keys.decode(kv.key, kv.value, True, kv.lease)
            if change is None:
                continue
            if change.node is not None:
                nodes.append(change.node)
            elif change.block is not None:
                blocks.append((change.node_id, change.block, change.lease))
        return Snapshot(nodes, blocks, revision)

    async def watch(self, start_revision: int) -> AsyncIterator[list[tuple[Change, bytes]]]:
        """Decoded changes (with their keys) from `start_revision` on; see EtcdClient.watch_prefix."""
        events: list[WatchEvent]
        async for events in self.etcd.watch_prefix(self.keys.prefix, start_revision, self.config.etcd_retry_s,
                                                    on_unavailable=lambda err: self.report_unreachable()):
            out = []
            for ev in events:
                change = self.keys.decode(ev.key, ev.value, ev.is_put, ev.lease)
                if change is not None:
                    out.append((change, ev.key))
            yield out


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
