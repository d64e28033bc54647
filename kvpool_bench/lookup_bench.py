"""`kvpool bench lookup`: what a prefix lookup costs, against Mooncake's master, in one run.

Real processes on loopback: etcd, a metaserver, `mooncake_master` (Mooncake Store), and
worker processes. Three parts (`--parts`):

- capacity: lookups of 64-hash chains answered per second by `--nodes` simulated nodes (one
  process each, closed loop, all at once), and each lookup's latency (p50 / p99), for:
  Mooncake master `batch_is_exist` of the chain's 64 keys; our QueryPrefix one chain per
  call; QueryPrefixBatch with `--batch` chains per call (a node's lookups in flight); and
  the node-local index view (metaserver.view: a local walk, no RPC). Every answer is
  checked (all 64 present). Also the view's staleness (publish -> visible in a view), and
  the failed reads each of `--readers` reader nodes pays after a source is SIGKILLed.
- memory: a view's memory per indexed block (a local index of `--memory-blocks` blocks over
  four nodes, in its own process) and the feed's bytes per published block per watcher.
- engine: our engine in this process (the real model) with the pool connector; `--decodes`
  requests decode while new requests arrive every `--arrival-s`; the metaserver healthy,
  frozen (SIGSTOP) and killed, for each lookup mode (`--modes view,rpc`). Reported: the
  engine thread's time in the connector's scheduler side per new request (p50 / p99: every
  call made for that request) and per step (building the step's metadata, reading the
  workers' report), how long a new request waited for its lookup, and the decodes' TPOT.
  Conditions alternate in rounds (healthy, frozen, killed; restarted and recovered after
  each round), and a condition's TPOT is the median of its rounds: this shared machine's
  drift over a minute is as large as the effect measured.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvpool_bench.report import pct, write_report

CHAIN = 64
NS = "bench-lookup"
SAMPLE = 20_000  # latencies a worker sends back at most (evenly spaced)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("lookup", help="lookup capacity vs Mooncake master, view memory, engine-thread cost")
    p.add_argument("--parts", default="capacity,memory,engine")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (processes) looking up at once")
    p.add_argument("--chains", type=int, default=512, help="published 64-block chains")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each capacity step")
    p.add_argument("--batch", type=int, default=8, help="chains per QueryPrefixBatch call")
    p.add_argument("--memory-blocks", type=int, default=1_000_000)
    p.add_argument("--readers", type=int, default=4, help="reader nodes of the failed-reads step")
    p.add_argument("--requests", type=int, default=5, help="requests per reader after the source died")
    p.add_argument("--modes", default="view,rpc", help="lookup modes of the engine part")
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens each decoding request generates")
    p.add_argument("--arrival-s", type=float, default=0.25, help="a new request every this many seconds")
    p.add_argument("--rounds", type=int, default=3, help="rounds of healthy / frozen / killed per mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--out", default="runs/bench-lookup.json")


def chain_hashes(c: int) -> list[bytes]:
    return [hashlib.blake2b(f"{c}/{i}".encode(), digest_size=32).digest() for i in range(CHAIN)]


# ---- capacity: worker processes ---------------------------------------------------------

def _worker(argv: list[str]) -> int:
    """One simulated node: look chains up in a closed loop from `--start-at` for `--seconds`;
    prints {"lookups", "wrong", "latencies_us"}."""
    p = argparse.ArgumentParser()
    for flag in ("--method", "--metaserver", "--master", "--metadata", "--node"):
        p.add_argument(flag, default="")
    p.add_argument("--chains", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seconds", type=float)
    p.add_argument("--start-at", type=float)
    a = p.parse_args(argv)
    rng = random.Random(a.node)
    chains = [chain_hashes(c) for c in range(a.chains)]
    lookup: Callable[[list[list[bytes]]], int]  # -> chains answered wrongly
    closers: list[Callable[[], None]] = []
    if a.method == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", a.metadata, 16 << 20, 16 << 20, "tcp", "", a.master) != 0:
            raise SystemExit("Mooncake Store setup failed")
        keys = [[h.hex() for h in ch] for ch in chains]
        closers.append(store.close)

        key_of = {id(ch): k for ch, k in zip(chains, keys)}

        def lookup(batch: list[list[bytes]]) -> int:
            return sum(any(r != 1 for r in store.batch_is_exist(key_of[id(ch)])) for ch in batch)
    else:
        from metaserver.client import MetaClient

        client = MetaClient(a.metaserver, timeout_s=10)
        closers.append(client.close)
        if a.method == "view":
            from metaserver.view import IndexView

            view = IndexView(client, NS, a.node)
            closers.insert(0, view.close)
            if not view.wait_current(30):
                raise SystemExit("the index view did not become current")

            def lookup(batch: list[list[bytes]]) -> int:
                return sum((r := view.query(ch)) is None or r.num_matched != CHAIN for ch in batch)
        else:
            def lookup(batch: list[list[bytes]]) -> int:
                return sum(r.num_matched != CHAIN
                           for r in client.query_prefix_batch([(NS, ch) for ch in batch], a.node))
    lookup([chains[0]])  # warm: connections, first calls
    time.sleep(max(0.0, a.start_at - time.time()))
    lat: list[float] = []
    wrong = n = 0
    end = time.perf_counter() + a.seconds
    while time.perf_counter() < end:
        batch = [chains[rng.randrange(len(chains))] for _ in range(a.batch)]
        t0 = time.perf_counter()
        wrong += lookup(batch)
        dt = time.perf_counter() - t0
        lat.extend([dt * 1e6] * a.batch)  # every lookup of the call waited for the whole call
        n += a.batch
    for close in closers:
        close()
    step = max(1, len(lat) // SAMPLE)
    print(json.dumps({"lookups": n, "wrong": wrong, "latencies_us": lat[::step]}))
    return 0


def _capacity(args: argparse.Namespace, ms_address: str, master: str, metadata: str) -> list[dict]:
    methods = [("Mooncake master batch_is_exist (64 keys)", "mooncake", 1), ("QueryPrefix (1 chain / call)", "rpc", 1),
               (f"QueryPrefixBatch ({args.batch} chains / call)", "rpc", args.batch),
               ("index view (local walk)", "view", 1)]
    rows = []
    print(f"\nlookup capacity: chains of {CHAIN} hashes, {args.nodes} simulated nodes at once, "
          f"{args.seconds:.0f} s each, {os.cpu_count()} cores")
    print(f"{'method':44} {'lookups/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'vs Mooncake':>11}")
    for label, method, batch in methods:
        start_at = time.time() + 4.0
        procs = [subprocess.Popen([sys.executable, "-m", "kvpool_bench.lookup_bench", "--worker", "--method", method,
                                   "--metaserver", ms_address, "--master", master, "--metadata", metadata,
                                   "--node", f"sim-{i}", "--chains", str(args.chains), "--batch", str(batch),
                                   "--seconds", str(args.seconds), "--start-at", str(start_at)],
                                  stdout=subprocess.PIPE, text=True) for i in range(args.nodes)]
        outs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{method} worker failed ({proc.returncode})")
            outs.append(json.loads(out))
        lat = [x for o in outs for x in o["latencies_us"]]
        row = {"method": label, "lookups_per_s": sum(o["lookups"] for o in outs) / args.seconds,
               "p50_ms": pct(lat, 50) / 1e3, "p99_ms": pct(lat, 99) / 1e3, "wrong": sum(o["wrong"] for o in outs)}
        if rows:
            row["vs_mooncake"] = row["lookups_per_s"] / rows[0]["lookups_per_s"]
        rows.append(row)
        ratio = f"{row['vs_mooncake']:.2f}x" if "vs_mooncake" in row else "1.00x"
        print(f"{label:44} {row['lookups_per_s']:10.0f} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {ratio:>11}"
              + (f"  ({row['wrong']} WRONG answers)" if row["wrong"] else ""), flush=True)
    return rows


def _populate(ms_address: str, master: str, metadata: str, args: argparse.Namespace):  # noqa: ANN202
    """Register the simulated nodes and publish every chain (chain c on node c % nodes) in
    the metaserver, and the same hashes as keys in Mooncake Store. Returns the Store client
    (the keys live in its segment: keep it open) and its registered buffer."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    from metaserver.client import MetaClient
    from metaserver.types import BlockHash, BlockRecord

    with MetaClient(ms_address, timeout_s=30) as client:
        for i in range(args.nodes):
            client.register_node(f"sim-{i}", f"127.0.0.1:{20000 + i}", 1 << 40, 1 << 40, NS, 3600)
        for c in range(args.chains):
            client.publish(f"sim-{c % args.nodes}", [BlockRecord(BlockHash(h), (c * CHAIN + k) * 4096, 4096, 1)
                                                    for k, h in enumerate(chain_hashes(c))])
        while client.stats().pending_writes:
            time.sleep(0.05)
    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", metadata, 256 << 20, 64 << 20, "tcp", "", master) != 0:
        raise RuntimeError("Mooncake Store setup failed")
    value = np.zeros(64, dtype=np.uint8)
    store.register_buffer(value.ctypes.data, value.nbytes)
    for c in range(args.chains):
        keys = [h.hex() for h in chain_hashes(c)]
        rcs = store.batch_put_from(keys, [value.ctypes.data] * CHAIN, [64] * CHAIN)
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"Mooncake Store put returned {set(rcs)}")
    return store, value  # the registered bytes must outlive the store


def _staleness(ms_address: str, n: int = 50) -> dict:
    """Publish one block at a time through the metaserver; time until a view offers it."""
    from metaserver.client import MetaClient
    from metaserver.types import BlockHash, BlockRecord
    from metaserver.view import IndexView

    lat = []
    with MetaClient(ms_address) as client:
        view = IndexView(client, NS, "staleness")
        try:
            view.wait_current(30)
            for k in range(n):
                h = hashlib.blake2b(f"stale/{k}".encode(), digest_size=32).digest()
                t0 = time.perf_counter()
                client.publish("sim-0", [BlockRecord(BlockHash(h), k * 4096, 4096, 1)])
                while (r := view.query([h])) is None or r.num_matched == 0:
                    time.sleep(0.0002)
                lat.append(time.perf_counter() - t0)
        finally:
            view.close()
    out = {"publish_to_view_p50_ms": 1e3 * pct(lat, 50), "publish_to_view_p99_ms": 1e3 * pct(lat, 99)}
    print(f"staleness: publish (acknowledged) -> offered by a view: p50 {out['publish_to_view_p50_ms']:.2f} ms, "
          f"p99 {out['publish_to_view_p99_ms']:.2f} ms ({n} publishes, same replica)")
    return out


# ---- memory -----------------------------------------------------------------------------

def _memory_worker(argv: list[str]) -> int:
    """A view's local index of N blocks over four nodes, in a fresh process: RSS growth."""
    from metaserver.feed import Change, Kind, encode_changes
    from metaserver.index import BlockIndex
    from metaserver.types import BlockHash, BlockRecord, Namespace, NodeId, NodeRecord

    n = int(argv[0])

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    index = BlockIndex()
    for i in range(4):
        index.upsert_node(NodeRecord(NodeId(f"n{i}"), f"127.0.0.1:{i + 1}", 0, 1 << 50, Namespace(NS), 1, 10))
    hashes = [os.urandom(32) for _ in range(n)]  # made before the baseline: the hashes exist anyway (the chain)
    before = rss()
    for k, h in enumerate(hashes):
        index.add_block(NodeId(f"n{k % 4}"), BlockRecord(BlockHash(h), k * 4096, 4096, 1))
    grown = rss() - before
    batch = [Change(k, Namespace(NS), Kind.ADD, NodeId("n0"), BlockRecord(BlockHash(hashes[k]), k * 4096, 4096, 1))
             for k in range(64)]
    print(json.dumps({"blocks": n, "bytes_per_block": grown / n,
                      "feed_bytes_per_block": encode_changes(batch, "e" * 16, 64).ByteSize() / 64}))
    return 0


def _memory(args: argparse.Namespace) -> dict:
    out = json.loads(subprocess.run([sys.executable, "-m", "kvpool_bench.lookup_bench", "--memory-worker",
                                     str(args.memory_blocks)], check=True, capture_output=True, text=True).stdout)
    print(f"\nview memory: {out['bytes_per_block']:.0f} bytes per indexed block "
          f"({out['bytes_per_block'] * 1e6 / 2**20:.0f} MiB per 1M blocks, measured at {out['blocks']:,}); "
          f"fan-out: {out['feed_bytes_per_block']:.0f} bytes per published block to each watching node")
    return out


# ---- failed reads -----------------------------------------------------------------------

def _failed_reads(args: argparse.Namespace, ms_address: str) -> dict:
    """A source pool process holds a chain; `--readers` reader nodes know it; the source is
    SIGKILLed; each reader then asks for the chain `--requests` times, the readers in turn.
    Counts the reads that failed per reader (target: at most one each)."""
    from kvpool_bench.transfer_source import block_hash
    from kvpool_harness.pool_reader import PoolReader

    size, n = 65536, 8
    ns, chain = f"bench-{size}", [block_hash(size, i) for i in range(n)]
    src = subprocess.Popen([sys.executable, "-m", "kvpool_bench.transfer_source", "--metaserver", ms_address,
                            "--sizes", str(size), "--blocks", str(n)], stdout=subprocess.PIPE, text=True)
    readers: list[PoolReader] = []
    try:
        assert src.stdout is not None
        src.stdout.readline()  # published
        readers = [PoolReader(ms_address, f"reader-{i}", ns, size, n) for i in range(args.readers)]
        deadline = time.monotonic() + 30
        while any(r.offered(chain) < n * r.block_size for r in readers):  # every reader's view has the chain
            if time.monotonic() > deadline:
                raise RuntimeError("the readers never saw the source's chain")
            time.sleep(0.01)
        src.kill()
        src.wait()
        offered = [0] * len(readers)
        for _ in range(args.requests):
            for i, r in enumerate(readers):
                offered[i] += r.request(chain) > 0
        failed = [r.failed_loads for r in readers]
    finally:
        for r in readers:
            r.close()
        if src.poll() is None:
            src.kill()
            src.wait()
    out = {"readers": args.readers, "requests_per_reader": args.requests, "failed_reads_per_reader": failed,
           "offers_of_the_dead_source_per_reader": offered}
    print(f"\nfailed reads after the source was SIGKILLed: {args.readers} readers x {args.requests} requests, in turn: "
          f"per reader {failed} (max {max(failed)}, target <= 1); requests offered the dead source: {offered}")
    return out


# ---- engine -----------------------------------------------------------------------------

class ConnectorTimer:
    """Wraps the scheduler-side connector's methods: engine-thread time per request and per step."""

    PER_REQUEST = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "request_finished")
    PER_STEP = ("build_connector_meta", "update_connector_output")

    def __init__(self, connector: object) -> None:
        self.per_request: dict[str, float] = {}
        self.step_s: list[float] = []
        self.answered_at: dict[str, float] = {}   # request id -> first non-None lookup answer
        self._connector = connector
        for name in self.PER_REQUEST + self.PER_STEP:
            setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def remove(self) -> None:
        """Unwrap (the next run's timer must not time this one's wrappers)."""
        for name in self.PER_REQUEST + self.PER_STEP:
            delattr(self._connector, name)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        per_request = name in self.PER_REQUEST

        def timed(*a: object, **kw: object) -> object:
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            t1 = time.perf_counter()
            if per_request:
                rid = a[0].request_id  # type: ignore[attr-defined]
                self.per_request[rid] = self.per_request.get(rid, 0.0) + (t1 - t0)
                if name == "get_num_new_matched_tokens" and result[0] is not None:  # type: ignore[index]
                    self.answered_at.setdefault(rid, t1)
            else:
                self.step_s.append(t1 - t0)
            return result

        return timed


def _engine_run(engine, args: argparse.Namespace, label: str, rng: random.Random) -> dict:  # noqa: ANN001
    from engine.request import SamplingParams

    timer = ConnectorTimer(engine.connector)
    vocab = engine.model_config.vocab_size
    decode = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    short = SamplingParams(max_tokens=1)
    token_times: dict[str, list[float]] = {}
    for i in range(args.decodes):
        rid = f"{label}-decode-{i}"
        engine.add_request([rng.randrange(100, vocab) for _ in range(32)], decode, rid)
        token_times[rid] = []
    added: dict[str, float] = {}
    steps: list[tuple[float, float]] = []   # (start, end) of every engine step
    next_arrival, k = time.perf_counter(), 0
    before = dict(engine.stats())
    while any(len(t) < args.decode_tokens for t in token_times.values()):
        now = time.perf_counter()
        if now >= next_arrival:
            rid = f"{label}-new-{k}"
            engine.add_request([rng.randrange(100, vocab) for _ in range(64)], short, rid)  # 3 full blocks to look up
            added[rid] = now
            k += 1
            next_arrival += args.arrival_s
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        steps.append((t0, t1))
        for out in outs:
            if out.request_id in token_times:
                token_times[out.request_id].append(t1)
    while engine.has_unfinished():
        engine.step()
    timer.remove()
    after = engine.stats()
    tpot = [(t[-1] - t[1]) / (len(t) - 2) for t in token_times.values() if len(t) > 2]  # after the first decode
    req = [1e6 * timer.per_request[r] for r in added if r in timer.per_request]
    waits = [timer.answered_at[r] - t for r, t in added.items() if r in timer.answered_at]
    # A lookup holds its request at most lookup_deadline_s; the host asks once per step, so the
    # answer is seen within the deadline plus the step that was running then (and the next).
    deadline = engine.connector.scheduler.settings.lookup_deadline_s
    longest = max((b - a for a, b in steps), default=0.0)
    over = sum(w > deadline + 2 * longest for w in waits)
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in
             ("lookup_view_answers", "lookup_queries", "lookup_deadline_misses", "lookup_query_errors",
              "lookup_breaker_skips")}
    return {"new_requests": len(added), "req_us_p50": pct(req, 50), "req_us_p99": pct(req, 99),
            "req_us_max": max(req, default=float("nan")),
            "step_us_p50": 1e6 * pct(timer.step_s, 50), "step_us_p99": 1e6 * pct(timer.step_s, 99),
            "tpot_ms": 1e3 * statistics.mean(tpot), "lookup_wait_ms_max": 1e3 * max(waits, default=0.0),
            "lookup_wait_ms_p50": 1e3 * pct(waits, 50), "engine_step_ms_max": 1e3 * longest, "waits_over": over,
            **delta}


def _recovered(engine, mode: str, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    """Wait until the node's lookups work again after a restart: its view is current, or
    its lookup breaker closed."""
    key, want = ("lookup_view_current", 1) if mode == "view" else ("lookup_breaker_open", 0)
    deadline = time.monotonic() + timeout_s
    while engine.stats().get(key) != want and time.monotonic() < deadline:
        engine.step() if engine.has_unfinished() else time.sleep(0.05)


def _engine(args: argparse.Namespace, etcd_endpoint: str, tmp: Path) -> dict:
    """Per lookup mode: rounds of (healthy, frozen, killed), the metaserver restarted and the
    node recovered after each round; the figures of a condition are its rounds' median."""
    import torch

    from engine.config import EngineConfig
    from engine.kv_connector.config import KVTransferConfig
    from engine.llm_engine import LLMEngine
    from kvpool_harness.processes import MetaserverProcess, free_port

    torch.set_num_threads(args.threads)
    port = free_port()
    runs, summary = [], []
    rng = random.Random(7)
    print(f"\nengine thread: {args.decodes} requests decode {args.decode_tokens} tokens while a 64-token request "
          f"arrives every {args.arrival_s * 1e3:.0f} ms; {args.rounds} rounds of healthy / frozen / killed per mode "
          f"(torch threads {args.threads})")
    print(f"{'mode':5} {'metaserver':10} {'round':>5} {'req p50 us':>10} {'req p99 us':>10} {'step p99 us':>11} "
          f"{'TPOT ms':>8} {'wait max ms':>11} {'engine step max ms':>18}  answers")
    for mode in args.modes.split(","):
        ms = MetaserverProcess(etcd_endpoint, tmp / f"ms-{mode}.log", port=port, log_level="WARNING").start()
        kvt = KVTransferConfig("mooncake", kv_role="kv_consumer", kv_connector_extra_config={
            "metaserver": ms.address, "node_id": f"bench-{mode}", "pool_size": "64MiB",
            "lookup_view": mode == "view"})
        engine = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20, kv_transfer_config=kvt))
        try:
            _engine_run(engine, args, f"warm-{mode}", rng)  # first steps, connections, the view's snapshot
            for r in range(args.rounds):
                for condition in ("healthy", "frozen", "killed"):
                    if condition == "frozen":
                        os.kill(ms.pid, signal.SIGSTOP)
                    elif condition == "killed":
                        ms.kill()
                    try:
                        row = {"mode": mode, "metaserver": condition, "round": r,
                               **_engine_run(engine, args, f"{mode}-{condition}-{r}", rng)}
                    finally:
                        if condition == "frozen":
                            os.kill(ms.pid, signal.SIGCONT)
                    runs.append(row)
                    answers = (f"view {row['lookup_view_answers']:.0f}, rpc {row['lookup_queries']:.0f}, "
                               f"deadline {row['lookup_deadline_misses']:.0f}, "
                               f"failed {row['lookup_query_errors']:.0f}, breaker {row['lookup_breaker_skips']:.0f}")
                    print(f"{mode:5} {condition:10} {r:5} {row['req_us_p50']:10.0f} {row['req_us_p99']:10.0f} "
                          f"{row['step_us_p99']:11.0f} {row['tpot_ms']:8.1f} {row['lookup_wait_ms_max']:11.1f} "
                          f"{row['engine_step_ms_max']:18.1f}  {answers}", flush=True)
                    if condition == "killed":
                        ms = MetaserverProcess(etcd_endpoint, tmp / f"ms-{mode}-{r}.log", port=port,
                                               log_level="WARNING").start()
                    _recovered(engine, mode)
        finally:
            engine.close()
            ms.stop()
        summary += _summarize([row for row in runs if row["mode"] == mode])
    print(f"\n{'mode':5} {'metaserver':10} {'TPOT ms (median)':>16} {'vs healthy':>10} {'req p99 us (max)':>16} "
          f"{'wait max ms':>11} {'waits > deadline + 1 step':>25}")
    for row in summary:
        print(f"{row['mode']:5} {row['metaserver']:10} {row['tpot_ms']:16.1f} {row['tpot_vs_healthy']:9.2f}x "
              f"{row['req_us_p99']:16.0f} {row['lookup_wait_ms_max']:11.1f} {row['waits_over']:25d}")
    return {"runs": runs, "summary": summary}


def _summarize(rows: list[dict]) -> list[dict]:
    out = []
    for condition in ("healthy", "frozen", "killed"):
        mine = [row for row in rows if row["metaserver"] == condition]
        out.append({"mode": rows[0]["mode"], "metaserver": condition,
                    "tpot_ms": statistics.median(row["tpot_ms"] for row in mine),
                    "req_us_p99": max(row["req_us_p99"] for row in mine),
                    "lookup_wait_ms_max": max(row["lookup_wait_ms_max"] for row in mine),
                    "waits_over": sum(row["waits_over"] for row in mine)})
    for row in out:
        row["tpot_vs_healthy"] = row["tpot_ms"] / out[0]["tpot_ms"]
    return out


# ---- main -------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    from kvpool_bench.transfer_bench import start_master
    from kvpool_harness.processes import EtcdProcess, MetaserverProcess

    parts = set(args.parts.split(","))
    report: dict = {"bench": "lookup", "nodes": args.nodes, "chain": CHAIN, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-lookup-") as d:
        tmp = Path(d)
        with EtcdProcess(tmp / "etcd") as etcd:
            if "capacity" in parts:
                master_proc, master, metadata = start_master(tmp)
                try:
                    with MetaserverProcess(etcd.endpoint, tmp / "ms.log", log_level="WARNING") as ms:
                        store, _buffer = _populate(ms.address, master, metadata, args)
                        try:
                            report["capacity"] = _capacity(args, ms.address, master, metadata)
                            report["staleness"] = _staleness(ms.address)
                            report["failed_reads"] = _failed_reads(args, ms.address)
                        finally:
                            store.close()
                finally:
                    master_proc.kill()
                    master_proc.wait()
            if "memory" in parts:
                report["memory"] = _memory(args)
            if "engine" in parts:
                report["engine"] = _engine(args, etcd.endpoint, tmp)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    if sys.argv[1:2] == ["--memory-worker"]:
        sys.exit(_memory_worker(sys.argv[2:]))
    raise SystemExit("run it as `kvpool bench lookup`")
