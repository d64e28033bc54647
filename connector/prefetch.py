"""Prefetch on lookup: another node's disk blocks staged into its DRAM before the load.

Where it sits: when `PoolScheduler.num_matched_tokens` offers a run that includes DISK
copies held by other nodes, it hands them here (`offer`), and one thread asks each holder to
stage them (`kvpool.stage.stage`: the holder promotes them into its DRAM and publishes them
as DRAM). By the time the worker loads the run, the holder usually answers the load's own
stage request from DRAM at once. The load path does not depend on it: `NodePool.get` still
asks the holder to stage (answered from DRAM when the prefetch finished, or doing the disk
read itself when it did not) and validates what it reads against that answer, within the
load's bounds; a block not staged in time fails and is recomputed.

Never blocks its caller: requests wait in a bounded queue; one that finds it full is
dropped (counted), as is a block already prefetched lately (`recent`).

Threading: `offer` and `counters` from the scheduler thread; the stage requests run on this
module's own thread. One lock guards the queue and the counters.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvpool.stage import MAX_BLOCKS, StageError, stage

log = logging.getLogger(__name__)

StageCall = Callable[[str, Sequence[bytes], float], list]   # kvpool.stage.stage


@dataclass
class PrefetchStats:
    requests: int = 0      # stage requests queued (one per holder and run offered)
    blocks: int = 0        # blocks in them
    staged: int = 0        # blocks their holders answered staged (in DRAM now)
    failed: int = 0        # blocks not staged (the holder could not, or did not answer in time)
    dropped: int = 0       # stage requests dropped: the queue was full


class Prefetcher:
    def __init__(self, timeout_s: float, max_queued: int = 16, recent: int = 4096,
                 stage_fn: StageCall = stage) -> None:
        """`timeout_s`: bound of one stage request; `max_queued`: requests waiting at most;
        `recent`: hashes remembered as prefetched (not asked for again)."""
        self._timeout_s = timeout_s
        self._max_queued = max_queued
        self._recent_cap = recent
        self._stage = stage_fn
        self.stats = PrefetchStats()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[tuple[str, list[bytes]]] = deque()
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvpool-prefetch", daemon=True)
        self._thread.start()

    def offer(self, address: str, hashes: Sequence[bytes]) -> bool:
        """Queue a stage request of `hashes` to the holder at `address` (those not prefetched
        lately); False if it was dropped (the queue is full) or there was nothing to ask."""
        with self._lock:
            want = [h for h in hashes if h not in self._recent][:MAX_BLOCKS]
            if not want or not address or self._stop:
                return False
            if len(self._queue) >= self._max_queued:
                self.stats.dropped += 1
                return False
            for h in want:
                self._recent[h] = None
            while len(self._recent) > self._recent_cap:
                self._recent.popitem(last=False)
            self._queue.append((address, want))
            self.stats.requests += 1
            self.stats.blocks += len(want)
            self._work.notify()
            return True

    def counters(self) -> dict[str, float]:
        with self._lock:
            return {f"connector_prefetch_{k}": v for k, v in asdict(self.stats).items()}

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._queue.clear()
            self._work.notify()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._queue:
                    self._work.wait()
                if self._stop:
                    return
                address, hashes = self._queue.popleft()
            try:
                answers = self._stage(address, hashes, self._timeout_s)
            except (StageError, ValueError) as err:
                log.info("prefetch of %d disk blocks from %s failed: %s", len(hashes), address, err)
                answers = [None] * len(hashes)
            staged = sum(a is not None for a in answers)
            with self._lock:
                self.stats.staged += staged
                self.stats.failed += len(hashes) - staged
                if staged < len(hashes):  # may be asked for again by a later lookup
                    for h, a in zip(hashes, answers):
                        if a is None:
                            self._recent.pop(h, None)
