"""Asynchronous, batched publication of a node's new blocks to the metaserver.

Where it sits: `NodePool.put` enqueues a record and returns; a daemon thread sends
records in batches (at most `publish_batch`, at least every `publish_interval_s`), dropping
those whose slot was reused meanwhile so the index never learns of an evicted block from
us. A failed Publish is logged and dropped: the node re-publishes all it holds whenever it
registers again, and a missing entry only costs a miss.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvpool.config import PoolConfig
from kvpool.stats import PoolStats
from metaserver.client import MetaClient
from metaserver.errors import MetaError
from metaserver.types import BlockRecord

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
            self._send([r for r in batch if self._is_current(r)])
            with self._lock:
                self._pending -= len(batch)
                if self._pending == 0:
                    self._idle.set()
            if stop:
                return

    def _send(self, records: list[BlockRecord]) -> None:
        if not records:
            return
        try:
            self._stats.published += self._client.publish(self._config.node_id, records)
        except MetaError as err:
            log.warning("node %s: publish of %d blocks failed: %s", self._config.node_id, len(records), err)
            self._on_failure()
