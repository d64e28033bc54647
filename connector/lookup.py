"""Prefix lookups off the host's scheduler thread, batched, behind a circuit breaker.

Where it sits: the pool connector's scheduler half submits a lookup when a request arrives
(or is first asked about) and polls it while the host schedules; the host is never blocked
by the metaserver. One thread sends every lookup queued since its last call as one
QueryPrefixBatch, so the metaserver sees a number of calls bounded by the nodes' steps and
its own latency, not by their requests. Lookups are sparse (every block of the chain the
index holds, not only the prefix from block 0): they are sent before the host knows its
local hit, and the blocks it needs are those after it.

Circuit breaker: after `breaker_failures` consecutive failed or timed-out calls the breaker
opens: lookups answer "no remote hit" at once, without an RPC. While it is open the thread
probes the metaserver (an empty batch) every `probe_interval_s`; the first answer closes
it. Transitions are logged and counted (`counters()`), the state is a gauge.

Failed reads: `report_failed_read` queues a report that the same thread sends before its
next batch (`MetaClient.report_failed_read`: the metaserver stops offering a source that did
not answer, or drops stale copies), so other readers do not pay the same failed read.

Threading: `submit`, `poll`, `forget` are called by the host's scheduler thread; results
are filled in by the lookup thread; one lock guards both, and an Event tells a waiting
host that some result arrived.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from metaserver.client import MetaClient
from metaserver.errors import MetaError
from metaserver.types import QueryResult

log = logging.getLogger(__name__)

MAX_BATCH = 256   # lookups in one RPC (the server takes up to 1024)


class LookupState(enum.Enum):
    PENDING = "pending"     # in flight: ask again later
    DONE = "done"           # answered (possibly with no hit)
    MISS = "miss"           # failed, timed out, past its deadline or the breaker is open: no remote hit


@dataclass
class LookupStats:
    queries: int = 0            # lookups sent to the metaserver
    batches: int = 0            # RPCs that carried them
    query_errors: int = 0       # lookups answered "no hit" because their RPC failed (before the deadline)
    deadline_misses: int = 0    # lookups the host stopped waiting for (past the deadline)
    breaker_skips: int = 0      # lookups answered "no hit" by the open breaker, without an RPC
    breaker_opens: int = 0
    breaker_closes: int = 0
    breaker_open: int = 0       # gauge: 1 while open
    failed_read_reports: int = 0  # failed reads reported to the metaserver


class Lookups:
    def __init__(self, client: MetaClient, namespace: str, requester: str, timeout_s: float, deadline_s: float,
                 breaker_failures: int = 3, probe_interval_s: float = 0.5) -> None:
        """`timeout_s`: deadline of one RPC; `deadline_s`: how long the host waits for a
        lookup before it goes on with its local hit only."""
        self._client = client
        self._namespace = namespace
        self._requester = requester
        self._timeout_s = timeout_s
        self._deadline_s = deadline_s
        self._breaker_failures = breaker_failures
        self._probe_interval_s = probe_interval_s
        self.stats = LookupStats()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self.answered = threading.Event()      # set whenever a result arrives (a waiting host wakes)
        self._queued: dict[str, tuple[bytes, ...]] = {}   # not sent yet
        self._reports: list[tuple[str, list[bytes]]] = []  # failed reads not reported yet
        self._submitted: dict[str, float] = {}            # request id -> submit time, until forgotten
        self._results: dict[str, QueryResult | None] = {}  # None: failed
        self._failures = 0                                 # consecutive failed calls
        self._open = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvpool-lookup", daemon=True)
        self._thread.start()

    # ---- the host's side ------------------------------------------------------------

    def submit(self, request_id: str, chain: Sequence[bytes]) -> None:
        """Start a lookup of `chain` for the request (replacing one not answered yet)."""
        with self._lock:
            self._results.pop(request_id, None)
            self._submitted[request_id] = time.monotonic()
            if self._open:
                self.stats.breaker_skips += 1
                self._results[request_id] = None
                return
            self._queued[request_id] = tuple(chain)
            self._work.notify()

    def poll(self, request_id: str) -> tuple[LookupState, QueryResult | None]:
        """Where the request's lookup stands; MISS once it is past the deadline unanswered."""
        with self._lock:
            if request_id in self._results:
                res = self._results[request_id]
                return (LookupState.DONE, res) if res is not None else (LookupState.MISS, None)
            started = self._submitted.get(request_id)
            if started is None:
                return LookupState.MISS, None
            if time.monotonic() - started > self._deadline_s:
                self.stats.deadline_misses += 1
                self._results[request_id] = None  # a late answer is dropped
                self._queued.pop(request_id, None)
                log.info("lookup for %s past its %.0f ms deadline: local hit only", request_id, 1e3 * self._deadline_s)
                return LookupState.MISS, None
            return LookupState.PENDING, None

    def report_failed_read(self, source: str, hashes: Sequence[bytes]) -> None:
        """Queue a failed-read report (no hashes: the source did not answer at all); sent by
        the lookup thread, dropped while the breaker is open (the metaserver is not answering)."""
        with self._lock:
            if not self._open:
                self._reports.append((source, list(hashes)))
                self._work.notify()

    def submitted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._submitted

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._submitted.pop(request_id, None)
            self._queued.pop(request_id, None)
            self._results.pop(request_id, None)

    def wait(self, timeout_s: float) -> None:
        """Block until some lookup is answered or `timeout_s` passed (a host with nothing else
        to do waits here instead of spinning)."""
        self.answered.wait(timeout_s)
        self.answered.clear()

    def counters(self) -> dict[str, float]:
        with self._lock:
            return {f"lookup_{k}": v for k, v in asdict(self.stats).items()}

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._work.notify()
        self._thread.join(5)

    # ---- the lookup thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._open and not self._queued and not self._reports:
                    self._work.wait()
                if self._stop:
                    return
                probing = self._open
                reports, self._reports = ([], self._reports) if probing else (self._reports, [])
                batch = [] if probing else list(self._queued.items())[:MAX_BATCH]
                for rid, _ in batch:
                    del self._queued[rid]
            if probing:
                time.sleep(self._probe_interval_s)
            self._report(reports)
            if batch or probing:
                self._call(batch)

    def _report(self, reports: list[tuple[str, list[bytes]]]) -> None:
        for source, hashes in reports:
            try:
                self._client.report_failed_read(source, hashes, self._requester, timeout_s=self._timeout_s)
            except MetaError as err:  # the report is a hint: the reader's own negative cache still holds
                log.info("could not report failed reads from %s: %s", source, err)
                continue
            with self._lock:
                self.stats.failed_read_reports += 1

    def _call(self, batch: list[tuple[str, tuple[bytes, ...]]]) -> None:
        try:
            results: list[QueryResult | None] = list(self._client.query_prefix_batch(
                [(self._namespace, chain) for _, chain in batch], self._requester, timeout_s=self._timeout_s,
                sparse=True))
            ok = True
        except MetaError as err:
            if batch:
                log.warning("lookup of %d chains failed, computing locally: %s", len(batch), err)
            results, ok = [None] * len(batch), False
        with self._lock:
            self.stats.batches += bool(batch)
            self.stats.queries += len(batch)
            for (rid, _), res in zip(batch, results):
                if rid in self._submitted and rid not in self._results:  # not forgotten, not past its deadline
                    self._results[rid] = res
                    self.stats.query_errors += res is None
            self._breaker(ok)
        if batch:
            self.answered.set()

    def _breaker(self, ok: bool) -> None:
        """Count the call's outcome; open or close the breaker. Called with the lock held."""
        if ok:
            self._failures = 0
            if self._open:
                self._open = False
                self.stats.breaker_closes += 1
                self.stats.breaker_open = 0
                log.warning("metaserver answers again: lookup breaker closed")
            return
        self._failures += 1
        if not self._open and self._failures >= self._breaker_failures:
            self._open = True
            self.stats.breaker_opens += 1
            self.stats.breaker_open = 1
            for rid in self._queued:  # queued meanwhile: answered at once
                self._results[rid] = None
            self.stats.breaker_skips += len(self._queued)
            self._queued.clear()
            log.warning("lookup breaker open after %d failed calls: no remote hits until the metaserver answers",
                        self._failures)
