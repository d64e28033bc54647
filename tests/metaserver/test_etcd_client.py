"""The asyncio etcd client against a real etcd: paging, txn, leases, watch resume."""
from __future__ import annotations

import asyncio

import pytest

from kvpool_harness.processes import EtcdProcess
from metaserver.etcd import Delete, EtcdClient, EtcdError, EtcdUnavailable, LeaseNotFound, Put, grpc_target, prefix_end


def test_prefix_end_and_target() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert grpc_target(["127.0.0.1:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ValueError):
        grpc_target([])


def test_kv_paging_txn_limit_and_leases(etcd: EtcdProcess) -> None:
    async def main() -> None:
        c = EtcdClient([etcd.endpoint])
        for start in range(0, 25_000, 128):
            await c.txn([Put(b"/t/k%06d" % i, b"v") for i in range(start, min(start + 128, 25_000))])
        kvs, rev = await c.get_prefix(b"/t/")
        assert len(kvs) == 25_000 and rev > 0  # more than one 10k page
        assert kvs[0].key == b"/t/k000000" and kvs[-1].key == b"/t/k024999"
        with pytest.raises(EtcdError, match="too many operations"):
            await c.txn([Put(b"/t/x%d" % i, b"v") for i in range(129)])  # etcd's default --max-txn-ops
        await c.txn([Delete(b"/t/", prefix=True)])
        assert (await c.get_prefix(b"/t/"))[0] == []
        lease, ttl = await c.lease_grant(5)
        assert ttl == 5
        await c.put(b"/l/a", b"1", lease)
        assert await c.lease_keepalive(lease) == 5
        await c.lease_revoke(lease)
        assert (await c.get_prefix(b"/l/"))[0] == []
        with pytest.raises(LeaseNotFound):
            await c.lease_keepalive(lease)
        with pytest.raises(LeaseNotFound):
            await c.put(b"/l/b", b"1", lease)
        await c.close()

    asyncio.run(main())


def test_watch_and_keepalive_survive_etcd_restart(etcd: EtcdProcess) -> None:
    async def main() -> None:
        c = EtcdClient([etcd.endpoint], timeout_s=1.0)
        rev = await c.put(b"/w/0", b"0")
        lease, _ = await c.lease_grant(30)
        seen: list[tuple[bool, bytes]] = []

        async def watch() -> None:
            async for batch in c.watch_prefix(b"/w/", rev + 1, retry_s=0.05):
                seen.extend((e.is_put, e.key) for e in batch)

        task = asyncio.create_task(watch())
        await c.put(b"/w/1", b"1")
        await asyncio.sleep(0.2)
        await asyncio.to_thread(etcd.kill)
        with pytest.raises(EtcdUnavailable):
            await c.status()
        with pytest.raises(EtcdUnavailable):
            await c.lease_keepalive(lease)
        await asyncio.to_thread(etcd.start)
        for _ in range(100):
            try:
                await c.put(b"/w/2", b"2")
                break
            except EtcdUnavailable:
                await asyncio.sleep(0.1)
        await c.txn([Delete(b"/w/1")])
        for _ in range(100):
            if len(seen) >= 3:
                break
            await asyncio.sleep(0.05)
        assert seen == [(True, b"/w/1"), (True, b"/w/2"), (False, b"/w/1")]  # no gap, no duplicate
        assert await c.lease_keepalive(lease) == 30  # the shared keepalive stream was re-opened
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await c.close()

    asyncio.run(main())
