"""Reader logic with a scripted transfer engine (fast; the real engine is in test_pool.py):
what happens to reads queued behind a first contact that fails, batching per source and in
splits, validation block by block, and the guard against late writes: a failed transfer's
bytes land in quarantined landing slots, never in a destination."""
from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from kvpool.layout import HEADER_BYTES, MAGIC, SlotHeader, checksum, slot_bytes_for
from kvpool.stats import PoolStats
from kvpool.reader import Landing, Peers, ReadContext, ReadHandle, ReadResult, coalesce
from kvpool.transfer import TransferError
from metaserver.types import BlockLocation, NodeId, NodeRecord
from tests.kvpool.hooks import contacting

SESSION = "127.0.0.1:1"


class ScriptedEngine:
    """Answers the calls the reader makes; the first contact's read fails while `contact_fails`."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(transfer_timeout_s=1)
        self.contact_fails = True
        self.contacts = 0
        self.submitted: list[list[int]] = []
        self.release = threading.Event()  # holds the contact read until the test lets it go

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def read_sync(self, session, local, remote, lengths) -> None:
        self.contacts += 1
        self.release.wait(10)
        if self.contact_fails:
            raise TransferError("batch read of 1 ranges returned -1")

    def submit_read(self, session, local, remote, lengths) -> int:
        self.submitted.append(list(local))
        return len(self.submitted)

    def complete(self, batch_id: int) -> None:
        pass


def test_failed_first_contact_fails_its_reads_posts_nothing_and_the_next_read_tries_again() -> None:
    te = ScriptedEngine()
    stats = PoolStats()
    landing = Landing(te, 32, slot_bytes_for(64), stats)
    peers = Peers(te, landing)
    node = NodeRecord(NodeId("src"), SESSION, 1 << 20, 1 << 20, "ns", 1, 10)
    dest = np.zeros(8 * 64, dtype=np.uint8)
    locs = [BlockLocation(bytes([i]) * 16, NodeId("src"), i * 128, 64, 1) for i in range(8)]
    dests = [dest.ctypes.data + i * 64 for i in range(8)]
    with ThreadPoolExecutor(1) as completer:
        ctx = ReadContext(te, completer, landing, peers, stats, 5)
        handle = ReadHandle(ctx, locs, dests, 64, [(node, list(range(8)))])
        assert contacting(peers, SESSION) and not peers.known(SESSION)
        te.release.set()
        res = handle.wait(10)
        assert res.ok == () and res.failed == tuple(range(8))
        assert not contacting(peers, SESSION) and not peers.known(SESSION)
        assert te.submitted == [], "a read queued behind a failed contact was posted"
        assert stats.failed_reads == 8 and stats.remote_hits == 0

        te.contact_fails = False  # the source answers again: a new read makes contact anew
        handle = ReadHandle(ctx, locs, dests, 64, [(node, list(range(8)))])
        handle.wait(10)
        assert te.contacts == 2 and peers.known(SESSION)
        assert len(te.submitted) == 2  # 8 blocks from one source: two batches of MIN_BATCH


class LandedEngine(ScriptedEngine):
    """Every read lands at once: submit_read copies the remote ranges (real addresses in the
    test's source memory) to the local ones; records what was posted."""

    def __init__(self) -> None:
        super().__init__()
        self.contact_fails = False
        self.release.set()
        self.sessions: list[str] = []
        self.ranges: list[list[tuple[int, int, int]]] = []

    def submit_read(self, session, local, remote, lengths) -> int:
        self.sessions.append(session)
        self.ranges.append(list(zip(local, remote, lengths)))
        for lo, re, n in zip(local, remote, lengths):
            ctypes.memmove(lo, re, n)
        return super().submit_read(session, local, remote, lengths)


def _source(n: int, payload: int, stale: set[int], first_slot: int = 0) -> tuple[np.ndarray, NodeRecord,
                                                                               list[BlockLocation]]:
    """A source's pool memory: `n` blocks in slots first_slot.. (header + payload), and the
    index's locations for them; blocks in `stale` carry the next generation (the source
    rewrote the slot after the index learnt of it)."""
    slot = slot_bytes_for(payload)
    mem = np.zeros((first_slot + n + 1) * slot, dtype=np.uint8)
    rng = np.random.default_rng(7)
    locs = []
    for i in range(n):
        h, off = bytes([i + 1]) * 32, (first_slot + i) * slot
        body = mem[off + HEADER_BYTES:off + HEADER_BYTES + payload]
        body[:] = rng.integers(0, 255, payload, dtype=np.uint8)
        mem[off:off + HEADER_BYTES] = np.frombuffer(
            SlotHeader(MAGIC, 5 + (i in stale), payload, checksum(body.ctypes.data, payload), h).pack(), dtype=np.uint8)
        locs.append(BlockLocation(h, NodeId("src"), off, HEADER_BYTES + payload, 5))
    node = NodeRecord(NodeId("src"), SESSION, mem.ctypes.data, mem.nbytes, "ns", 1, 10)
    return mem, node, locs


def _payload(mem: np.ndarray, loc: BlockLocation, payload: int) -> bytes:
    return mem[loc.offset + HEADER_BYTES:loc.offset + HEADER_BYTES + payload].tobytes()


def _context(te: ScriptedEngine, completer: ThreadPoolExecutor, sessions: list[str], payload: int,
             timeout_s: float = 5, stats: PoolStats | None = None, slots: int = 32) -> ReadContext:
    """A reader's context whose peers have made contact with `sessions`."""
    stats = stats or PoolStats()
    landing = Landing(te, slots, slot_bytes_for(payload), stats)
    peers = Peers(te, landing)
    peers._known.update(sessions)
    return ReadContext(te, completer, landing, peers, stats, timeout_s)


def test_blocks_from_two_sources_go_as_one_batch_each_are_validated_one_by_one_and_copied() -> None:
    te = LandedEngine()
    mem, src, locs = _source(6, 256, stale={3})
    nodes = [NodeRecord(NodeId(f"n{k}"), f"127.0.0.1:{k + 1}", src.buffer_address, mem.nbytes, "ns", 1, 10)
             for k in range(2)]
    locs = [BlockLocation(loc.block_hash, NodeId(f"n{i % 2}"), loc.offset, loc.size_bytes, 5)
            for i, loc in enumerate(locs)]
    dest = np.zeros(6 * 256, dtype=np.uint8)
    stats = PoolStats()
    with ThreadPoolExecutor(1) as completer:
        ctx = _context(te, completer, [n.session_address for n in nodes], 256, stats=stats)
        res = ReadHandle(ctx, locs, [dest.ctypes.data + i * 256 for i in range(6)], 256,
                         [(nodes[0], [0, 2, 4]), (nodes[1], [1, 3, 5])]).wait(10)
    assert sorted(te.sessions) == ["127.0.0.1:1", "127.0.0.1:2"]  # one batch per source
    assert res.ok == (0, 1, 2, 4, 5) and res.failed == (3,)  # the rewritten slot is not handed on
    for i in range(6):
        got = dest[i * 256:(i + 1) * 256].tobytes()
        assert (got == _payload(mem, locs[i], 256)) == (i != 3)  # a failed block is not copied
    assert not dest[3 * 256:4 * 256].any()
    assert stats.remote_hits == 5 and stats.failed_reads == 1 and stats.bytes_read == 5 * 256


def test_a_long_chain_from_one_source_is_split_into_batches_completed_in_order() -> None:
    te = LandedEngine()
    mem, _, locs = _source(9, 128, stale={8})
    src = NodeRecord(NodeId("src"), SESSION, mem.ctypes.data, mem.nbytes, "ns", 1, 10)
    dest = np.zeros(9 * 128, dtype=np.uint8)
    with ThreadPoolExecutor(1) as completer:
        ctx = _context(te, completer, [SESSION], 128)
        res = ReadHandle(ctx, locs, [dest.ctypes.data + i * 128 for i in range(9)], 128,
                         [(src, list(range(9)))]).wait(10)
    # MIN_BATCH blocks at least per batch; source slots back to back land back to back: one range each
    assert [sum(n for _, _, n in r) for r in te.ranges] == [4 * slot_bytes_for(128)] * 2 + [slot_bytes_for(128)]
    assert [len(r) for r in te.ranges] == [1, 1, 1]
    assert res.ok == tuple(range(8)) and res.failed == (8,)


def test_coalesce_merges_ranges_that_continue_on_both_sides_only() -> None:
    # three back-to-back ranges, then one whose destination jumps, then one whose source jumps
    local = [1000, 1100, 1200, 5000, 5100]
    remote = [70, 170, 270, 370, 9000]
    lengths = [100, 100, 100, 100, 100]
    assert coalesce(local, remote, lengths) == ([1000, 5000, 5100], [70, 370, 9000], [300, 100, 100])
    assert coalesce([1], [2], [3]) == ([1], [2], [3])
    assert coalesce(local, remote, lengths, max_bytes=200) == ([1000, 1200, 5000, 5100], [70, 270, 370, 9000],
                                                               [200, 100, 100, 100])  # merged ranges stay small


def test_segmented_destinations_get_each_slice_of_the_block() -> None:
    """A cache laid out per layer (vLLM on CPU): the landed block is copied slice by slice."""
    te = LandedEngine()
    mem, src, locs = _source(2, 4 * 64, stale=set())
    layers = [np.zeros(2 * 64, dtype=np.uint8) for _ in range(4)]  # 4 layers, 64 bytes of each block in each
    dests = [tuple(layer.ctypes.data + b * 64 for layer in layers) for b in range(2)]
    with ThreadPoolExecutor(1) as completer:
        res = ReadHandle(_context(te, completer, [SESSION], 256), locs, dests, 256, [(src, [0, 1])]).wait(10)
    assert res.ok == (0, 1)
    for b in range(2):
        want = _payload(mem, locs[b], 256)
        assert b"".join(layers[k][b * 64:(b + 1) * 64].tobytes() for k in range(4)) == want


class LateEngine(LandedEngine):
    """The binding's failure mode: complete() reports the batch failed while its ranges are
    still in flight; they land (the source's current bytes) only after the failure was reported,
    when the test calls `land_late()`."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[int, int, int]] = []

    def submit_read(self, session, local, remote, lengths) -> int:
        self.sessions.append(session)
        self.ranges.append(list(zip(local, remote, lengths)))
        self.held += zip(local, remote, lengths)
        self.submitted.append(list(local))
        return len(self.submitted)

    def complete(self, batch_id: int) -> None:
        raise TransferError(f"transfer batch {batch_id} failed (-1)")

    def land_late(self) -> None:
        for lo, re, n in self.held:
            ctypes.memmove(lo, re, n)


def test_a_failed_batch_that_lands_late_never_reaches_a_destination_and_its_slots_are_never_reused() -> None:
    te = LateEngine()
    mem, src, locs = _source(4, 128, stale=set())
    dest = np.zeros(4 * 128, dtype=np.uint8)
    dests = [dest.ctypes.data + i * 128 for i in range(4)]
    stats = PoolStats()
    with ThreadPoolExecutor(1) as completer:
        ctx = _context(te, completer, [SESSION], 128, stats=stats, slots=8)
        res = ReadHandle(ctx, locs, dests, 128, [(src, [0, 1, 2, 3])]).wait(10)
        assert res.ok == () and res.failed == (0, 1, 2, 3)
        dest[:] = 0xAB  # the caller recomputes the blocks
        quarantined = {lo for lo, _, _ in te.held}
        te.land_late()  # the failed transfer's bytes arrive now
        assert (dest == 0xAB).all(), "a failed transfer wrote into a destination"
        assert stats.quarantined_slots == 4
        # The next read gets other landing slots; once only quarantined ones are left, reads fail.
        ok = LandedEngine()
        ctx2 = ReadContext(ok, completer, ctx.landing, ctx.peers, stats, 5)
        res = ReadHandle(ctx2, locs, dests, 128, [(src, [0, 1, 2, 3])]).wait(10)
        assert res.ok == (0, 1, 2, 3) and not quarantined & {lo for r in ok.ranges for lo, _, _ in r}
        assert ctx.landing.take(5) is None  # 8 slots, 4 quarantined: never handed out again
        free = ctx.landing.take(4)
        assert free is not None and not quarantined & {ctx.landing.slot_addr(i) for i in free}


class HeldEngine(LandedEngine):
    """complete() blocks until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.completing = threading.Event()
        self.go = threading.Event()

    def complete(self, batch_id: int) -> None:
        self.completing.set()
        self.go.wait(30)


def test_a_posted_batch_past_its_deadline_settles_only_when_the_engine_answers() -> None:
    te = HeldEngine()
    mem, src, locs = _source(2, 128, stale=set())
    dest = np.zeros(2 * 128, dtype=np.uint8)
    with ThreadPoolExecutor(1) as completer:
        handle = ReadHandle(_context(te, completer, [SESSION], 128, timeout_s=0.05), locs,
                            [dest.ctypes.data, dest.ctypes.data + 128], 128, [(src, [0, 1])])
        assert not handle.done()  # (hands the batch to the completion thread)
        assert te.completing.wait(10)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # well past the handle's 50 ms deadline
            assert not handle.done(), "a posted batch was settled before the transfer engine answered"
            time.sleep(0.01)
        te.go.set()
        res = handle.wait(10)
    assert res.ok == (0, 1)  # it completed: the blocks are good and delivered
    assert dest[:128].tobytes() == _payload(mem, locs[0], 128)


def test_a_second_waiter_wakes_when_the_first_completes_the_read_inline() -> None:
    """Two threads wait on one handle: the first spins on the batch itself; the second must be
    woken when it is done, not sleep until the read's deadline."""
    te = HeldEngine()
    mem, src, locs = _source(2, 128, stale=set())
    dest = np.zeros(2 * 128, dtype=np.uint8)
    results: dict[str, object] = {}
    with ThreadPoolExecutor(1) as completer:
        handle = ReadHandle(_context(te, completer, [SESSION], 128, timeout_s=600), locs,
                            [dest.ctypes.data, dest.ctypes.data + 128], 128, [(src, [0, 1])])
        first = threading.Thread(target=lambda: results.setdefault("first", handle.wait()))
        first.start()
        assert te.completing.wait(10)  # the first waiter is inside complete()
        second = threading.Thread(target=lambda: results.setdefault("second", handle.wait()))
        second.start()
        second.join(0.5)
        assert second.is_alive()  # blocked: the read is not done yet
        te.go.set()
        first.join(10)
        second.join(10)  # a lost wake-up would sleep until the 600 s deadline
        assert not first.is_alive() and not second.is_alive()
    assert results["first"] == results["second"] == ReadResult((0, 1), ())
