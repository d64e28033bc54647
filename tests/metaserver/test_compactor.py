"""The metaserver compacts etcd's history (`metaserver.compactor`), against a real etcd: to
the current revision less `keep`, never twice to the same place, a revision compacted
already (by etcd or another replica) skipped; a metaserver started with the flags does it
on its own and keeps serving."""
from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable

import pytest

from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from metaserver.compactor import HistoryCompactor
from metaserver.etcd import EtcdClient, Put
from tests.conftest import wait_for


def compact_revision(etcd: EtcdProcess) -> int:
    """etcd's own gauge of the revision its history was last compacted to."""
    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_compact_revision "):
                return int(float(line.split()[1]))
    raise AssertionError("etcd has no compact_revision gauge")


async def writes(etcd: EtcdProcess, n: int) -> int:
    """`n` revisions under a key the metaserver does not own; the last revision."""
    c = EtcdClient([etcd.endpoint])
    for i in range(n):
        rev = await c.txn([Put(b"/other/k", b"%d" % i)])
    await c.close()
    return rev


def logged(ms: MetaserverProcess) -> None:
    """The metaserver's log says it compacted. It logs after etcd answers the compaction, so
    etcd's gauge can move first: wait for the line rather than read the log once."""
    wait_for(lambda: "etcd history compacted to revision" in ms.log_path.read_text(),
             timeout_s=60)


def test_compact_once_keeps_the_last_revisions(etcd: EtcdProcess) -> None:
    async def main() -> None:
        c = EtcdClient([etcd.endpoint])
        for i in range(30):
            rev = await c.put(b"/c/k", b"%d" % i)
        comp = HistoryCompactor(c, 0, keep=10)
        assert await comp.compact_once() == rev - 10
        assert compact_revision(etcd) == rev - 10
        assert await comp.compact_once() == 0            # nothing new since
        assert await c.compact(rev - 12) is False        # below the compacted revision: a no-op
        for i in range(5):
            rev = await c.put(b"/c/k", b"x%d" % i)
        assert await comp.compact_once() == rev - 10
        assert await c.compact(rev - 2) is True          # someone else compacts further
        assert await comp.compact_once() == 0            # compacted already: skipped, no error
        assert compact_revision(etcd) == rev - 2
        with pytest.raises(ValueError):
            HistoryCompactor(c, -1, 10)
        await c.close()

    asyncio.run(main())


def test_a_metaserver_compacts_on_its_own_and_keeps_serving(
        etcd: EtcdProcess, metaserver_factory: Callable[..., MetaserverProcess]) -> None:
    assert compact_revision(etcd) <= 0  # never compacted (etcd says -1)
    ms = metaserver_factory("--etcd-compact-interval", "0.2", "--etcd-compact-keep", "5")
    rev = asyncio.run(writes(etcd, 40))
    wait_for(lambda: compact_revision(etcd) >= rev - 5, timeout_s=60)
    assert compact_revision(etcd) <= rev - 5  # never past what `keep` leaves
    assert ms.proc is not None and ms.proc.poll() is None
    logged(ms)


def test_a_restarted_metaserver_compacts_before_its_interval(
        etcd: EtcdProcess, metaserver_factory: Callable[..., MetaserverProcess]) -> None:
    """An interval of an hour: only the round soon after the start (30 s) can compact."""
    rev = asyncio.run(writes(etcd, 40))
    ms = metaserver_factory("--etcd-compact-interval", "3600", "--etcd-compact-keep", "5")
    wait_for(lambda: compact_revision(etcd) >= rev - 5, timeout_s=120)
    logged(ms)
