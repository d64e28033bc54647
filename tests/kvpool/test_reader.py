"""Reader logic with a scripted transfer engine (fast; the real engine is in test_pool.py):
what happens to reads queued behind a first contact that fails, batching per source and in
splits, and validation block by block."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from kvpool.layout import HEADER_BYTES, MAGIC, SlotHeader, checksum
from kvpool.stats import PoolStats
from kvpool.reader import Peers, ReadContext, ReadHandle, ReadResult, Scratch, coalesce
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
    scratch = Scratch(te, 32)
    peers = Peers(te, scratch)
    node = NodeRecord(NodeId("src"), SESSION, 1 << 20, 1 << 20, "ns", 1, 10)
    dest = np.zeros(8 * 64, dtype=np.uint8)
    locs = [BlockLocation(bytes([i]) * 16, NodeId("src"), i * 128, 64, 1) for i in range(8)]
    dests = [dest.ctypes.data + i * 64 for i in range(8)]
    stats = PoolStats()
    with ThreadPoolExecutor(1) as completer:
        ctx = ReadContext(te, completer, scratch, peers, stats, 5)
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
    """Every read 'lands' at once (the test wrote the bytes beforehand); records what was posted."""

    def __init__(self) -> None:
        super().__init__()
        self.contact_fails = False
        self.release.set()
        self.sessions: list[str] = []

    def submit_read(self, session, local, remote, lengths) -> int:
        self.sessions.append(session)
        return super().submit_read(session, local, remote, lengths)


def _landed_blocks(n: int, payload: int, stale: set[int]) -> tuple[np.ndarray, list[tuple[bytes, int]]]:
    """Destination memory in slot strides with header + payload in place for `n` blocks, as a
    read leaves it; blocks in `stale` carry the next generation (the source rewrote the slot)."""
    stride = HEADER_BYTES + payload
    mem = np.zeros(n * stride, dtype=np.uint8)
    rng = np.random.default_rng(7)
    blocks = []
    for i in range(n):
        h = bytes([i + 1]) * 32
        body = mem[i * stride + HEADER_BYTES:(i + 1) * stride]
        body[:] = rng.integers(0, 255, payload, dtype=np.uint8)
        gen = 5 + (i in stale)
        mem[i * stride:i * stride + HEADER_BYTES] = np.frombuffer(
            SlotHeader(MAGIC, gen, payload, checksum(body.ctypes.data, payload), h).pack(), dtype=np.uint8)
        blocks.append((h, mem.ctypes.data + i * stride + HEADER_BYTES))
    return mem, blocks


def _context(te: ScriptedEngine, completer: ThreadPoolExecutor, sessions: list[str], timeout_s: float = 5,
             stats: PoolStats | None = None) -> ReadContext:
    """A reader's context whose peers have made contact with `sessions`."""
    scratch = Scratch(te, 32)
    peers = Peers(te, scratch)
    peers._known.update(sessions)
    return ReadContext(te, completer, scratch, peers, stats or PoolStats(), timeout_s)


SOURCE = NodeRecord(NodeId("src"), SESSION, 1 << 20, 1 << 20, "ns", 1, 10)


def test_blocks_from_two_sources_go_as_one_batch_each_and_are_validated_one_by_one() -> None:
    te = LandedEngine()
    nodes = [NodeRecord(NodeId(f"n{k}"), f"127.0.0.1:{k + 1}", 1 << 20, 1 << 20, "ns", 1, 10) for k in range(2)]
    mem, blocks = _landed_blocks(6, 256, stale={3})
    locs = [BlockLocation(h, NodeId(f"n{i % 2}"), i * 512, HEADER_BYTES + 256, 5) for i, (h, _) in enumerate(blocks)]
    stats = PoolStats()
    with ThreadPoolExecutor(1) as completer:
        ctx = _context(te, completer, [n.session_address for n in nodes], stats=stats)
        res = ReadHandle(ctx, locs, [d for _, d in blocks], 256, [(nodes[0], [0, 2, 4]), (nodes[1], [1, 3, 5])],
                         header_room=True).wait(10)
    assert sorted(te.sessions) == ["127.0.0.1:1", "127.0.0.1:2"]  # one batch per source
    assert sorted(len(local) for local in te.submitted) == [3, 3]
    assert res.ok == (0, 1, 2, 4, 5) and res.failed == (3,)  # the rewritten slot is not handed on
    assert stats.remote_hits == 5 and stats.failed_reads == 1 and stats.bytes_read == 5 * 256


def test_a_long_chain_from_one_source_is_split_into_batches_completed_in_order() -> None:
    te = LandedEngine()
    mem, blocks = _landed_blocks(9, 128, stale={8})
    locs = [BlockLocation(h, NodeId("src"), i * 256, HEADER_BYTES + 128, 5) for i, (h, _) in enumerate(blocks)]
    with ThreadPoolExecutor(1) as completer:
        ctx = _context(te, completer, [SESSION])
        res = ReadHandle(ctx, locs, [d for _, d in blocks], 128, [(SOURCE, list(range(9)))], header_room=True).wait(10)
    assert [len(local) for local in te.submitted] == [4, 4, 1]  # MIN_BATCH blocks at least per batch
    assert te.submitted[0][0] == blocks[0][1] - HEADER_BYTES  # header room: one range per block
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


def test_a_chain_back_to_back_on_both_sides_goes_as_one_range_and_a_rewritten_block_in_it_still_fails() -> None:
    te = LandedEngine()
    slot = HEADER_BYTES + 128
    mem, blocks = _landed_blocks(4, 128, stale={2})  # destinations in slot strides: back to back
    locs = [BlockLocation(h, NodeId("src"), (7 + i) * slot, slot, 5)
            for i, (h, _) in enumerate(blocks)]  # source slots 7..10: back to back too
    dests = [d for _, d in blocks]
    with ThreadPoolExecutor(1) as completer:
        ctx = _context(te, completer, [SESSION])
        res = ReadHandle(ctx, locs, dests, 128, [(SOURCE, [0, 1, 2, 3])], header_room=True,
                         merge_ranges=True).wait(10)
        assert te.submitted == [[blocks[0][1] - HEADER_BYTES]]  # one range for the four blocks
        assert res.ok == (0, 1, 3) and res.failed == (2,)
        te.submitted.clear()
        ReadHandle(ctx, locs, dests, 128, [(SOURCE, [0, 1, 2, 3])],
                   header_room=True).wait(10)  # destinations not known to be in one region: no merging
        assert len(te.submitted[0]) == 4


class HeldEngine(LandedEngine):
    """complete() blocks until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.completing = threading.Event()
        self.go = threading.Event()

    def complete(self, batch_id: int) -> None:
        self.completing.set()
        self.go.wait(30)


def test_a_second_waiter_wakes_when_the_first_completes_the_read_inline() -> None:
    """Two threads wait on one handle: the first spins on the batch itself; the second must be
    woken when it is done, not sleep until the read's deadline."""
    te = HeldEngine()
    mem, blocks = _landed_blocks(2, 128, stale=set())
    locs = [BlockLocation(h, NodeId("src"), i * 1024, HEADER_BYTES + 128, 5) for i, (h, _) in enumerate(blocks)]
    results: dict[str, object] = {}
    with ThreadPoolExecutor(1) as completer:
        handle = ReadHandle(_context(te, completer, [SESSION], timeout_s=600), locs, [d for _, d in blocks], 128,
                            [(SOURCE, [0, 1])], header_room=True)
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
