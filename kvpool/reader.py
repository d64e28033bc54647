"""Validated remote reads: transfer batches per source node, polled to completion.

Each block is read whole (header, then payload: one range) into a landing slot of this
node's read buffer, validated there, and only then copied to the caller's destination (the
engine's KV cache). The copy is what makes a failed read harmless: the Mooncake binding
reports a batch failed at its first failed range, or when its own time bound passes, while
other ranges of the batch may still be in flight or queued, and those keep writing into
their local addresses afterwards. A failed batch's landing slots are therefore quarantined
(never handed out again; counted in `PoolStats.quarantined_slots`), and a destination is
written only by this module's own copy of bytes that validated after a batch the engine
reported complete (then every range of it is done). So no byte of a failed, timed-out or
aborted transfer can reach a cache block the engine recomputed meanwhile or gave to another
request.

A batch is settled only once the transfer engine has answered for it, never at the caller's
deadline alone (the deadline fails batches never posted; a posted one is bounded by the
engine's own transfer timeout): a block is reported loaded or failed only when it is final.
A block is accepted only if the header's magic, hash and generation match the index's
promise and the payload's checksum matches the header; otherwise it is reported failed and
the caller recomputes it. Landing slots that sit back to back on both sides travel as one
range (`coalesce`).

The first transfer with a source makes the transfer engine's handshake with it, inside the
submit call: a frozen source (SIGSTOP, a hung host) accepts the connection and never answers,
and the call blocks for about a minute. So the caller's thread (the engine loop) never makes
first contact: `Peers` does it with a header-sized read into a landing slot on a thread of
its own, and the batch is posted only once that read returned and only if the caller has not
given up by then (its deadline passed: the blocks were reported failed and are being
recomputed).

Completion: the binding's only whole-batch status call spins until the batch is done. A
caller that blocks in `wait()` spins on it itself, unless it gave `wait` a timeout that ends
before the transfer engine's own time bound for the batch (its transfer timeout plus 1 ns
per byte): no thread handoff, which is most of a small read's time. Otherwise, and for callers that poll
`done()` (the engine loop, which must go on computing), one completion thread spins on them.
A long chain from one source goes as up to SPLIT batches, all posted at once and completed
in order, so the blocks of one are validated (checksummed) while the next is still in flight.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvpool.layout import HEADER_BYTES, HOST_MEMORY, CallerMemory, Payload, valid_block
from kvpool.stats import PoolStats
from kvpool.transfer import TransferEngine, TransferError
from metaserver.types import BlockLocation, NodeRecord

log = logging.getLogger(__name__)

SPLIT = 4        # batches per source for a long chain (validation overlaps the transfer)
MERGE_MAX_BYTES = 4 << 20  # merged ranges up to this size (see coalesce)
MIN_BATCH = 4    # blocks per batch at least


@dataclass(frozen=True, slots=True)
class ReadResult:
    ok: tuple[int, ...]      # request indices delivered and validated
    failed: tuple[int, ...]  # request indices to recompute


def batch_slices(n: int) -> list[slice]:
    """How a chain of `n` blocks from one source is cut into batches: up to SPLIT, each of
    MIN_BATCH blocks at least."""
    step = max(MIN_BATCH, -(-n // SPLIT))
    if n <= step:
        return [slice(0, n)]
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def coalesce(local: list[int], remote: list[int], lengths: list[int],
             max_bytes: int = MERGE_MAX_BYTES) -> tuple[list[int], list[int], list[int]]:
    """Merge ranges that continue one another on both sides into one range.

    Slots a source filled in a row sit back to back, as do the engine's cache blocks in slot
    strides, so a chain often is one contiguous run (header, payload, header, payload...) on
    both sides. The transfer engine pays per range (a request, then its 64 KiB slices in
    turn), so one range for the run moves the same bytes in fewer, fuller slices. Only for
    destinations in one registered region (a range must not cross registrations). Merged
    ranges stay under `max_bytes` (MERGE_MAX_BYTES): one 64 MiB range of 4 MiB blocks was
    slower than the same blocks as ranges of their own, which the engine spreads over its TCP
    lanes to the peer (docs/journal/benchmarks-history.md, "Node pool reads: `kvpool bench
    transfer`")."""
    if len(local) == 1:
        return local, remote, lengths
    out_l, out_r, out_n = [local[0]], [remote[0]], [lengths[0]]
    for lo, re, n in zip(local[1:], remote[1:], lengths[1:]):
        if lo == out_l[-1] + out_n[-1] and re == out_r[-1] + out_n[-1] and out_n[-1] + n <= max_bytes:
            out_n[-1] += n
        else:
            out_l.append(lo)
            out_r.append(re)
            out_n.append(n)
    return out_l, out_r, out_n


def batch_ranges(landing: list[int], slots: list[int], slot_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """The (local, remote, length) ranges one batch posts to read whole source slots (at
    remote addresses `slots`) into landing slots (at `landing`): one range per block, back-to-
    back blocks as one range (`coalesce`; the landing area is one registered region)."""
    return coalesce(landing, slots, [slot_bytes] * len(slots))


class Landing:
    """This node's read buffer: slots, each the size of a pool slot, where remote blocks land
    and are validated before they are copied on; registered with the transfer engine.

    Slots are handed out last-freed first, so the pages in use stay those of the deepest
    concurrency seen (the mapping is lazy). A slot that a failed transfer may still write
    into is never given back (`quarantine`): it is lost to reads, and counted."""

    def __init__(self, te: TransferEngine, num_slots: int, slot_bytes: int, stats: PoolStats) -> None:
        self._mem = mmap.mmap(-1, num_slots * slot_bytes)  # page-aligned, zeroed on first touch
        self._buf = np.frombuffer(self._mem, dtype=np.uint8)
        self.addr = self._buf.ctypes.data
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        te.register(self.addr, self._buf.nbytes)
        self._stats = stats
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int] | None:
        """`n` free slots (in address order, so neighbours coalesce), or None if fewer are free."""
        with self._lock:
            if len(self._free) < n:
                return None
            taken = self._free[-n:]
            del self._free[-n:]
            return sorted(taken)

    def slot_addr(self, i: int) -> int:
        return self.addr + i * self.slot_bytes

    @property
    def idle(self) -> bool:
        """No slot handed out, none quarantined (the buffer was never used, or all is back)."""
        with self._lock:
            return len(self._free) == self.num_slots

    def give(self, idx: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(sorted(idx, reverse=True))

    def quarantine(self, idx: Sequence[int]) -> None:
        """Slots a failed transfer may still write into: never handed out again."""
        if idx:
            with self._lock:
                self._stats.quarantined_slots += len(idx)
            log.warning("%d read-buffer slots quarantined after a failed transfer (%d of %d left)", len(idx),
                        len(self._free), self.num_slots)


class Peers:
    """Which sources the transfer engine has made contact with, and first contact off the
    caller's thread (one handshake at a time per source; later reads wait on it)."""

    def __init__(self, te: TransferEngine, landing: Landing) -> None:
        self._te = te
        self.landing = landing  # replaced once by NodePool.size_read_buffer, before any read
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self._pending: dict[str, Future[None]] = {}

    def known(self, session: str) -> bool:
        return session in self._known

    def contact(self, session: str, remote_addr: int) -> Future[None]:
        """Read the HEADER_BYTES at `remote_addr` of `session` (a slot header) into a landing slot on a
        daemon thread; the future fails with TransferError if the read did."""
        with self._lock:
            if session in self._known:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            if session in self._pending:
                return self._pending[session]
            fut = self._pending[session] = Future()
        threading.Thread(target=self._handshake, args=(session, remote_addr, fut), daemon=True,
                         name=f"handshake-{session}").start()
        return fut

    def _handshake(self, session: str, remote_addr: int, fut: Future[None]) -> None:
        taken = self.landing.take(1)
        err: TransferError | None = None
        if taken is None:
            err = TransferError("read buffer exhausted")
        else:
            try:
                self._te.read_sync(session, [self.landing.slot_addr(taken[0])], [remote_addr], [HEADER_BYTES])
                self.landing.give(taken)
            except TransferError as e:
                err = e
                self.landing.quarantine(taken)  # the failed read may still land there
        with self._lock:
            del self._pending[session]
            if err is None:
                self._known.add(session)
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)


@dataclass(slots=True)
class ReadContext:
    """What all reads of one node share."""
    te: TransferEngine
    completer: ThreadPoolExecutor  # threads that complete batches for callers that poll
    landing: Landing               # where remote blocks land and are validated before the copy
    peers: Peers                   # the sources the engine has made contact with
    stats: PoolStats
    timeout_s: float               # a read not finished by then fails
    memory: CallerMemory = HOST_MEMORY  # how validated blocks reach their destinations


class _State(Enum):
    """Where a `_Batch` is. Every transition happens under its handle's lock, and only forward:

        CONTACTING --post--> POSTED --hand off / complete inline--> COMPLETING --answer--> ANSWERED
        CONTACTING --first contact or submit fails--> REFUSED
        ANSWERED, REFUSED --validate, count--> SETTLED
        CONTACTING --past the read's deadline--> SETTLED (failed; nothing was submitted)

    A batch that reached POSTED settles only through ANSWERED, deadline or not: until the
    transfer engine answers, its bytes may still land (see `ReadHandle._poll`)."""
    CONTACTING = "contacting"  # nothing submitted yet: the first contact with the source is under way
    POSTED = "posted"          # the read into the landing slots was submitted; no thread completes it yet
    COMPLETING = "completing"  # a thread (the completer or a waiting caller) waits for the engine's answer
    ANSWERED = "answered"      # the transfer engine answered for every range (ok, or `error`)
    REFUSED = "refused"        # the first contact or the submit failed (`error`): nothing was submitted
    SETTLED = "settled"        # its blocks were validated and counted as ok or failed


@dataclass(slots=True)
class _Batch:
    session: str
    idx: list[int]            # the request's block indices it reads
    landing: list[int]        # landing slots, one per block, in the order of idx
    state: _State = _State.CONTACTING
    batch_id: int = 0         # the transfer engine's, once posted
    error: Exception | None = None  # why it failed, when it did
    late: bool = False        # posted and past the caller's deadline (logged once; settles when answered)
    nbytes: int = 0           # bytes the batch moves


class ReadHandle:
    """An in-flight `NodePool.get`. Poll `done()` or block in `wait()`; thread-safe.

    Block i of the request is `locations[i]`, its payload (`nbytes`) copied to `dests[i]` once
    it landed and validated; the handle keeps the caller's sequences, which must not change
    while the read is in flight. Destinations are written only on this handle's caller's
    threads (inside `done()` / `wait()`), never by the transfer engine.
    `sources` lists, per source node, the indices to read from it; `local_ok` and
    `local_failed` are indices this node's own pool has already served or could not.
    `deferred` is a read of this node's own disk tier running on another thread: it resolves
    to the indices of `deferred_idx` it delivered (validated, copied); the rest of them fail.
    The handle's result waits for it (as for a posted batch, there is no giving up on it: it
    writes destinations until it returns)."""

    def __init__(self, ctx: ReadContext, locations: Sequence[BlockLocation], dests: Sequence[Payload], nbytes: int,
                 sources: list[tuple[NodeRecord, list[int]]], local_ok: set[int] | None = None,
                 local_failed: Sequence[int] = (), on_progress: Callable[[], None] | None = None,
                 deferred: Future[set[int]] | None = None, deferred_idx: Sequence[int] = ()) -> None:
        self._ctx = ctx
        self._locations = locations
        self._dests = dests
        self._nbytes = nbytes
        self._on_progress = on_progress    # called when a batch finishes (the caller's wake-up)
        self._deadline = time.monotonic() + ctx.timeout_s
        # Reentrant: a handshake that is already done posts its batch inline, under the lock.
        self._lock = threading.RLock()
        self._finished: threading.Condition | None = None  # made by a caller that must block in wait()
        self._ok = set(local_ok or ())
        self._failed = set(local_failed)
        self._batches: list[_Batch] = []
        self._deferred_idx = tuple(deferred_idx)
        self._deferred_done = deferred is None
        self.result: ReadResult | None = None
        with self._lock:
            for node, idx in sources:
                for part in batch_slices(len(idx)):
                    self._submit_batch(node, idx[part])
            if deferred is not None:
                deferred.add_done_callback(self._after_deferred)
            if not self._batches:
                self._poll(hand_off=False)  # nothing to read remotely: the result is ready

    def _submit_batch(self, node: NodeRecord, idx: list[int]) -> None:
        landing = self._ctx.landing
        taken = landing.take(len(idx))
        if taken is None:
            log.warning("read buffer exhausted (%d slots); %d blocks from %s fail", landing.num_slots, len(idx),
                        node.node_id)
            self._failed.update(idx)
            self._ctx.stats.failed_reads += len(idx)
            return
        base, locations = node.buffer_address, self._locations
        local, remote, lengths = batch_ranges([landing.slot_addr(t) for t in taken],
                                              [base + locations[i].offset for i in idx], landing.slot_bytes)
        batch = _Batch(node.session_address, idx, taken, nbytes=sum(lengths))
        self._batches.append(batch)
        peers = self._ctx.peers
        if peers.known(node.session_address):
            self._post(batch, local, remote, lengths, hand_off=False)
            return
        contact = peers.contact(node.session_address, remote[0])
        contact.add_done_callback(lambda f: self._after_contact(f, batch, local, remote, lengths))

    def _after_contact(self, contact: Future[None], batch: _Batch, local: list[int], remote: list[int],
                       lengths: list[int]) -> None:
        with self._lock:
            if batch.state is _State.SETTLED:  # the caller gave up meanwhile: nothing was posted, nothing will land
                return
            err = contact.exception()
            if err is not None:
                self._finish(batch, err)
            else:
                self._post(batch, local, remote, lengths)

    def _post(self, batch: _Batch, local: list[int], remote: list[int], lengths: list[int],
              hand_off: bool = True) -> None:
        try:
            batch.batch_id = self._ctx.te.submit_read(batch.session, local, remote, lengths)
        except TransferError as err:
            self._finish(batch, err)
            return
        batch.state = _State.POSTED
        if hand_off:
            self._hand_off([batch])

    def _after_deferred(self, fut: Future[set[int]]) -> None:
        """The disk read finished (on its thread, or inline if it already had)."""
        err = fut.exception()
        if err is not None:
            log.error("disk read of %d blocks failed: %s", len(self._deferred_idx), err)
        ok = set() if err is not None else fut.result()
        with self._lock:
            self._ok.update(ok)
            self._failed.update(i for i in self._deferred_idx if i not in ok)
            self._deferred_done = True
            self._set_result_if_settled()
            if self._finished is not None:
                self._finished.notify_all()
        if self._on_progress is not None:
            self._on_progress()

    def _finish(self, batch: _Batch, err: Exception | None) -> None:
        with self._lock:
            batch.error = err
            # A thread completes only posted batches; the others failed before anything was submitted.
            batch.state = _State.ANSWERED if batch.state is _State.COMPLETING else _State.REFUSED
            if self._finished is not None:
                self._finished.notify_all()
        if self._on_progress is not None:
            self._on_progress()

    def _hand_off(self, batches: list[_Batch]) -> None:
        """One completion thread completes `batches` in order."""
        for b in batches:
            b.state = _State.COMPLETING
        self._ctx.completer.submit(self._complete_in_order, batches)

    def _complete_in_order(self, batches: list[_Batch]) -> None:
        for b in batches:
            self._finish(b, self._complete(b))

    def _complete(self, batch: _Batch) -> TransferError | None:
        try:
            self._ctx.te.complete(batch.batch_id)
        except TransferError as err:
            return err
        return None

    def _complete_inline(self, end: float | None) -> None:
        """Complete the posted batches no thread completes yet on this (waiting) thread. A
        posted batch settles only when the transfer engine answers, whatever the read's
        deadline, so the caller waits for that anyway; only a caller's own `wait` timeout
        shorter than the engine's bound sends them to the completion thread."""
        timeout_s = self._ctx.te.config.transfer_timeout_s
        with self._lock:
            mine = [b for b in self._batches if b.state is _State.POSTED]
            # The engine's bound runs from the submit, which is past: from now it is an upper bound.
            if not mine or (end is not None and time.monotonic() + timeout_s + max(b.nbytes for b in mine) * 1e-9
                            >= end):
                return
            for b in mine:
                b.state = _State.COMPLETING
        for b in mine:
            err = self._complete(b)
            with self._lock:  # validate it while the next batch is still in flight
                self._finish(b, err)  # (wakes other threads blocked in wait())
                if b.state is not _State.SETTLED:  # (a poller on another thread may have timed it out meanwhile)
                    self._settle_finished(b)
                self._set_result_if_settled()

    def _settle(self, batch: _Batch, ok: bool) -> None:
        """Validate a finished batch's blocks in their landing slots, copy the valid ones to
        their destinations (or fail them all), count them, and free or quarantine the slots."""
        posted = batch.state is _State.ANSWERED  # (a batch settles unanswered only if never posted)
        batch.state = _State.SETTLED
        good, bad, stats, landing = self._ok, self._failed, self._ctx.stats, self._ctx.landing
        if not ok:
            bad.update(batch.idx)
            stats.failed_reads += len(batch.idx)
            if posted:  # ranges of it may still be in flight or queued: they land in quarantine
                landing.quarantine(batch.landing)
            else:
                landing.give(batch.landing)
            return
        dests, locations, n = self._dests, self._locations, self._nbytes
        for i, slot in zip(batch.idx, batch.landing):
            loc, header = locations[i], landing.slot_addr(slot)
            if valid_block(header, header + HEADER_BYTES, n, loc.block_hash, loc.generation):
                self._ctx.memory.write(dests[i], header + HEADER_BYTES, n)
                good.add(i)
                stats.remote_hits += 1
                stats.bytes_read += n
            else:
                log.warning("block %s from %s did not validate (evicted or rewritten at the source)",
                            loc.block_hash[:8].hex(), batch.session)
                bad.add(i)
                stats.failed_reads += 1
        landing.give(batch.landing)  # the engine reported every range done: nothing more lands

    def _poll(self, hand_off: bool = True) -> None:
        """Settle the batches that finished (or all that did not, past the deadline); hand the
        posted ones nobody completes yet to the completion thread; set the result when all
        are settled. Called with the lock held."""
        expired = None
        unsettled = 0
        unclaimed = []
        for b in self._batches:
            if b.state is _State.SETTLED:
                continue
            if b.state is _State.ANSWERED or b.state is _State.REFUSED:
                self._settle_finished(b)
                continue
            if expired is None:
                expired = time.monotonic() > self._deadline
            if expired and b.state is _State.CONTACTING:  # nothing was handed to the transfer engine: nothing lands
                log.warning("read of %d blocks from %s timed out before it was posted", len(b.idx), b.session)
                self._settle(b, False)
                continue
            # A posted batch settles only once the transfer engine has answered for it, deadline
            # or not: until then its bytes may still land in the destinations, and a caller told
            # "failed" recomputes (or hands on) those blocks, which a late landing would then
            # overwrite. The engine's own bound (its transfer timeout) ends the wait.
            if expired and not b.late:
                b.late = True
                log.warning("read of %d blocks from %s is past its deadline; waiting for the transfer engine's "
                            "answer before the blocks are released", len(b.idx), b.session)
            unsettled += 1
            if b.state is _State.POSTED:
                unclaimed.append(b)
        if hand_off and unclaimed:
            self._hand_off(unclaimed)
        if not unsettled:
            self._set_result_if_settled()

    def _settle_finished(self, b: _Batch) -> None:
        if b.error is not None:
            log.warning("read of %d blocks from %s failed: %s", len(b.idx), b.session, b.error)
        self._settle(b, b.error is None)

    def _set_result_if_settled(self) -> None:
        if self.result is None and self._deferred_done and all(b.state is _State.SETTLED for b in self._batches):
            self.result = ReadResult(tuple(sorted(self._ok)), tuple(sorted(self._failed)))

    def done(self) -> bool:
        with self._lock:
            if self.result is None:
                self._poll()
            return self.result is not None

    def wait(self, timeout_s: float | None = None) -> ReadResult:
        """Block until every block is delivered or failed (TimeoutError after `timeout_s`)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        self._complete_inline(end)
        if self.result is not None:  # set once, never changed
            return self.result
        with self._lock:
            while self.result is None:
                self._poll()
                if self.result is not None:
                    break
                now = time.monotonic()
                # Past the deadline only posted batches are left: the completer's answer wakes us.
                limit = self._deadline - now if now <= self._deadline else 3600.0
                if end is not None:
                    if now > end:
                        raise TimeoutError("read not finished")
                    limit = min(limit, end - now)
                if self._finished is None:
                    self._finished = threading.Condition(self._lock)
                self._finished.wait(max(limit, 0.0) + 1e-3)
            return self.result
