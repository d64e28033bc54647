"""Asynchronous, batched publication of a node's new blocks to the metaserver.

Where it sits: `NodePool.put` enqueues a record and returns; a daemon thread sends
records in batches (at most `publish_batch`, at least every `publish_interval_s`), dropping
those whose slot was reused meanwhile so the index never learns of an evicted block from
us. A failed Publish is logged and dropped: the node re-publishes all it holds whenever it
registers again, and a missing entry only costs a miss.

Ordering with evictions: a record found current is sent a moment later, and the pool may
evict its block in between. The metaserver applies Publish and Unpublish in the order they
arrive (by hash, no generation check), so an Unpublish that overtook the Publish left the
evicted block in the index for good. Each record's hash is therefore marked in flight
*before* its is-current check and unmarked once its Publish returned; the pool calls
`wait_sent` with the hashes it is about to unpublish, so that Unpublish is sent only after
any Publish of the same blocks was answered. (Mark first, then check: an eviction that took
the block before the check makes the check fail; one that took it after finds the mark.)
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable

from kvpool.config import PoolConfig
from kvpool.stats import PoolStats
from metaserver.client import MetaClient
from metaserver.errors import MetaError
from metaserver.types import BlockHash, BlockRecord

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, client: MetaClient, config: PoolConfig, is_current: Callable[[BlockRecord], bool],
                 stats: PoolStats, on_failure: Callable[[], None] = lambda: None) -> None:
        self._client = client
        self._on_failure = on_failure  # a failed publish: the session re-publishes everything later
        self._config = config
        self._is_current = is_current
        self._stats = stats
        self._queue: queue.Queue[BlockRecord | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"publish-{config.node_id}", daemon=True)
        self._idle = threading.Event()
        self._idle.set()
        # Records queued and not yet sent (or dropped as stale). Idle is set only when this
        # reaches 0 under the lock: checking the queue and then setting idle raced with an
        # enqueue in between, and a flush returned before that record was sent.
        self._lock = threading.Lock()
        self._pending = 0
        # Hashes of records being checked or sent (see the module doc), under the same lock;
        # `_sent` is notified whenever some leave.
        self._in_flight: Counter[BlockHash] = Counter()
        self._sent = threading.Condition(self._lock)

    def start(self) -> None:
        self._thread.start()

    def enqueue(self, record: BlockRecord) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put(record)

    @property
    def idle(self) -> bool:
        """Nothing queued or being sent."""
        return self._idle.is_set()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far was sent (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    def wait_sent(self, hashes: Iterable[BlockHash]) -> bool:
        """Block until no Publish of any of `hashes` is being checked or sent (called before
        their Unpublish). Returns whether it waited. Bounded by the Publish's own deadline
        (with a margin): a publisher stuck past that is logged and not waited for further."""
        want = set(hashes)
        with self._lock:
            if want.isdisjoint(self._in_flight):
                return False
            self._stats.unpublish_waits += 1
            if not self._sent.wait_for(lambda: want.isdisjoint(self._in_flight), self._client.timeout_s + 5.0):
                log.warning("node %s: a publish of blocks being evicted did not return in time; unpublishing anyway",
                            self._config.node_id)
            return True

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            try:
                while len(batch) < self._config.publish_batch:
                    rec = self._queue.get(timeout=self._config.publish_interval_s)
                    if rec is None:
                        stop = True
                        break
                    batch.append(rec)
            except queue.Empty:
                pass
            try:
                self._send(self._claim(batch))
            finally:
                with self._lock:
                    for r in batch:
                        left = self._in_flight[r.block_hash] - 1
                        if left:
                            self._in_flight[r.block_hash] = left
                        else:
                            del self._in_flight[r.block_hash]
                    self._sent.notify_all()
                    self._pending -= len(batch)
                    if self._pending == 0:
                        self._idle.set()
            if stop:
                return

    def _claim(self, batch: list[BlockRecord]) -> list[BlockRecord]:
        """The batch's records that are current, every one of them marked in flight first (the
        caller unmarks the whole batch after the send)."""
        with self._lock:
            self._in_flight.update(r.block_hash for r in batch)
        return [r for r in batch if self._is_current(r)]

    def _send(self, records: list[BlockRecord]) -> None:
        if not records:
            return
        try:
            self._stats.published += self._client.publish(self._config.node_id, records)
        except MetaError as err:
            log.warning("node %s: publish of %d blocks failed: %s", self._config.node_id, len(records), err)
            self._on_failure()
