"""Compacts etcd's history from the metaserver, every `interval_s`, to the current revision
less `keep` (what kube-apiserver does for its etcd).

Why not only etcd's `--auto-compaction-*`: etcd 3.4 compacts on the leader alone, and only
once that member has run a whole period (periodic mode) or reached its 5-minute tick
(revision mode); members restarted more often than that never compact, and the history,
the bbolt file and the member's RSS grow (found by `kvpool bench chaos`: one compaction per
15-25 minutes with a 10-minute retention). Every replica runs one, its first round soon
after it starts (the nemesis restarts replicas too); a revision compacted
already (by etcd or the other replica) is skipped. A replica's watch that falls more than
`keep` revisions behind gets WatchCompacted and reloads the index, as after any compaction.
"""
from __future__ import annotations

import asyncio
import logging

from metaserver.etcd import EtcdClient, EtcdError

log = logging.getLogger(__name__)


class HistoryCompactor:
    def __init__(self, etcd: EtcdClient, interval_s: float, keep: int) -> None:
        if interval_s < 0 or keep < 1:
            raise ValueError("interval_s must be >= 0 and keep >= 1")
        self.etcd, self.interval_s, self.keep = etcd, interval_s, keep
        self.compacted = 0          # the last revision this replica compacted to
        self._task: asyncio.Task[None] | None = None

    async def compact_once(self) -> int:
        """Compact to the current revision less `keep`; the revision, or 0 when there was
        nothing to do (history shorter than `keep`, or compacted there already)."""
        target = await self.etcd.status() - self.keep
        if target <= self.compacted:
            return 0
        done = await self.etcd.compact(target)
        self.compacted = target
        return target if done else 0

    def start(self, first_after_s: float = 30.0) -> None:
        """Run `compact_once` `first_after_s` after the start (at most `interval_s`), then every
        `interval_s` (0: never), until `stop`. The early first round: replicas that are
        restarted more often than `interval_s` still compact."""
        if self.interval_s > 0:
            self._task = asyncio.create_task(self._run(min(first_after_s, self.interval_s)), name="etcd-compact")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, first_after_s: float) -> None:
        wait = first_after_s
        while True:
            await asyncio.sleep(wait)
            wait = self.interval_s
            try:
                rev = await self.compact_once()
            except EtcdError as err:  # etcd down or without quorum: the next round tries again
                log.info("etcd compaction skipped: %s", err)
                continue
            if rev:
                log.info("etcd history compacted to revision %d", rev)
