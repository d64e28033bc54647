"""Faults with real processes (issue 8): one test per fault, on a pool of real processes on
127.0.0.1 (etcd, two metaserver replicas, `kvpool serve --kv-connector mooncake` nodes A and
B with the real model, and C with the connector off as the reference; see `faults_util`).

Every request's output is compared token for token with C's; what each request did (remote
hit, local compute after a failed query, recompute after a failed load) comes from its
usage and its node's /stats; recovery times are measured with time.monotonic and printed
(`-s`), and asserted only against generous deadlines. docs/RELIABILITY.md has a run's figures.

The processes are shared by the module: the tests run in an order where each fault leaves
the pool usable for the next (a metaserver replica down, all replicas down, etcd down, B
restarted, A frozen, and last A killed for good); a fixture restarts whatever a failed test
left dead or frozen.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpool_harness.engine_node import EngineProcess
from tests.conftest import wait_for
from tests.reliability.faults_util import (B_LEASE_TTL_S, B_READ_TIMEOUT_S, LOAD_DELAY_S, PREFIX_BLOCKS,
                                           PREFIX_TOKENS, Background, FaultRecord, FirstTrue, Outcome, Pool, ask,
                                           block_hashes, log_count, poll, prompt_pair, wait_loading)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = Pool(Path(tmp_path_factory.mktemp("faults")))
    try:
        t0 = time.monotonic()
        p.up()
        print(f"\npool up in {time.monotonic() - t0:.1f} s (logs in {p.run})")
        yield p
    finally:
        p.down()


@pytest.fixture
def record(pool: Pool, request: pytest.FixtureRequest) -> Iterator[FaultRecord]:
    pool.heal()
    rec = FaultRecord(request.node.name)
    yield rec
    print("\n" + rec.text())


def since(t0: float) -> float:
    return time.monotonic() - t0


def expect(rec: FaultRecord, outcome: Outcome) -> Outcome:
    """Record `outcome`; it must be an answer (its output is checked by `verify`)."""
    rec.add(outcome)
    assert not outcome.error, f"{outcome.label}: {outcome.error}"
    return outcome


def verify(pool: Pool, rec: FaultRecord) -> None:
    """Every recorded answer equals the connector-off reference, token for token. (Run at
    the end of a test, so that the reference node's work does not count in the timings.)"""
    wrong = [o.label for o in rec.outcomes if not pool.check(o).correct]
    assert not wrong, f"outputs differ from the connector-off reference: {wrong}"


def kill_replicas(pool: Pool) -> None:
    for m in pool.replicas:
        m.kill()


def start_replicas(pool: Pool) -> None:
    """Start every replica on its old port, in parallel; return once all are SERVING."""
    with ThreadPoolExecutor(len(pool.replicas)) as ex:
        list(ex.map(lambda m: m.start(), pool.replicas))


# ---- fault 4: one of two metaserver replicas down ------------------------------------------

def test_metaserver_replica_down_clients_fail_over(pool: Pool, record: FaultRecord) -> None:
    """Nodes know both replicas; the one they use (the first) is killed: publishes, queries
    and keepalives go to the other, remote hits go on. The replica comes back on its port
    and rebuilds its index from etcd."""
    a, b = pool.a, pool.b
    for i in (0, 1):
        for node_id in ("node-a", "node-b"):
            pool.node_record(node_id, i)
    prefix, full = prompt_pair(400)
    t0 = time.monotonic()
    pool.replicas[0].kill()
    expect(record, ask(a, prefix, "A computes P4 (M1 down)"))
    pool.wait_indexed(prefix, "node-a", 1)
    hit = expect(record, ask(b, full, "B: P4+suffix (M1 down)"))
    record.timings["M1 killed -> B's remote hit via M2"] = hit.done_at - t0
    assert hit.remote_tokens == PREFIX_TOKENS and hit.failed_blocks == 0
    assert hit.query_errors == 0  # the failover is invisible to the connector

    t1 = time.monotonic()
    pool.replicas[0].start()
    record.timings["M1 restart (same port) -> SERVING"] = since(t1)

    def caught_up() -> bool:
        s0, s1 = pool.replica_stats(0), pool.replica_stats(1)
        return bool(s0 and s1 and s0.index.num_nodes == 2 and s0.index.num_copies == s1.index.num_copies)
    wait_for(caught_up, timeout_s=30, interval_s=0.05)
    record.timings["M1 restart -> its index equals M2's"] = since(t1)
    assert pool.located(prefix, 0) == ["node-a"] * PREFIX_BLOCKS
    verify(pool, record)


# ---- fault 3: the metaserver killed and restarted on the same port -------------------------

def test_metaserver_killed_and_restarted(pool: Pool, record: FaultRecord) -> None:
    """Every replica killed (-9): nodes answer every request (the query fails within
    query_timeout_s, the prompt is computed locally). A's lease (3 s) expires meanwhile, B's
    (30 s) does not. Restarted on the same ports, the index is rebuilt from etcd, A registers
    again and re-publishes what it holds (including what it computed during the outage),
    and remote hits come back."""
    a, b = pool.a, pool.b
    pa, pa_full = prompt_pair(300)
    pb, _ = prompt_pair(310)
    lease_b = pool.node_record("node-b").lease_id
    lease_a = pool.node_record("node-a").lease_id
    t0 = time.monotonic()
    kill_replicas(pool)
    a_expired = FirstTrue(lambda: not pool.etcd_has_node("node-a"), timeout_s=30, interval_s=0.1)
    oa = expect(record, ask(a, pa, "A computes P3a (no metaserver)"))
    ob = expect(record, ask(b, pb, "B computes P3b (no metaserver)"))
    assert oa.query_errors == 1 and ob.query_errors == 1 and oa.remote_tokens == ob.remote_tokens == 0

    # A's lease expires in etcd while nobody keeps it alive (B's 30 s lease does not).
    record.timings["all replicas killed -> A's lease (3 s) expired in etcd"] = a_expired.wait() - t0
    assert pool.etcd_has_node("node-b")

    t1 = time.monotonic()
    start_replicas(pool)
    outage = t1 - t0
    record.timings["outage (kill -> restart)"] = outage
    record.timings["restart -> both replicas SERVING"] = since(t1)
    wait_for(lambda: (x := pool.listed("node-a")) is not None and x[0].lease_id != lease_a,
             timeout_s=30, interval_s=0.05)
    record.timings["restart -> A registered again"] = since(t1)
    pool.wait_indexed(pa, "node-a")  # re-published, although its Publish during the outage failed
    record.timings["restart -> A's outage-time blocks re-published"] = since(t1)
    rb = pool.listed("node-b")
    assert rb is not None and rb[0].lease_id == lease_b, "B's lease should have survived the outage"

    hit = expect(record, ask(b, pa_full, "B: P3a+suffix (after restart)"))
    record.timings["restart -> B's first remote hit"] = hit.done_at - t1
    assert hit.remote_tokens == PREFIX_TOKENS and hit.query_errors == 0
    verify(pool, record)


def test_metaserver_frozen_breaker_opens_and_closes(pool: Pool, record: FaultRecord) -> None:
    """Every replica frozen (SIGSTOP): lookups time out on the connector's lookup thread, never
    on the engine's; each request waits at most the lookup deadline and is computed locally,
    correctly. After three failed lookup calls the breaker opens and requests are answered
    "no hit" without an RPC. After SIGCONT a probe closes it and remote hits come back."""
    a, b = pool.a, pool.b
    pa, pa_full = prompt_pair(900)
    t0 = time.monotonic()
    for m in pool.replicas:
        pool.freeze(m.pid)
    try:
        expect(record, ask(a, pa, "A computes P9 (metaserver frozen)"))
        for i in range(12):  # until the breaker opens (each failed call waits its RPC deadline)
            o = expect(record, ask(b, prompt_pair(910 + i)[0], f"B computes P9.{i} (metaserver frozen)"))
            assert o.remote_tokens == 0 and o.latency_s < 5, o.line()
            if b.stats().get("lookup_breaker_open"):
                break
        record.timings["freeze -> B's lookup breaker open"] = since(t0)
        skips = b.stats()["lookup_breaker_skips"]
        o = expect(record, ask(b, prompt_pair(930)[0], "B computes P9.x (breaker open)"))
        assert b.stats()["lookup_breaker_skips"] > skips and o.remote_tokens == 0
    finally:
        for m in pool.replicas:
            pool.thaw(m.pid)
    t1 = time.monotonic()
    wait_for(lambda: not b.stats()["lookup_breaker_open"], timeout_s=30, interval_s=0.05)
    record.timings["SIGCONT -> B's breaker closed"] = since(t1)
    assert b.stats()["lookup_breaker_closes"] >= 1
    pool.wait_indexed(pa, "node-a")
    hit = expect(record, ask(b, pa_full, "B: P9+suffix (after SIGCONT)"))
    assert hit.remote_tokens == PREFIX_TOKENS
    verify(pool, record)


def test_blocks_computed_during_metaserver_outage_are_shared_after_restart(pool: Pool, record: FaultRecord) -> None:
    """B computes a prompt while every replica is down; its Publish gives up (rpc deadline,
    5 s) before the replicas come back; B's 30 s lease survives. After the restart the
    index should learn B's blocks (nodes are the source of truth), so A gets a remote hit."""
    a, b = pool.a, pool.b
    p, full = prompt_pair(320)
    lease_b = pool.node_record("node-b").lease_id
    failed0 = log_count(b.log_path, "node-b: publish of")
    t0 = time.monotonic()
    kill_replicas(pool)
    expect(record, ask(b, p, "B computes P (no metaserver)"))
    wait_for(lambda: log_count(b.log_path, "node-b: publish of") > failed0, timeout_s=30, interval_s=0.1)
    record.timings["replicas killed -> B's Publish gave up"] = since(t0)
    t1 = time.monotonic()
    start_replicas(pool)
    record.timings["outage (kill -> restart)"] = t1 - t0
    rb = pool.listed("node-b")
    assert rb is not None and rb[0].lease_id == lease_b
    # One keepalive interval of B (ttl/3) and a little more for a re-publish to land.
    # ... on every replica: A may ask any of them, and they learn each other's writes only
    # through etcd (asking the best of them raced A's lookup under load).
    indexed = poll(lambda: all(pool.located(p, i) == ["node-b"] * PREFIX_BLOCKS for i in range(len(pool.replicas))),
                   timeout_s=B_LEASE_TTL_S / 3 + 2)
    o = expect(record, ask(a, full, "A: P+suffix (after restart)"))
    record.notes.append(f"B's outage-time blocks indexed after restart: {indexed}; "
                        f"A's request: {o.kind}")
    verify(pool, record)
    assert indexed and o.remote_tokens == PREFIX_TOKENS


# ---- fault 5: etcd killed and restarted ----------------------------------------------------

def test_etcd_outage_is_reported_without_writes(pool: Pool, record: FaultRecord) -> None:
    """etcd killed while the pool is idle (nodes keep their leases alive, nothing is
    published): the replicas report etcd unreachable (Stats, grpc health) anyway, and
    healthy again once etcd is back, without any write (was BUG-2, fixed: failed etcd calls
    outside the flusher and an idle-time probe update the health)."""
    from grpc_health.v1 import health_pb2

    def health_is(healthy: bool) -> bool:
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        stats = [pool.replica_stats(i) for i in (0, 1)]
        return all(s is not None and s.etcd_healthy == healthy for s in stats) and \
            all(pool.health(i, "kvpool.v1.MetaService.etcd") == status for i in (0, 1))

    t0 = time.monotonic()
    pool.etcd.kill()
    try:
        seen = poll(lambda: health_is(False), timeout_s=5.0)
        record.notes.append(f"idle pool, etcd down for {since(t0):.1f} s: outage reported by both replicas: {seen}")
        if seen:
            record.timings["etcd killed -> both replicas report it"] = since(t0)
    finally:
        t1 = time.monotonic()
        pool.etcd.start()
        record.timings["etcd restart (process healthy)"] = since(t1)
        back = poll(lambda: health_is(True), timeout_s=20.0)
        if back:
            record.timings["etcd restart -> both replicas SERVING again (no write)"] = since(t1)
        wait_for(lambda: all(s is not None and s.etcd_healthy and s.pending_writes == 0
                             for s in (pool.replica_stats(0), pool.replica_stats(1))), timeout_s=60, interval_s=0.05)
    assert seen and back


def test_etcd_killed_and_restarted(pool: Pool, record: FaultRecord) -> None:
    """With etcd down the replicas answer queries from memory (remote hits go on) and accept
    publishes into their write-behind queue; once etcd is back on its port with its data
    folder, the queue is written through: the keys are in etcd, and a replica restarted
    afterwards rebuilds them."""
    a, b = pool.a, pool.b
    p1, full1 = prompt_pair(500)
    p2, full2 = prompt_pair(510)
    expect(record, ask(a, p1, "A computes P5a (etcd up)"))
    pool.wait_indexed(p1, "node-a")

    def settled(healthy: bool) -> bool:
        stats = [pool.replica_stats(i) for i in (0, 1)]
        return all(s is not None and s.etcd_healthy == healthy and (not healthy or s.pending_writes == 0)
                   for s in stats)
    wait_for(lambda: settled(True), timeout_s=20, interval_s=0.05)

    t0 = time.monotonic()
    pool.etcd.kill()
    hit = expect(record, ask(b, full1, "B: P5a+suffix (etcd down)"))
    assert hit.remote_tokens == PREFIX_TOKENS and hit.query_errors == 0  # served from memory
    expect(record, ask(a, p2, "A computes P5b (etcd down)"))
    pool.wait_indexed(p2, "node-a", anywhere=True)  # accepted into memory by A's replica
    # The write-behind of A's publish fails: that replica now reports etcd unreachable.
    wait_for(lambda: any(s is not None and not s.etcd_healthy for s in (pool.replica_stats(0), pool.replica_stats(1))),
             timeout_s=30, interval_s=0.05)
    record.timings["etcd killed -> a replica reports it unreachable (after a write)"] = since(t0)
    pending = sum(s.pending_writes for s in (pool.replica_stats(0), pool.replica_stats(1)) if s is not None)
    assert pending >= PREFIX_BLOCKS, f"publishes during the etcd outage should be queued, {pending} are"
    record.notes.append(f"{pending} etcd writes queued while etcd was down")

    t1 = time.monotonic()
    pool.etcd.start()
    record.timings["etcd down (kill -> restart)"] = t1 - t0
    wait_for(lambda: settled(True), timeout_s=60, interval_s=0.05)
    record.timings["etcd restart -> queues written through, both replicas healthy"] = since(t1)
    keys = [b"/kvpool/blocks/node-a/" + h.hex().encode() for h in block_hashes(pool.namespace, p2)]
    assert [pool.etcd_count(k) for k in keys] == [1] * PREFIX_BLOCKS  # durable

    t2 = time.monotonic()
    pool.replicas[0].kill()
    pool.replicas[0].start()
    record.timings["M1 kill+restart (rebuild from etcd)"] = since(t2)
    assert pool.located(p2, 0) == ["node-a"] * PREFIX_BLOCKS
    hit2 = expect(record, ask(b, full2, "B: P5b+suffix (after etcd restart)"))
    assert hit2.remote_tokens == PREFIX_TOKENS
    verify(pool, record)


# ---- fault 6: a node restarted with the same node id ---------------------------------------

def test_node_restarted_with_same_id(pool: Pool, record: FaultRecord) -> None:
    """B is killed (-9) and started again as `node-b` while its old lease (30 s) is still
    live: the new registration replaces the old one and drops its blocks (the new process's
    slots hold other data, under generation numbers that start again at 1), so nobody reads
    the old blocks; what the new B computes is shared."""
    a, b = pool.a, pool.b
    p, full = prompt_pair(600)
    q, qfull = prompt_pair(610)
    expect(record, ask(b, p, "B computes P6 (old process)"))
    pool.wait_indexed(p, "node-b")
    old = pool.node_record("node-b")

    t0 = time.monotonic()
    b.kill()
    b.start()
    b.wait_ready(timeout_s=240)
    record.timings["B killed -> restarted and ready (model load)"] = since(t0)
    rec = wait_for(lambda: (x := pool.listed("node-b")) is not None and x[0].lease_id != old.lease_id and x,
                   timeout_s=20, interval_s=0.05)
    record.timings["B killed -> new registration in the index"] = since(t0)
    assert isinstance(rec, tuple) and rec[1] == 0, f"the new registration holds {rec} blocks, expected none"
    assert pool.located(p) == []
    assert pool.etcd_count(b"/kvpool/blocks/node-b/", prefix=True) == 0  # old lease revoked: keys gone

    expect(record, ask(b, q, "B computes Q6 (new process)"))
    pool.wait_indexed(q, "node-b")
    stale = expect(record, ask(a, full, "A: P6+suffix (old B's prefix)"))
    assert stale.remote_tokens == 0 and stale.failed_blocks == 0  # not offered, so not even tried
    hit = expect(record, ask(a, qfull, "A: Q6+suffix (new B's prefix)"))
    assert hit.remote_tokens == PREFIX_TOKENS
    verify(pool, record)


# ---- fault 2: the source frozen (SIGSTOP) during a read ------------------------------------

def _never_read(node: EngineProcess) -> bool:
    st = node.stats()
    return st["pool_remote_hit_blocks"] + st["pool_failed_reads"] == 0


def test_frozen_source_never_read_before_does_not_stall_the_reader(pool: Pool, record: FaultRecord) -> None:
    """B has never read from A (B was restarted by the previous test; otherwise it is
    restarted here). B parks on A's blocks and A is frozen: B's read fails within B's
    timeouts (its load delay + 2 s read timeout) and B keeps serving other requests
    meanwhile (was BUG-3: the transfer engine's first handshake with A, made on B's engine
    thread, stalled B for ~60 s). A is resumed after that deadline plus 8 s, whatever happened."""
    a, b = pool.a, pool.b
    if not _never_read(b):
        b.kill()
        b.start()
        b.wait_ready(timeout_s=240)
    assert _never_read(b)
    p, full = prompt_pair(220)
    expect(record, ask(a, p, "A computes P2x"))
    pool.wait_indexed(p, "node-a")
    probe_prompt = prompt_pair(230)[0][:10]  # no full block: no query, no load
    loading0 = b.stats()["num_requests_loading"]
    bg = Background(lambda: ask(b, full, "B: P2x+suffix (A frozen, never read)"))
    wait_loading(b, loading0)
    assert a.pid is not None
    t0 = time.monotonic()
    pool.freeze(a.pid)
    # B issues its read LOAD_DELAY_S after parking; probe B's engine once that read is out.
    poll(bg.done, timeout_s=LOAD_DELAY_S + 1)
    probe = Background(lambda: ask(b, probe_prompt, "B: 10-token prompt (A frozen)", with_stats=False))
    answered = poll(bg.done, timeout_s=LOAD_DELAY_S + B_READ_TIMEOUT_S + 8 - since(t0))
    probe_answered = probe.done()
    record.notes.append(f"A frozen {since(t0):.1f} s: B answered the parked request: {answered}, "
                        f"B answered a 10-token prompt meanwhile: {probe_answered}")
    t1 = time.monotonic()
    pool.thaw(a.pid)
    o = expect(record, bg.join())
    pr = expect(record, probe.join())
    record.timings["A frozen -> B answered the parked request"] = o.done_at - t0
    record.timings["A frozen -> B answered the 10-token prompt"] = pr.done_at - t0
    record.timings["SIGCONT -> B answered the parked request"] = o.done_at - t1
    assert o.remote_tokens in (0, PREFIX_TOKENS)
    verify(pool, record)
    assert answered and probe_answered


def test_source_frozen_during_read(pool: Pool, record: FaultRecord) -> None:
    """B reads from A once (its transfer engine knows A), then A is stopped while B waits
    to read A's blocks: B's read times out (transfer timeouts of 1 s, read timeout 2 s from
    its extra config), B recomputes and answers correctly. After SIGCONT, A serves again
    and B reads what A computes once its suspect period for A (5 s) is over."""
    a, b = pool.a, pool.b
    # A remote hit first. After the previous test's freeze B's reads from A all failed, so B
    # avoids A for its suspect_s (5 s, the connector's negative cache): retries until then.
    for k in range(8):
        pk, fk = prompt_pair(240 + k)
        expect(record, ask(a, pk, f"A computes P2w.{k}"))
        pool.wait_indexed(pk, "node-a", timeout_s=30)
        if expect(record, ask(b, fk, f"B: P2w.{k}+suffix (warm-up)")).remote_tokens == PREFIX_TOKENS:
            break
    else:
        pytest.fail("B got no remote hit from A before the freeze")
    p, full = prompt_pair(200)
    expect(record, ask(a, p, "A computes P2"))
    pool.wait_indexed(p, "node-a")
    loading0 = b.stats()["num_requests_loading"]
    bg = Background(lambda: ask(b, full, "B: P2+suffix (A frozen)"))
    wait_loading(b, loading0)
    assert a.pid is not None
    t0 = time.monotonic()
    pool.freeze(a.pid)
    o = expect(record, bg.join())
    record.timings["A frozen -> B answered (read timed out, recomputed)"] = o.done_at - t0
    assert o.remote_tokens == 0 and o.failed_blocks == PREFIX_BLOCKS
    assert o.done_at - t0 < LOAD_DELAY_S + B_READ_TIMEOUT_S + 30

    t1 = time.monotonic()
    pool.thaw(a.pid)
    for k in range(10):  # B avoids A for its suspect_s (5 s) after the failed read: retries until then
        pk, fk = prompt_pair(210 + k)
        oa = expect(record, ask(a, pk, f"A computes P2.{k} (after SIGCONT)"))
        if k == 0:
            record.timings["SIGCONT -> A answered"] = oa.done_at - t1
        pool.wait_indexed(pk, "node-a", timeout_s=30)
        ok = expect(record, ask(b, fk, f"B: P2.{k}+suffix (after SIGCONT)"))
        if ok.remote_tokens == PREFIX_TOKENS:
            record.timings["SIGCONT -> B's first remote hit from A"] = ok.done_at - t1
            break
    else:
        pytest.fail("B got no remote hit from A after A was resumed")
    verify(pool, record)


# ---- fault 1: an engine node killed (SIGKILL) mid-transfer ---------------------------------

def test_node_killed_mid_transfer(pool: Pool, record: FaultRecord) -> None:
    """A is killed while B loads A's blocks (B is parked in WAITING_FOR_REMOTE_KVS, inside
    its load window): B's read fails, B recomputes and answers correctly. The index drops A
    when A's lease (3 s) expires; failed reads do not invalidate. Runs last: A stays dead."""
    a, b = pool.a, pool.b
    p, full = prompt_pair(100)
    p2, full2 = prompt_pair(110)
    expect(record, ask(a, p, "A computes P1"))
    expect(record, ask(a, p2, "A computes P1b"))
    pool.wait_indexed(p, "node-a")
    pool.wait_indexed(p2, "node-a")
    loading0 = b.stats()["num_requests_loading"]
    bg = Background(lambda: ask(b, full, "B: P1+suffix (A killed)"))
    wait_loading(b, loading0)
    t0 = time.monotonic()
    pool.killed_for_good.add("node-a")
    a.kill()
    dropped = FirstTrue(lambda: all(pool.listed("node-a", i) is None and pool.located(p2, i) == [] for i in (0, 1)),
                        timeout_s=60)
    o = expect(record, bg.join())
    record.timings["A killed -> B answered (read failed, recomputed)"] = o.done_at - t0
    assert o.remote_tokens == 0 and o.failed_blocks == PREFIX_BLOCKS
    record.timings["A killed -> index no longer points at A (lease expiry)"] = dropped.wait() - t0
    after = expect(record, ask(b, full2, "B: P1b+suffix (A gone from index)"))
    assert after.remote_tokens == 0 and after.failed_blocks == 0  # not offered any more
    verify(pool, record)
