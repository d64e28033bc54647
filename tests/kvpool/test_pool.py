"""The node pool with the real transfer engine, a real metaserver and etcd."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import NodePool, PoolConfig, PoolError, TransferConfig
from kvpool.layout import HEADER_BYTES, parse_size, slot_bytes_for
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from metaserver.errors import NotFound
from metaserver.types import BlockLocation, NodeId
from tests.conftest import wait_for
from tests.kvpool.pool_node import block_content, block_hash
from tests.kvpool.hooks import contacting, lru_order, overwrite, put_bytes

NS = "test-ns"
BB = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


def make_pool(ms: MetaserverProcess, node_id: str, num_blocks: int, rpc_timeout_s: float = 5.0,
              **kw) -> NodePool:
    """A started pool whose metaserver calls have `rpc_timeout_s` each (the default client's).
    Its registration, a precondition here, gets 60 s: a loaded machine can stall a fresh etcd's
    first writes past 5 s (seen once in CI)."""
    cfg = PoolConfig(node_id, num_blocks * slot_bytes_for(BB), BB, NS, ms.address, **kw)
    client = MetaClient(ms.address, timeout_s=60.0)
    pool = NodePool(cfg, client)
    pool.start()
    client.timeout_s = rpc_timeout_s
    return pool


@pytest.fixture
def two_pools(metaserver: MetaserverProcess) -> Iterator[tuple[NodePool, NodePool]]:
    a = make_pool(metaserver, "A", 32)
    b = make_pool(metaserver, "B", 32)
    yield a, b
    b.close()
    a.close()


def fill(pool: NodePool, n: int, seed: str = "chain") -> list[bytes]:
    hashes = [block_hash(seed, i) for i in range(n)]
    for h in hashes:
        assert put_bytes(pool, h, block_content(h, BB))
    # A publish that failed (a loaded machine can stall a call past its 5 s deadline, and the
    # failure's handling takes as long again) is sent again by the node's session after its
    # next keepalive: wait for the publisher and then for the index, not for the call.
    assert pool.flush_publishes(timeout_s=60)
    with MetaClient(pool.config.metaserver) as c:
        wait_for(lambda: c.query_prefix(NS, hashes).num_matched == n, timeout_s=60)
    return hashes


def read_into(pool: NodePool, client: MetaClient, hashes: list[bytes], dest: np.ndarray, requester: str = ""):
    r = client.query_prefix(NS, hashes, requester)
    handle = pool.get(r.locations, r.nodes, [dest.ctypes.data + i * BB for i in range(r.num_matched)])
    return r, handle.wait(timeout_s=60)


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30 and parse_size("512M") == 512 << 20 and parse_size(4096) == 4096
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("lots")
    assert slot_bytes_for(BB) == BB + HEADER_BYTES
    with pytest.raises(ValueError, match="cannot hold one"):
        PoolConfig("x", 100, BB, NS)


def test_put_on_a_get_on_b_in_one_process(two_pools, metaserver: MetaserverProcess) -> None:
    a, b = two_pools
    hashes = fill(a, 20)
    dest = np.zeros(20 * BB, dtype=np.uint8)
    b.register_memory(dest.ctypes.data, dest.nbytes)
    with MetaClient(metaserver.address) as c:
        r, res = read_into(b, c, hashes, dest, requester="B")
    assert r.num_matched == 20 and set(r.nodes) == {"A"}
    assert res.failed == () and len(res.ok) == 20
    for i, h in enumerate(hashes):
        assert np.array_equal(dest[i * BB:(i + 1) * BB], block_content(h, BB))
    assert b.stats.remote_hits == 20 and b.stats.bytes_read == 20 * BB
    assert a.stats.puts == 20 and a.stats.published == 20


def test_own_blocks_are_copied_locally(two_pools, metaserver: MetaserverProcess) -> None:
    a, _ = two_pools
    hashes = fill(a, 4)
    dest = np.zeros(4 * BB, dtype=np.uint8)
    a.register_memory(dest.ctypes.data, dest.nbytes)
    with MetaClient(metaserver.address) as c:
        r, res = read_into(a, c, hashes, dest, requester="A")
    assert set(r.nodes) == {"A"} and len(res.ok) == 4
    assert a.stats.local_hits == 4 and a.stats.remote_hits == 0
    assert np.array_equal(dest[:BB], block_content(hashes[0], BB))


def test_overwritten_slot_is_reported_failed(two_pools, metaserver: MetaserverProcess) -> None:
    a, b = two_pools
    hashes = fill(a, 8)
    dest = np.zeros(8 * BB, dtype=np.uint8)
    b.register_memory(dest.ctypes.data, dest.nbytes)
    with MetaClient(metaserver.address) as c:
        r = c.query_prefix(NS, hashes)
        overwrite(a, hashes[3], bytes(BB))  # the index still promises generation 1
        res = b.get(r.locations, r.nodes, [dest.ctypes.data + i * BB for i in range(8)]).wait(60)
        assert res.failed == (3,)
        # Concurrent: the source keeps rewriting block 5 while B reads it again and again.
        stop = threading.Event()

        def writer() -> None:
            k = 0
            while not stop.is_set():
                overwrite(a, hashes[5], bytes([k % 256]) * BB)
                k += 1

        t = threading.Thread(target=writer)
        t.start()
        try:
            for _ in range(20):
                res = b.get(r.locations, r.nodes, [dest.ctypes.data + i * BB for i in range(8)]).wait(60)
                assert 5 in res.failed and 3 in res.failed
                assert set(res.ok) == {0, 1, 2, 4, 6, 7}
        finally:
            stop.set()
            t.join()
    assert np.array_equal(dest[7 * BB:], block_content(hashes[7], BB))


def test_full_pool_evicts_lru_and_unpublishes(metaserver: MetaserverProcess) -> None:
    pool = make_pool(metaserver, "small", 8, evict_batch=2)
    try:
        hashes = fill(pool, 8)
        # Touch block 0 and 1 so 2 and 3 are the least recently used.
        assert not put_bytes(pool, hashes[0], block_content(hashes[0], BB))
        assert not put_bytes(pool, hashes[1], block_content(hashes[1], BB))
        assert lru_order(pool)[:2] == [hashes[2], hashes[3]]
        extra = fill(pool, 1, seed="extra")
        assert pool.stats.evictions == 2 and len(pool) == 7
        assert hashes[2] not in pool and hashes[3] not in pool and hashes[0] in pool and extra[0] in pool
        with MetaClient(metaserver.address) as c:
            assert c.query_prefix(NS, [hashes[2]]).num_matched == 0
            assert c.query_prefix(NS, [hashes[3]]).num_matched == 0
            assert c.query_prefix(NS, [hashes[0], hashes[1]]).num_matched == 2
            assert c.query_prefix(NS, extra).num_matched == 1
    finally:
        pool.close()


def test_touch_marks_held_blocks_used_and_ignores_the_rest(metaserver: MetaserverProcess) -> None:
    """A local hit in the engine's cache touches the pool's copy: it is evicted last."""
    pool = make_pool(metaserver, "touch", 8, evict_batch=2)
    try:
        hashes = fill(pool, 8)
        assert pool.touch([hashes[0], hashes[1], b"\x07" * 32]) == 2    # not held: ignored
        assert lru_order(pool)[:2] == [hashes[2], hashes[3]] and lru_order(pool)[-2:] == hashes[:2]
        fill(pool, 1, seed="extra")
        assert hashes[0] in pool and hashes[1] in pool and hashes[2] not in pool
    finally:
        pool.close()


def test_eviction_unpublishes_without_holding_the_pool(metaserver: MetaserverProcess) -> None:
    """An evicting put waits for its unpublish RPC outside the pool's lock: with the metaserver
    frozen, the pool still answers and serves local reads meanwhile; the evicted slots are
    reused only after the unpublish returned (here: answered after the thaw; its deadline
    outlives the frozen checks on any machine)."""
    pool = make_pool(metaserver, "frozen-evict", 8, evict_batch=2, rpc_timeout_s=60.0)
    dest = np.zeros(BB, dtype=np.uint8)
    pool.register_memory(dest.ctypes.data, dest.nbytes)
    try:
        hashes = fill(pool, 8)
        with MetaClient(metaserver.address) as c:
            r = c.query_prefix(NS, hashes[7:], "frozen-evict")
        os.kill(metaserver.pid, signal.SIGSTOP)
        try:
            extra = block_hash("extra", 0)
            putter = threading.Thread(target=put_bytes, args=(pool, extra, block_content(extra, BB)))
            putter.start()
            wait_for(lambda: len(pool) == 6, timeout_s=10)  # the victims left the LRU, the RPC hangs
            assert putter.is_alive() and pool.stats.evictions == 0
            assert hashes[7] in pool and hashes[0] not in pool
            res = pool.get(r.locations, r.nodes, [dest.ctypes.data]).wait(10)  # a local read, lock free
            assert res.ok == (0,) and putter.is_alive()
            assert np.array_equal(dest, block_content(hashes[7], BB))
        finally:
            os.kill(metaserver.pid, signal.SIGCONT)
        putter.join(30)
        assert not putter.is_alive() and pool.stats.evictions == 2 and extra in pool and len(pool) == 7
    finally:
        pool.close()


def test_bad_input(two_pools, metaserver: MetaserverProcess) -> None:
    a, b = two_pools
    hashes = fill(a, 2)
    with pytest.raises(PoolError, match="does not match"):
        put_bytes(a, block_hash("x", 0), np.zeros(BB + 1, dtype=np.uint8))
    with MetaClient(metaserver.address) as c:
        r = c.query_prefix(NS, hashes)
    dest = np.zeros(2 * BB, dtype=np.uint8)
    with pytest.raises(PoolError, match="2 locations but 1 destinations"):
        b.get(r.locations, r.nodes, [dest.ctypes.data])
    with pytest.raises(PoolError, match="3 segments do not split"):
        b.get(r.locations[:1], r.nodes, [(dest.ctypes.data, dest.ctypes.data + 8, dest.ctypes.data + 16)])
    ghost = BlockLocation(r.locations[0].block_hash, NodeId("ghost"), 0, BB + HEADER_BYTES, 1)
    with pytest.raises(PoolError, match="unknown node 'ghost'"):
        b.get([ghost], r.nodes, [dest.ctypes.data])
    assert b.stats.failed_reads == 0 and len(b) == 0


def start_node(ms: MetaserverProcess, node_id: str, blocks: int, block_bytes: int = BB) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.kvpool.pool_node", "--metaserver", ms.address,
                             "--node-id", node_id, "--blocks", str(blocks), "--block-bytes", str(block_bytes)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


@pytest.mark.slow
def test_two_processes_and_source_killed_or_frozen(metaserver: MetaserverProcess) -> None:
    big = 1 << 20
    proc = start_node(metaserver, "src", 48, big)
    # The healthy 48 MiB read runs under the default transfer bounds (a machine that is busy
    # enough outlives any short one: 5 s of no progress failed a batch once under two heavy
    # test runs); the frozen and killed sources are read by a second pool with short bounds,
    # so that they fail in seconds (a frozen source fails whatever the machine's speed).
    ok_cfg = PoolConfig("dst-ok", 4 * slot_bytes_for(big), big, NS, metaserver.address, read_timeout_s=60)
    ok_pool = NodePool(ok_cfg, MetaClient(metaserver.address))
    ok_pool.start()
    timeout = TransferConfig(transfer_timeout_s=10, progress_timeout_s=5)
    cfg = PoolConfig("dst", 4 * slot_bytes_for(big), big, NS, metaserver.address, transfer=timeout, read_timeout_s=15)
    pool = NodePool(cfg, MetaClient(metaserver.address))
    pool.start()
    try:
        hashes = [block_hash("chain", i) for i in range(48)]
        dest = np.zeros(48 * big, dtype=np.uint8)
        pool.register_memory(dest.ctypes.data, dest.nbytes)
        ok_pool.register_memory(dest.ctypes.data, dest.nbytes)
        with MetaClient(metaserver.address) as c:
            r = c.query_prefix(NS, hashes)
        assert r.num_matched == 48
        addrs = [dest.ctypes.data + i * big for i in range(48)]
        res = ok_pool.get(r.locations, r.nodes, addrs).wait(120)
        assert res.failed == ()
        assert np.array_equal(dest[5 * big:6 * big], block_content(hashes[5], big))
        # The short-bound pool makes contact with the source (one block) before it freezes.
        assert pool.get(r.locations[:1], r.nodes, addrs[:1]).wait(60).failed == ()

        # Frozen source: the read fails within the configured bound instead of hanging.
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        res = pool.get(r.locations, r.nodes, addrs).wait(cfg.read_timeout_s + 10)
        frozen_s = time.monotonic() - t0
        assert len(res.failed) == 48
        os.kill(proc.pid, signal.SIGCONT)

        # Killed mid-read: start a read, SIGKILL the source, the read reports failures.
        handle = pool.get(r.locations, r.nodes, addrs)
        proc.kill()
        res = handle.wait(cfg.read_timeout_s + 10)
        assert len(res.failed) + len(res.ok) == 48
        res = pool.get(r.locations, r.nodes, addrs).wait(cfg.read_timeout_s + 10)
        assert len(res.failed) == 48  # the source is gone
        print(f"frozen source failed after {frozen_s:.2f}s")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        pool.close()
        ok_pool.close()


@pytest.mark.slow
def test_frozen_source_never_read_before_fails_on_time_and_nothing_lands_later(metaserver: MetaserverProcess) -> None:
    """First contact with a frozen source (BUG-3): the transfer engine's handshake would block
    the caller for about a minute. get() returns at once, the read fails by its deadline,
    and once the source thaws the abandoned read is never posted (the destination stays
    untouched); the next read works."""
    proc = start_node(metaserver, "cold-src", 8)
    cfg = PoolConfig("cold-dst", 4 * slot_bytes_for(BB), BB, NS, metaserver.address,
                     transfer=TransferConfig(transfer_timeout_s=2, progress_timeout_s=1), read_timeout_s=2)
    pool = NodePool(cfg, MetaClient(metaserver.address))
    pool.start()
    try:
        hashes = [block_hash("chain", i) for i in range(8)]
        dest = np.zeros(8 * BB, dtype=np.uint8)
        pool.register_memory(dest.ctypes.data, dest.nbytes)
        with MetaClient(metaserver.address) as c:
            r = c.query_prefix(NS, hashes)
        assert r.num_matched == 8
        addrs = [dest.ctypes.data + i * BB for i in range(8)]
        session = r.nodes[NodeId("cold-src")].session_address
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        handle = pool.get(r.locations, r.nodes, addrs)
        get_s = time.monotonic() - t0
        res = handle.wait(cfg.read_timeout_s + 10)
        failed_s = time.monotonic() - t0
        assert len(res.failed) == 8 and res.ok == ()
        assert get_s < cfg.read_timeout_s, f"get() blocked {get_s:.1f} s on a frozen source"
        os.kill(proc.pid, signal.SIGCONT)
        # The first contact either waits out the freeze and succeeds after the thaw, or (when the
        # transport connected before the source stopped answering) fails on the progress timeout.
        # Either way the batches behind it are settled and must never be posted.
        wait_for(lambda: not contacting(pool._reads.peers, session), timeout_s=30)
        contact = "made" if pool._reads.peers.known(session) else "failed"
        time.sleep(0.5)
        assert not dest.any(), "the abandoned read was posted after the source thawed"
        res = pool.get(r.locations, r.nodes, addrs).wait(30)
        assert res.failed == ()
        assert np.array_equal(dest[3 * BB:4 * BB], block_content(hashes[3], BB))
        print(f"get() returned in {get_s * 1e3:.1f} ms, failed after {failed_s:.2f} s, first contact {contact}")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        pool.close()


@pytest.mark.slow
def test_lifecycle_republish_after_lost_lease_and_unregister_on_close(metaserver_factory) -> None:
    ms = metaserver_factory()
    # A 3 s lease: a 1 s one was lost again and again on a loaded machine before the outage.
    pool = make_pool(ms, "life", 8, lease_ttl_s=3)
    try:
        hashes = fill(pool, 5)
        port = ms.port
        ms.kill()
        time.sleep(4.5)  # the lease runs out while no metaserver relays keepalives
        ms2 = metaserver_factory(port=port)
        with MetaClient(ms2.address) as c:
            def matched() -> int:
                try:
                    return c.query_prefix(NS, hashes).num_matched
                except NotFound:  # until the node registers again, its namespace is unknown
                    return -1

            wait_for(lambda: matched() == 5, timeout_s=15)
            node = next(n for n, k in c.list_nodes() if n.node_id == "life")
            assert node.session_address == pool.te.session_id and node.buffer_address == pool.buffer_address
            pool.close()
            assert "life" not in {n.node_id for n, _ in c.list_nodes()}
            assert c.stats().index.num_copies == 0
    finally:
        pool.close()


def test_back_to_back_source_slots_land_as_one_range_per_batch_and_each_block_is_validated_and_copied(
        two_pools, metaserver: MetaserverProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks back to back in A's slots land back to back in B's read buffer: one range per
    batch, header and payload together. The real transfer engine moves the merged ranges;
    every block is still validated on its own, and only valid ones reach the destination."""
    a, b = two_pools
    hashes = fill(a, 6)
    stride = slot_bytes_for(BB)
    dest = np.zeros(6 * BB, dtype=np.uint8)
    addrs = [dest.ctypes.data + i * BB for i in range(6)]
    posted: list[list[int]] = []
    submit = b.te.submit_read
    monkeypatch.setattr(b.te, "submit_read", lambda s, lo, re, n: (posted.append(list(n)), submit(s, lo, re, n))[1])
    with MetaClient(metaserver.address) as c:
        r = c.query_prefix(NS, hashes)
    assert [loc.offset for loc in r.locations] == [i * stride for i in range(6)]  # A's slots 0..5
    res = b.get(r.locations, r.nodes, addrs).wait(60)
    assert res.failed == ()
    assert posted == [[4 * stride], [2 * stride]]  # two batches, one range each
    for i, h in enumerate(hashes):
        assert np.array_equal(dest[i * BB:(i + 1) * BB], block_content(h, BB))
    overwrite(a, hashes[2], bytes(BB))
    dest[:] = 0
    assert b.get(r.locations, r.nodes, addrs).wait(60).failed == (2,)
    for i, h in enumerate(hashes):  # the others still arrive and validate inside the merged range
        want = block_content(h, BB) if i != 2 else np.zeros(BB, dtype=np.uint8)  # the rewritten one: not copied
        assert np.array_equal(dest[i * BB:(i + 1) * BB], want)


def test_waiting_caller_completes_its_read_itself_pollers_use_the_completion_thread(
        two_pools, metaserver: MetaserverProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller blocking in wait() spins on the batch's status itself (no thread handoff) unless
    its wait timeout ends before the transfer engine's bound (transfer timeout + 1 ns/byte); a
    poller, or such a timeout, goes through the completion thread."""
    a, b = two_pools
    hashes = fill(a, 6)
    handoffs: list[int] = []
    submit = b._completer.submit
    monkeypatch.setattr(b._completer, "submit", lambda fn, *args: (handoffs.append(1), submit(fn, *args))[1])
    dest = np.zeros(6 * BB, dtype=np.uint8)
    b.register_memory(dest.ctypes.data, dest.nbytes)
    with MetaClient(metaserver.address) as c:
        r = c.query_prefix(NS, hashes, "B")
        addrs = [dest.ctypes.data + i * BB for i in range(6)]
        b.get(r.locations, r.nodes, addrs).wait(60)        # first contact: its own thread, then the handoff
        handoffs.clear()
        dest[:] = 0

        res = b.get(r.locations, r.nodes, addrs).wait(60)   # 60 s > the engine's 20 s + 384 KiB * 1 ns
        assert res.ok == tuple(range(6)) and handoffs == []
        assert all(np.array_equal(dest[i * BB:(i + 1) * BB], block_content(h, BB)) for i, h in enumerate(hashes))

        handle = b.get(r.locations, r.nodes, addrs)
        assert wait_for(handle.done, timeout_s=30)           # polled: the completion thread
        assert handle.result is not None and len(handle.result.ok) == 6 and handoffs == [1]
        assert [len(x.idx) for x in handle._batches] == [4, 2]  # two batches, completed in order by one job

        res = b.get(r.locations, r.nodes, addrs).wait(4.0)  # 4 s < the engine's 20 s bound: the thread
        assert len(res.ok) == 6 and handoffs == [1, 1]
    assert b.stats.remote_hits == 24 and b.stats.failed_reads == 0


def test_segmented_payloads_read_and_save_per_layer_slices(two_pools, metaserver: MetaserverProcess) -> None:
    """A cache laid out per layer (vLLM's on CPU): a block is one slice in each of 4 layer
    arrays. Saved from its slices, read back remotely into other slices as one batch of
    per-segment ranges, validated over the segments; a rewritten source block fails."""
    a, b = two_pools
    layers, nblocks, seg = 4, 6, BB // 4
    src = [np.random.default_rng(k).integers(0, 255, nblocks * seg, dtype=np.uint8) for k in range(layers)]
    cache = np.zeros(layers * nblocks * seg, dtype=np.uint8)   # B's cache: the layers back to back
    b.register_memory(cache.ctypes.data, cache.nbytes)
    hashes = [block_hash("layered", i) for i in range(3)]
    for i, h in enumerate(hashes):                             # A saves blocks 0..2 of its layers
        assert a.put(h, tuple(s.ctypes.data + i * seg for s in src), BB)
    assert a.flush_publishes(timeout_s=60)
    overwrite(a, hashes[2], bytes(BB))                         # the index still promises generation 1

    def dests(block: int) -> tuple[int, ...]:
        return tuple(cache.ctypes.data + (k * nblocks + block) * seg for k in range(layers))

    with MetaClient(metaserver.address) as c:
        r = c.query_prefix(NS, hashes, "B")
        res = b.get(r.locations, r.nodes, [dests(3 + i) for i in range(3)]).wait(timeout_s=60)
    assert res.ok == (0, 1) and res.failed == (2,)
    for i in (0, 1):
        for k in range(layers):
            got = cache[(k * nblocks + 3 + i) * seg:(k * nblocks + 4 + i) * seg]
            assert np.array_equal(got, src[k][i * seg:(i + 1) * seg])


def test_a_failed_publish_is_sent_again_and_counted(metaserver: MetaserverProcess) -> None:
    """A publish that misses its deadline (the metaserver frozen past it) is not lost: the
    node's session re-publishes its holdings after the next keepalive, and the pool's
    `published` counts them once acknowledged."""
    pool = make_pool(metaserver, "late", 8, rpc_timeout_s=1.0)
    try:
        hashes = [block_hash("late", i) for i in range(4)]
        os.kill(metaserver.pid, signal.SIGSTOP)
        try:
            for h in hashes:
                assert put_bytes(pool, h, block_content(h, BB))
            assert pool.flush_publishes(30)
            assert pool.stats.published == 0
        finally:
            os.kill(metaserver.pid, signal.SIGCONT)
        with MetaClient(metaserver.address) as c:
            wait_for(lambda: c.query_prefix(NS, hashes).num_matched == 4, timeout_s=60)
        wait_for(lambda: pool.stats.published == 4, timeout_s=10)
    finally:
        pool.close()


def test_an_unpublish_that_failed_is_sent_again_once_the_metaserver_answers(metaserver: MetaserverProcess) -> None:
    """Evictions while the metaserver is frozen: their Unpublish fails at its deadline. Once it
    answers again, the node's session sends it again before it re-publishes (re-publishing
    only adds entries), so the index stops listing the evicted blocks and lists the rest."""
    pool = make_pool(metaserver, "lost-unpublish", 8, evict_batch=2, lease_ttl_s=30)  # outlives the freeze
    try:
        hashes = fill(pool, 8)
        extra = block_hash("extra", 0)
        os.kill(metaserver.pid, signal.SIGSTOP)
        try:
            assert put_bytes(pool, extra, block_content(extra, BB))  # evicts 0 and 1; their unpublish fails
            assert pool.stats.evictions == 2 and pool.stats.unpublished == 0
        finally:
            os.kill(metaserver.pid, signal.SIGCONT)
        with MetaClient(metaserver.address) as c:
            listed = lambda hs: c.query_prefix(NS, hs, sparse=True).num_held  # noqa: E731
            wait_for(lambda: listed(hashes[:2]) == 0 and listed([extra]) == 1, timeout_s=60)
            assert listed(hashes[2:]) == 6
    finally:
        pool.close()
