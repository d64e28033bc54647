"""Saves off the host's thread: a copier thread moves newly full cache blocks into the pool.

Where it sits: the worker half queues a step's saves after the forward pass (`enqueue`) and
returns at once; the copier thread copies each block into the node pool (`NodePool.put`,
which publishes the block only once its bytes and checksum are in the slot). On CPU the
copier reads the cache itself (the copy releases the GIL). On CUDA (`use_staging`, with
`connector.device_memory.CudaStaging`) `enqueue` copies each block device-to-host into a
pinned staging slot on its own stream, ordered after the forward pass, with an event; the
copier waits on that event and puts the staged bytes.

The one hazard: the host may reuse a cache block (evicted from its prefix cache and handed
to another request, or the destination of a load) while its save is queued or being copied,
and the copy would then save the new bytes under the old hash. So before every step's forward
pass (and its loads) the worker calls `fence(blocks the step writes)`: queued saves of those
blocks are dropped (counted), and a copy of one of them in progress is waited for (that one
copy only). The host's step never waits for anything else. With staging, a queued save's
bytes are already on their way to its staging slot: the fence keeps it and makes the device
wait for that copy's event before the forward pass writes the block (the host does not wait).

Throttling: at most `max_pending` blocks wait; a save beyond that is dropped (counted), never
waited for: the pool may miss a block, decode never stalls on it. Saves queued with `force`
(a P/D send: a few blocks the host holds for it) are never dropped for that. `after(fn)`
queues a call that runs on the copier once every save queued before it is done.

Thread-safe: one condition guards the queue and the block being copied.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.layout import Payload

log = logging.getLogger(__name__)


@dataclass
class SaverStats:
    saves_queued: int = 0           # blocks handed to the copier
    saves_copied: int = 0           # blocks the copier put into the pool (new there)
    saves_dropped_behind: int = 0   # not queued: the copier had max_pending blocks waiting
    saves_dropped_reused: int = 0   # dropped from the queue: the host reused the cache block first
    fence_waits: int = 0            # steps that waited for a copy in progress of a block they write


@dataclass(frozen=True, slots=True)
class _Save:
    block_id: int           # the host's cache block (what a fence names)
    block_hash: bytes
    payload: Payload        # where the block's bytes are in the cache (with staging: its staging slot)
    then: Callable[[], None] | None = None   # a marker (`after`): call this instead of saving
    event: Any = None       # with staging: the event that completes the copy into `payload`


class Staging(Protocol):
    """Where saves are copied at `enqueue` when the copier cannot read the cache itself (a GPU
    cache: `connector.device_memory.CudaStaging`)."""

    def stage(self, payloads: Sequence[Payload]) -> tuple[list[int], Any]: ...
    def wait(self, event: Any) -> None: ...                  # noqa: ANN401 - the host waits for the copies
    def order_before_writes(self, event: Any) -> None: ...   # noqa: ANN401 - the next forward pass waits
    def release(self, addr: int) -> None: ...


class Saver:
    def __init__(self, put: Callable[[bytes, Payload, int], bool], block_bytes: int, max_pending: int) -> None:
        """`put(hash, payload, nbytes)`: the pool's put (True if the block was new there);
        `max_pending`: the connector's `save_queue_blocks` setting."""
        self._put = put
        self._block_bytes = block_bytes
        self.max_pending = max_pending
        self.stats = SaverStats()
        self._cond = threading.Condition()
        self._queue: deque[_Save] = deque()
        self._copying: int | None = None   # block id being copied now
        self._stop = False
        self._staging: Staging | None = None
        self._staged: _Save | None = None  # with staging: the save the copier has taken
        self._thread = threading.Thread(target=self._run, name="kvpool-saver", daemon=True)
        self._thread.start()

    # ---- the host's side ------------------------------------------------------------

    def use_staging(self, staging: Staging) -> None:
        """Stage every save at `enqueue` (before the first one)."""
        self._staging = staging

    def enqueue(self, saves: Iterable[tuple[int, bytes, Payload]], force: bool = False) -> None:
        """Queue (block id, hash, payload) saves; those beyond `max_pending` are dropped
        (unless `force`), and with staging those beyond its free slots too."""
        with self._cond:
            taken = []
            for block_id, h, payload in saves:
                if len(self._queue) + len(taken) >= self.max_pending and not force:
                    self.stats.saves_dropped_behind += 1
                    continue
                taken.append(_Save(block_id, h, payload))
            if taken and self._staging is not None:
                addrs, event = self._staging.stage([s.payload for s in taken])
                self.stats.saves_dropped_behind += len(taken) - len(addrs)
                taken = [_Save(s.block_id, s.block_hash, a, event=event) for s, a in zip(taken, addrs)]
            self._queue.extend(taken)
            self.stats.saves_queued += len(taken)
            self._cond.notify_all()

    def after(self, then: Callable[[], None]) -> None:
        """Call `then` on the copier thread once every save queued so far is done."""
        with self._cond:
            self._queue.append(_Save(-1, b"", 0, then))
            self._cond.notify_all()

    def fence(self, block_ids: Iterable[int]) -> None:
        """The host is about to write `block_ids`: no save may read them afterwards."""
        ids = set(block_ids)
        if not ids:
            return
        with self._cond:
            if self._staging is not None:
                # Staged saves read the block on the device, already queued there: the forward pass
                # waits for them on the device (the save being put now too: its copy may not be done).
                saves = [*self._queue, *([self._staged] if self._staged is not None else [])]
                for event in {id(s.event): s.event for s in saves if s.block_id in ids and s.event is not None}.values():
                    self._staging.order_before_writes(event)
                return
            if self._queue:
                kept = deque(s for s in self._queue if s.then is not None or s.block_id not in ids)
                self.stats.saves_dropped_reused += len(self._queue) - len(kept)
                self._queue = kept
            if self._copying in ids:
                self.stats.fence_waits += 1
                self._cond.wait_for(lambda: self._copying not in ids)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save is copied; False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._copying is None, timeout_s)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._copying is not None)

    def close(self) -> None:
        """Stop after the copy in progress; queued saves are dropped."""
        with self._cond:
            self._stop = True
            dropped, self._queue = self._queue, deque()
            self._cond.notify_all()
        self._thread.join(10)
        if self._staging is not None:
            for save in dropped:
                if save.event is not None:
                    self._staging.release(save.payload)

    # ---- the copier thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._queue)
                if self._stop:
                    return
                save = self._queue.popleft()
                self._copying = save.block_id if save.then is None else None
                self._staged = save if save.event is not None else None
            if save.then is not None:
                try:
                    save.then()
                except Exception:  # noqa: BLE001 - the copier goes on
                    log.exception("a call queued after the saves failed")
                continue
            try:
                if save.event is not None:
                    assert self._staging is not None
                    self._staging.wait(save.event)
                new = self._put(save.block_hash, save.payload, self._block_bytes)
            except Exception:  # noqa: BLE001 - a failed save loses one block; the copier goes on
                log.exception("saving block %d into the pool failed", save.block_id)
                new = False
            finally:
                if save.event is not None:
                    assert self._staging is not None
                    self._staging.release(save.payload)
            with self._cond:
                self._copying = None
                self._staged = None
                self.stats.saves_copied += bool(new)
                self._cond.notify_all()
