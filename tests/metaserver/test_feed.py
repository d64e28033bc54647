"""The index change feed (metaserver/feed.py) keeps what a watcher needs to resume after a
short disconnect, and no more: changes older than `keep_s` are dropped, so its memory is
bounded by the change rate over that window (issue 42's hour run: the feed kept 262,144
changes, ~58 MiB, and a replica's memory grew for 80 minutes filling it)."""
from __future__ import annotations

from metaserver.feed import IndexFeed, Kind

NS = "ns"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_changes_older_than_keep_s_are_dropped_and_a_watcher_behind_them_takes_a_snapshot() -> None:
    clock = Clock()
    feed = IndexFeed(max_events=1_000_000, keep_s=60.0, clock=clock)
    for i in range(100):  # one change a second for 100 s
        feed.append(NS, Kind.REMOVE, "node-0", bytes([i]))
        clock.t += 1.0
    epoch, seq = feed.position()
    assert len(feed) <= 61  # the last minute's, not all 100
    assert feed.since(epoch, 10, NS) is None  # behind what the feed holds: a snapshot
    changes, at = feed.since(epoch, seq - 30, NS)  # type: ignore[misc]
    assert [c.payload for c in changes] == [bytes([i]) for i in range(70, 100)] and at == seq


def test_the_event_bound_still_holds_within_the_window() -> None:
    clock = Clock()
    feed = IndexFeed(max_events=10, keep_s=3600.0, clock=clock)
    for i in range(25):
        feed.append(NS, Kind.REMOVE, "node-0", bytes([i]))
    assert len(feed) == 10 and feed.since(feed.epoch, 14, NS) is None
    assert [c.payload for c in feed.since(feed.epoch, 15, NS)[0]] == [bytes([i]) for i in range(15, 25)]  # type: ignore[index]
