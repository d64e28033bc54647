"""Reader logic with a scripted transfer engine (fast; the real engine is in test_pool.py):
what happens to reads queued behind a first contact that fails."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from kvpool.pool import PoolStats
from kvpool.reader import Peers, ReadHandle, ReadItem, Scratch
from kvpool.transfer import TransferError
from metaserver.types import BlockLocation, NodeId, NodeRecord

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
    items = [ReadItem(i, BlockLocation(bytes([i]) * 16, NodeId("src"), i * 128, 64, 1), dest.ctypes.data + i * 64, 64)
             for i in range(8)]
    stats = PoolStats()
    with ThreadPoolExecutor(1) as completer:
        handle = ReadHandle(te, completer, scratch, peers, items, {NodeId("src"): node}, set(), [], 5, stats)
        assert peers.contacting(SESSION) and not peers.known(SESSION)
        te.release.set()
        res = handle.wait(10)
        assert res.ok == () and res.failed == tuple(range(8))
        assert not peers.contacting(SESSION) and not peers.known(SESSION)
        assert te.submitted == [], "a read queued behind a failed contact was posted"
        assert stats.failed_reads == 8 and stats.remote_hits == 0

        te.contact_fails = False  # the source answers again: a new read makes contact anew
        handle = ReadHandle(te, completer, scratch, peers, items, {NodeId("src"): node}, set(), [], 5, stats)
        handle.wait(10)
        assert te.contacts == 2 and peers.known(SESSION)
        assert len(te.submitted) == 2  # 8 blocks from one source: two batches of MIN_BATCH
