"""`kvpool bench chaos`: the pool under a steady workload while processes fail, on loopback.

What it runs: a 3-member etcd cluster (`EtcdCluster`), 2 metaserver replicas on it, 2
`kvpool serve --kv-connector mooncake` nodes with small DRAM pools over a disk tier, and
`kvpool router` (prefix policy) in front. Each node reaches the two replicas through two
`TcpProxy`s of its own (`kvpool_harness.tcp_proxy`; its `--metaserver P1,P2`), so a partition
cuts that node's links only; the router and the checker reach the replicas directly.
`--clients`
closed-loop clients send multi-turn chats (`kvpool_bench.workloads.multi_turn`: groups of
users share a system prompt, each round extends the previous prompt) through the router.

The timeline: `--warmup` fault-free seconds, then `--duration` seconds of nemesis, then
`--quiet` fault-free seconds after the last fault healed. The nemesis (`schedule`, seeded)
starts a fault event every `--interval-min`..`--interval-max` seconds after the previous
one healed. An event is one fault or, with probability `--double-p`, two at once on
different processes, each one of:
    kill / stop   SIGKILL / SIGSTOP of a node, a metaserver replica, one etcd member, two
                  etcd members at once (the quorum is lost) or the router
    restart       a node stopped cleanly (SIGTERM) and started again with the same id
    partition     a node cut off from both metaserver replicas: its proxies blackhole (no
                  byte goes either way, nothing is closed: both ends see only timeouts; the
                  node keeps serving, its lookups, publishes and keepalives fail)
    disk          a node's disk tier directory removed under the running node (the tier
                  turns itself off at its next I/O, unpublishes what it held, and the node
                  goes on from DRAM)
It heals after `--heal-min`..`--heal-max` seconds: partitioned links forward again (the bytes
held meanwhile are delivered, as TCP's retransmission would after a short partition; the
node's session re-publishes after its first good keepalive), stopped processes get SIGCONT,
a node that lost its disk is restarted cleanly (the tier made afresh, empty: a new disk),
ended ones are started again with the same identity, ports, data folders and flags (etcd
members first, then replicas, nodes, the router). A run with two events or more has at least
one double fault and one quorum loss, one with four or more also a partition and a disk
fault (the schedule makes sure of it).

The checker's rules (any one broken: verdict FAIL, exit code 1):
  1. every answer equals, token for token, the greedy answer of a node without a connector
     (started after the cluster is down, same model and engine flags; `--output-tokens`
     tokens, EOS ignored): 0 wrong answers;
  2. every request is accounted for: answered, possibly after attempts the client saw fail
     (HTTP error, error chunk, broken or short stream, timeout: it retries after 0.5 s),
     within `--request-bound` seconds of its first attempt; none lost, none late. Each
     attempt's socket reads time out after `--attempt-timeout` s (a frozen router);
  3. after the quiet stretch, once the nodes' publish queues are empty, each replica's
     index lists for each node exactly the blocks it holds (in DRAM or only on its disk
     tier; `kvpool_bench.soak.index_vs_holdings`), within 60 s of convergence;
  4. the prefix-hit rate (local + pool hit tokens over prompt tokens) of requests started
     in the quiet stretch is at most `--max-hit-drop` (absolute) under that of the warm-up
     (its first third is left out: a cold start);
  5. every process runs at the end, and no process's RSS (sampled every `--sample-s` s)
     is above `--rss-limit-mib`;
  6. in a run of at least twice `--rss-baseline` seconds, no process leaks (`rss_by_age`):
     each process (one PID) that ran twice `--rss-baseline` ends within `--rss-growth` of
     its RSS at that age, and where a name's processes (the nemesis starts them again)
     reached that age, its last one's RSS then is within `--rss-growth` of its first one's.
     A process is compared with itself, or its successor, at the same age: RSS climbs with
     age (caches, Go's heap target, mapped database pages), so a young process at the end
     against an old one at the baseline says nothing of a leak. The by-name ratio, end over
     baseline, is still printed.

The etcd members compact their history periodically (`--etcd-compaction`) and snapshot
every `--etcd-snapshot-count` raft entries, with Go's memory limit `--etcd-gomemlimit`, as
the Helm chart's do; `--distinct-conversations`
bounds the set of prompts (and so the reference answers) of a long run.

Not built: partitions elsewhere (between the nodes' transfer ports, or an
etcd member cut off from its peers: the same proxy fits, the ports must then go through
it); a full disk (ENOSPC) under a tier rather than a removed one (a small tmpfs or loop
device needs root; tests/kvpool/test_disk.py has the unit test where root is there).
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from kvpool_bench.cross_node import stream_completion
from kvpool_bench.report import pct, write_report
from kvpool_bench.chaos_plot import plot, process_names
from kvpool_bench.soak import index_vs_holdings, rss_bytes
from kvpool_bench.workloads import BenchRequest, multi_turn

NODES, REPLICAS, ETCD = 2, 2, 3
BACKOFF_S = 0.5


# ---- the nemesis's schedule (no processes) ---------------------------------------------

@dataclass(frozen=True)
class Fault:
    action: str                 # kill | stop | restart | partition | disk
    targets: tuple[str, ...]    # node-i, ms-i, etcd-i (two of them: the quorum), router

    def __str__(self) -> str:
        return f"{self.action} {'+'.join(self.targets)}"

    @property
    def quorum_loss(self) -> bool:
        return sum(t.startswith("etcd-") for t in self.targets) >= 2


@dataclass(frozen=True)
class Event:
    at_s: float                 # seconds after the previous event healed (the first: after the warm-up)
    faults: tuple[Fault, ...]   # applied at once
    heal_s: float               # seconds after which all of them heal


def _one_fault(rng: random.Random, kind: str) -> Fault:
    if kind in ("partition", "disk"):  # a node's links to the metaservers; its disk tier
        return Fault(kind, (f"node-{rng.randrange(NODES)}",))
    if kind == "node":
        return Fault(rng.choice(["kill", "stop", "restart"]), (f"node-{rng.randrange(NODES)}",))
    if kind == "ms":
        return Fault(rng.choice(["kill", "stop"]), (f"ms-{rng.randrange(REPLICAS)}",))
    if kind == "etcd":
        return Fault(rng.choice(["kill", "stop"]), (f"etcd-{rng.randrange(ETCD)}",))
    if kind == "quorum":
        pair = sorted(rng.sample(range(ETCD), 2))
        return Fault(rng.choice(["kill", "stop"]), tuple(f"etcd-{i}" for i in pair))
    return Fault(rng.choice(["kill", "stop"]), ("router",))


KINDS = {"node": 0.25, "ms": 0.15, "etcd": 0.12, "quorum": 0.12, "router": 0.16, "partition": 0.12, "disk": 0.08}


def _faults(rng: random.Random, count: int, force: str = "") -> tuple[Fault, ...]:
    """`count` faults on different processes, at most two etcd members down in all;
    `force`: the first one's kind."""
    out: list[Fault] = []
    while len(out) < count:
        kind = force if force and not out else rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        f = _one_fault(rng, kind)
        taken = {t for g in out for t in g.targets}
        etcd = sum(t.startswith("etcd-") for g in [*out, f] for t in g.targets)
        if taken.isdisjoint(f.targets) and etcd <= 2:
            out.append(f)
    return tuple(out)


def schedule(seed: int, duration_s: float, interval: tuple[float, float] = (20, 60),
             heal: tuple[float, float] = (3, 10), double_p: float = 0.35) -> list[Event]:
    """The nemesis's events for `duration_s` seconds (nominal: restarts take longer), seeded.
    Two events or more: at least one double fault and one quorum loss; four or more: also at
    least one partition and one disk fault."""
    rng = random.Random(seed)
    events: list[Event] = []
    t = 0.0
    while True:
        gap, heal_s = round(rng.uniform(*interval), 1), round(rng.uniform(*heal), 1)
        if t + gap + heal_s > duration_s:
            break
        events.append(Event(gap, _faults(rng, 2 if rng.random() < double_p else 1), heal_s))
        t += gap + heal_s
    if len(events) >= 4:  # forced into event 1 or 2: the fixes below change only the first and the last
        wanted = ("partition", "disk")
        for kind in wanted:
            if not any(f.action == kind for e in events for f in e.faults):
                # one that holds neither kind, so the other one's fault stays
                i = next((i for i in (1, 2) if all(f.action not in wanted for f in events[i].faults)), 1)
                e = events[i]
                events[i] = Event(e.at_s, _faults(rng, len(e.faults), force=kind), e.heal_s)
    if len(events) >= 2:
        if not any(len(e.faults) == 2 for e in events):
            e = events[0]
            events[0] = Event(e.at_s, _faults(rng, 2, force=rng.choice(["node", "ms", "router"])), e.heal_s)
        if not any(f.quorum_loss for e in events for f in e.faults):
            e = events[-1]
            events[-1] = Event(e.at_s, _faults(rng, len(e.faults), force="quorum"), e.heal_s)
    return events


# ---- the cluster -----------------------------------------------------------------------

class ChaosCluster:
    """The processes, by the names the schedule uses; each started again with its identity."""

    def __init__(self, run_dir: Path, args: argparse.Namespace) -> None:
        from kvpool_harness.cluster import ClusterSpec, LocalCluster, clear_disks
        from kvpool_harness.processes import EtcdCluster, MetaserverProcess
        from kvpool_harness.router_node import RouterProcess
        from kvpool_harness.tcp_proxy import TcpProxy

        run_dir.mkdir(parents=True, exist_ok=True)
        clear_disks(run_dir)
        self.engine_args = ("--threads", "1", "--kv-cache-bytes", args.kv_cache_bytes)
        # As deployed (the Helm chart's flags): periodic compaction, with a retention an hour-long
        # run reaches (else etcd keeps every revision), and a snapshot every --etcd-snapshot-count
        # raft entries (etcd holds the entries since the last one in memory); GOMEMLIMIT, as
        # the chart's etcd.goMemLimit sets it, so that Go's heap target (twice the live heap by
        # default) is bounded by what the member is given, not by its largest live heap so far.
        self.etcd = EtcdCluster(run_dir, ETCD, extra_args=(
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", args.etcd_compaction,
            "--snapshot-count", str(args.etcd_snapshot_count)),
            env={"GOMEMLIMIT": args.etcd_gomemlimit} if args.etcd_gomemlimit else None)
        self.replicas = [MetaserverProcess(self.etcd.endpoints, run_dir / f"ms-{i}.log") for i in range(REPLICAS)]
        self.ms = ",".join(m.address for m in self.replicas)
        # Each node reaches each replica through a proxy of its own (a partition cuts one
        # node's links only); the router and the checker reach the replicas directly.
        self.links = {f"node-{i}": [TcpProxy(m.address) for m in self.replicas] for i in range(NODES)}
        spec = ClusterSpec(nodes=NODES, model=args.model, pool_size=args.pool_size, pool_disk_size=args.pool_disk_size,
                           engine_args=self.engine_args)
        local = LocalCluster(run_dir, spec)
        self.nodes = [local._node(i, ",".join(p.address for p in self.links[f"node-{i}"]))  # with their disk tiers
                      for i in range(NODES)]
        self.router = RouterProcess(run_dir / "router.log", [n.url for n in self.nodes], "prefix", self.ms,
                                    extra_args=("--model", args.model))
        self.frozen: set[str] = set()
        self.ended: set[str] = set()
        self.partitioned: set[str] = set()
        self.disk_lost: set[str] = set()    # nodes whose disk tier was removed: restarted at the heal

    def procs(self) -> dict[str, object]:
        return {**{f"etcd-{i}": m for i, m in enumerate(self.etcd.members)},
                **{f"ms-{i}": m for i, m in enumerate(self.replicas)},
                **{n.node_id: n for n in self.nodes}, "router": self.router}

    def pid(self, name: str) -> int | None:
        p = self.procs()[name]
        proc = p.proc  # type: ignore[attr-defined]
        return proc.pid if proc is not None and proc.poll() is None else None

    def disk_dir(self, name: str) -> Path:
        """Node `name`'s disk tier directory (its `--pool-disk`)."""
        args = list(self.procs()[name].extra_args)  # type: ignore[attr-defined]
        return Path(args[args.index("--pool-disk") + 1])

    def up(self, timeout_s: float = 300) -> None:
        for proxies in self.links.values():
            for p in proxies:
                p.start()
        self.etcd.start()
        for m in self.replicas:
            m.start()
        for n in self.nodes:
            n.start()
        for n in self.nodes:
            n.wait_ready(timeout_s)
        self.router.start(timeout_s)

    def apply(self, f: Fault) -> None:
        for name in f.targets:
            p = self.procs()[name]
            if f.action == "partition":  # the node's bytes to and from the replicas stop, nothing closes
                for proxy in self.links[name]:
                    proxy.blackhole()
                self.partitioned.add(name)
            elif f.action == "disk":  # under the running node: its tier turns itself off, DRAM goes on
                shutil.rmtree(self.disk_dir(name))
                self.disk_lost.add(name)
            elif f.action == "stop":
                os.kill(self.pid(name), signal.SIGSTOP)  # type: ignore[arg-type]
                self.frozen.add(name)
            else:  # kill: SIGKILL; restart: SIGTERM (a clean shutdown), started again at the heal
                p.kill() if f.action == "kill" else p.stop()  # type: ignore[attr-defined]
                self.ended.add(name)

    def heal(self, timeout_s: float = 300) -> None:
        for name in sorted(self.partitioned):
            for proxy in self.links[name]:
                proxy.heal()
        self.partitioned.clear()
        for name in sorted(self.frozen):
            pid = self.pid(name)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        self.frozen.clear()
        for name in sorted(self.disk_lost):  # a new disk: a clean restart, the tier made afresh (empty)
            self.procs()[name].stop()  # type: ignore[attr-defined]
            self.ended.add(name)
        self.disk_lost.clear()
        ended, procs = sorted(self.ended), self.procs()
        etcd = [procs[n] for n in ended if n.startswith("etcd-")]
        for m in etcd:
            m.launch()  # type: ignore[attr-defined]
        for m in etcd:
            m.wait_healthy(60)  # type: ignore[attr-defined]
        for n in ended:
            if n.startswith("ms-"):
                procs[n].start()  # type: ignore[attr-defined]
        nodes = [procs[n] for n in ended if n.startswith("node-")]
        for n in nodes:
            n.start()  # type: ignore[attr-defined]
        for n in nodes:
            n.wait_ready(timeout_s)  # type: ignore[attr-defined]
        if "router" in ended:
            self.router.start(timeout_s)
        self.ended.clear()

    def down(self) -> None:
        for name in list(self.frozen):
            pid = self.pid(name)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        self.router.stop()
        for n in self.nodes:
            n.stop()
        for proxies in self.links.values():
            for p in proxies:
                p.close()
        for m in self.replicas:
            m.stop()
        self.etcd.stop()


def run_nemesis(cluster: ChaosCluster, events: list[Event], t0: float, log: list[dict]) -> None:
    """Apply each event, wait, heal; times (seconds from `t0`) go into `log`."""
    for e in events:
        time.sleep(e.at_s)
        at = time.perf_counter() - t0
        for f in e.faults:
            cluster.apply(f)
        print(f"[{at:7.1f} s] fault: {', '.join(map(str, e.faults))}", flush=True)
        time.sleep(e.heal_s)
        healing = time.perf_counter() - t0
        cluster.heal()
        healed = time.perf_counter() - t0
        print(f"[{healed:7.1f} s] healed ({healed - healing:.1f} s to restart)", flush=True)
        log.append({"faults": [str(f) for f in e.faults], "at_s": round(at, 1), "heal_started_s": round(healing, 1),
                    "healed_s": round(healed, 1), "double": len(e.faults) == 2,
                    "quorum_loss": any(f.quorum_loss for f in e.faults)})


# ---- the workload and the clients -------------------------------------------------------

def conversations(seed: int, output_tokens: int, distinct: int = 0):  # noqa: ANN201
    """Conversations (each a user's rounds, in order) forever: 8 users in 2 groups that share
    a 128-token system prompt, 4 rounds of 32 user + 32 reply tokens; then new ones.
    `distinct` > 0: the batches of 8 come round again after that many (the reference answers
    of a long run stay a bounded set; batches far apart still miss every cache)."""
    for gen in itertools.count():
        reqs = multi_turn(users=8, rounds=4, groups=2, system_tokens=128, user_tokens=32, reply_tokens=32,
                          output_tokens=output_tokens, seed=seed * 1000 + (gen % distinct if distinct else gen))
        by_user: dict[str, list[BenchRequest]] = {}
        for r in reqs:
            by_user.setdefault(r.session, []).append(r)
        yield from by_user.values()


@dataclass
class Outcome:
    rid: str
    start_s: float
    attempts: int = 0
    answered: bool = False
    e2e_s: float = 0.0
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    errors: list[str] = field(default_factory=list)   # the first few failed attempts'
    correct: bool | None = None
    conversation: int = 0                              # the n-th conversation a client took
    prompt: tuple[int, ...] = field(default=(), repr=False)
    output: tuple[int, ...] = field(default=(), repr=False)


def send(url: str, req: BenchRequest, t0: float, bound_s: float, attempt_timeout_s: float) -> Outcome:
    """One request until answered (retries after each failed attempt) or `bound_s` passed."""
    start = time.perf_counter()
    out = Outcome(req.rid, start - t0, prompt=req.prompt, prompt_tokens=len(req.prompt))
    while time.perf_counter() - start < bound_s:
        out.attempts += 1
        try:
            r = stream_completion(url, req, 0, timeout_s=attempt_timeout_s)
            err = r.error or ("" if r.output_tokens == req.max_tokens and len(r.output_ids) == req.max_tokens
                              else f"short answer: {len(r.output_ids)} of {req.max_tokens} tokens")
        except Exception as exc:  # noqa: BLE001 -- a broken stream (IncompleteRead, ...) is a failed attempt
            err = f"{type(exc).__name__}: {exc}"
        if not err:
            out.answered, out.ttft_s, out.output = True, r.ttft_s, r.output_ids
            out.hit_tokens = r.local_hit_tokens + r.remote_hit_tokens
            break
        if len(out.errors) < 3:
            out.errors.append(err[:200])
        time.sleep(BACKOFF_S)
    out.e2e_s = time.perf_counter() - start
    return out


class Clients:
    """`n` closed-loop clients, each taking the next whole conversation and sending its
    rounds one after another, until `stop()` (each finishes the request it is in)."""

    def __init__(self, url: str, n: int, seed: int, output_tokens: int, bound_s: float, attempt_timeout_s: float,
                 t0: float, distinct: int = 0) -> None:
        self.url, self.bound_s, self.attempt_timeout_s, self.t0 = url, bound_s, attempt_timeout_s, t0
        self._convs = conversations(seed, output_tokens, distinct)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self._taken = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                conv = next(self._convs)
                self._taken += 1
                n = self._taken
            for req in conv:
                if self._stop.is_set():
                    return
                o = send(self.url, req, self.t0, self.bound_s, self.attempt_timeout_s)
                o.conversation = n
                with self._lock:
                    self.outcomes.append(o)

    def stop(self) -> list[str]:
        """Stop; the names of clients still running after the bound (hung)."""
        self._stop.set()
        deadline = time.monotonic() + self.bound_s + 10
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0))
        return [t.name for t in self._threads if t.is_alive()]


# What etcd says of its own memory, so that an RSS that grows can be told apart: the bbolt
# file (mapped, so its touched pages count in RSS), the Go heap, and the keys it holds.
ETCD_GAUGES = {"etcd_mvcc_db_total_size_in_bytes": "db", "etcd_mvcc_db_total_size_in_use_in_bytes": "db_in_use",
               "go_memstats_heap_inuse_bytes": "heap_inuse", "go_memstats_heap_sys_bytes": "heap_sys",
               "etcd_debugging_mvcc_keys_total": "keys", "etcd_server_proposals_committed_total": "committed"}


def etcd_gauges(endpoint: str, timeout_s: float = 2.0) -> dict[str, float]:
    """The `ETCD_GAUGES` read from etcd's /metrics (empty when it does not answer in time)."""
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ETCD_GAUGES:
            out[ETCD_GAUGES[name]] = float(value)
    return out


class RssSampler:
    """Every process's RSS by name every `every_s` seconds (PIDs change on restarts)."""

    def __init__(self, cluster: ChaosCluster, every_s: float, t0: float) -> None:
        self.cluster, self.every_s, self.t0 = cluster, every_s, t0
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        pids = {n: self.cluster.pid(n) for n in self.cluster.procs()}
        etcd = {f"etcd-{i}": etcd_gauges(m.endpoint) for i, m in enumerate(self.cluster.etcd.members)
                if pids[f"etcd-{i}"] is not None and f"etcd-{i}" not in self.cluster.frozen}
        self.samples.append({"t_s": round(time.perf_counter() - self.t0, 1),
                             **{n: rss_bytes(pid) for n, pid in pids.items()}, "pids": pids, "etcd": etcd})

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()


REFERENCES = 2  # reference nodes, each with the nodes' flags (--threads 1): one per core


def references(outcomes: list[Outcome], run_dir: Path, model: str, engine_args: tuple[str, ...]) -> None:
    """Set `correct` on each answered outcome: its output against a connector-off node's
    greedy answer for the same prompt. REFERENCES such nodes share the work, each taking
    whole conversations, their prompts in start order (a node's own prefix cache makes a
    conversation's later rounds cheap); each node answers alone, with the nodes' flags."""
    from kvpool_harness.engine_node import EngineProcess

    answered = sorted((o for o in outcomes if o.answered), key=lambda o: o.start_s)
    max_tokens = max((len(o.output) for o in answered), default=1)
    shares = [list(dict.fromkeys(o.prompt for o in answered if o.conversation % REFERENCES == k))
              for k in range(REFERENCES)]
    nodes = [EngineProcess(run_dir / f"reference-{k}.log", f"reference-{k}", extra_args=engine_args, model=model,
                           env={"OMP_WAIT_POLICY": "PASSIVE"}) for k in range(REFERENCES)]
    refs: dict[tuple[int, ...], tuple[int, ...]] = {}
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_ready()

        def one(url: str, p: tuple[int, ...]) -> tuple[int, ...]:
            req = BenchRequest("ref", p, max_tokens)
            for _ in range(3):
                r = stream_completion(url, req, 0, timeout_s=120)
                if not r.error:
                    return r.output_ids
            raise RuntimeError(f"the reference node failed: {r.error}")
        pools = [ThreadPoolExecutor(2) for _ in nodes]  # two requests in flight at each node
        try:
            futures = {p: pool.submit(one, node.url, p) for node, pool, share in zip(nodes, pools, shares)
                       for p in share}
            refs = {p: f.result() for p, f in futures.items()}
        finally:
            for pool in pools:
                pool.shutdown(cancel_futures=True)
    finally:
        for node in nodes:
            node.stop()
    for o in answered:
        o.correct = o.output == refs[o.prompt]


# ---- the checker and the report ------------------------------------------------------------

def rss_growth(samples: list[dict], baseline_s: float) -> dict[str, dict]:
    """Per process name: its RSS in the first sample at or after `baseline_s` in which it runs,
    its RSS in the last sample, their ratio, and how many times it was started again between
    them (a new PID). Empty when the run ended before `baseline_s`."""
    later = [x for x in samples if x["t_s"] >= baseline_s]
    if not samples or not later:
        return {}
    out = {}
    for n in process_names(samples[-1]):
        base = next((x for x in later if x[n]), None)
        if base is None or not samples[-1][n]:
            continue
        pids = [x["pids"][n] for x in later if x["t_s"] >= base["t_s"] and x["pids"][n] is not None]
        out[n] = {"base_t_s": base["t_s"], "base": base[n], "end": samples[-1][n],
                  "ratio": round(samples[-1][n] / base[n], 3),
                  "restarts": sum(a != b for a, b in zip(pids, pids[1:]))}
    return out


def instances(samples: list[dict], name: str) -> list[list[tuple[float, int]]]:
    """The processes that ran under `name`, in start order, each as its (time, RSS) samples.
    A process is one PID; its age at a sample is that sample's time less its first's."""
    out: list[list[tuple[float, int]]] = []
    last_pid = None
    for x in samples:
        pid = x["pids"].get(name)
        if pid is None or not x[name]:
            continue
        if pid != last_pid:
            out.append([])
            last_pid = pid
        out[-1].append((x["t_s"], x[name]))
    return out


def _at_age(life: list[tuple[float, int]], age_s: float) -> tuple[float, int] | None:
    """The first sample of a process at or past `age_s` seconds of its life."""
    return next(((t, r) for t, r in life if t - life[0][0] >= age_s), None)


def rss_by_age(samples: list[dict], age_s: float) -> dict[str, dict]:
    """The leak rule, per process rather than per name (the nemesis starts processes again, and
    a process's RSS climbs with its age: caches, Go's heap target, a database's mapped pages):
    - `lived`: each process that ran at least twice `age_s`: its RSS at its last sample over
      its RSS at the age of `age_s` (what "within 10% of its value after the first 10
      minutes" means for a process that was not started with the run);
    - `restarted`: per name with at least two processes that reached the age of `age_s`: the
      last one's RSS at that age over the first one's, so that state which grows from one
      process to the next (a leak that a restart does not clear) shows too.
    Ratios are rounded to 3 places."""
    lived, restarted = [], {}
    for n in process_names(samples[-1]) if samples else []:
        lives = instances(samples, n)
        aged = [(life, base) for life in lives if (base := _at_age(life, age_s)) is not None]
        for life, base in aged:
            if life[-1][0] - life[0][0] >= 2 * age_s:
                lived.append({"name": n, "from_s": life[0][0], "base_t_s": base[0], "base": base[1], "end_t_s": life[-1][0],
                              "end": life[-1][1], "ratio": round(life[-1][1] / base[1], 3)})
        if len(aged) >= 2:
            (first_life, first), (last_life, last) = aged[0], aged[-1]
            restarted[n] = {"processes": len(lives), "compared": len(aged), "first_from_s": first_life[0][0],
                            "first": first[1], "last_from_s": last_life[0][0], "last": last[1],
                            "ratio": round(last[1] / first[1], 3)}
    return {"lived": lived, "restarted": restarted}


def hit_rate(outs: list[Outcome]) -> float:
    prompt = sum(o.prompt_tokens for o in outs if o.answered)
    return sum(o.hit_tokens for o in outs if o.answered) / prompt if prompt else 0.0


def summarize(outs: list[Outcome], phases: dict[str, tuple[float, float]], faults: list[dict], rss: list[dict],
              index: dict[str, list[dict]], hung: list[str], alive: dict[str, bool], args: argparse.Namespace) -> dict:
    answered = [o for o in outs if o.answered]
    late = [o for o in answered if o.e2e_s > args.request_bound]
    windows = {name: [o for o in outs if lo <= o.start_s < hi] for name, (lo, hi) in phases.items()}
    rates = {name: hit_rate(w) for name, w in windows.items()}
    buckets = []
    end = max((o.start_s for o in outs), default=0.0)
    for lo in range(0, int(end) + 1, int(args.window_s)):
        w = [o for o in outs if lo <= o.start_s < lo + args.window_s]
        buckets.append({"from_s": lo, "requests": len(w), "hit_rate": round(hit_rate(w), 3),
                        "retried": sum(o.attempts > 1 for o in w)})
    names = process_names(rss[0]) if rss else []
    rss_table = {n: {"start": next((s[n] for s in rss if s[n]), 0), "end": rss[-1][n], "peak": max(s[n] for s in rss)}
                 for n in names}
    limit = args.rss_limit_mib * 2 ** 20
    # The leak rule needs a run that outlives its baseline by as long again.
    end_t = rss[-1]["t_s"] if rss else 0.0
    growth = rss_growth(rss, args.rss_baseline) if end_t >= 2 * args.rss_baseline else {}
    by_age = rss_by_age(rss if growth else [], args.rss_baseline)
    index_ok = all(all(c["pool_blocks"] == c["index_blocks"] for c in checks) and checks for checks in index.values())
    checks = {
        "no wrong answers": all(o.correct is not False for o in answered) and all(o.correct is not None for o in answered),
        "no request lost or late": len(answered) == len(outs) and not late and not hung,
        "index = holdings on every replica": index_ok,
        "quiet hit rate within --max-hit-drop of warm-up": rates["quiet"] >= rates["warmup"] - args.max_hit_drop,
        "every process runs, RSS under the limit": all(alive.values()) and all(r["peak"] <= limit for r in rss_table.values()),
        "faults applied": bool(faults) or args.duration < args.interval_min + args.heal_max,
    }
    if by_age["lived"] or by_age["restarted"]:
        checks["RSS of each process within --rss-growth of its own at the baseline's age"] = all(
            g["ratio"] <= 1 + args.rss_growth for g in [*by_age["lived"], *by_age["restarted"].values()])
    ttft = [o.ttft_s for o in answered]
    at_base = next((x for x in rss if x["t_s"] >= args.rss_baseline), None)
    etcd = {n: {"baseline": at_base.get("etcd", {}).get(n, {}), "end": rss[-1].get("etcd", {}).get(n, {})}
            for n in names if n.startswith("etcd-")} if at_base else {}
    return {
        "verdict": "PASS" if all(checks.values()) else "FAIL", "checks": checks,
        "requests": len(outs), "answered": len(answered), "retried": sum(o.attempts > 1 for o in answered),
        "failed": len(outs) - len(answered), "late": len(late), "hung_clients": hung,
        "wrong": sum(o.correct is False for o in answered), "attempts_failed": sum(o.attempts - o.answered for o in outs),
        "error_samples": list(dict.fromkeys(e for o in outs for e in o.errors))[:8],
        "hit_rate": {k: round(v, 3) for k, v in rates.items()}, "hit_rate_windows": buckets,
        "phases": {k: [round(lo, 1), round(hi, 1)] for k, (lo, hi) in phases.items()},
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "ttft_by_phase": {k: {"p50": pct([o.ttft_s for o in w if o.answered], 50),
                              "p99": pct([o.ttft_s for o in w if o.answered], 99)} for k, w in windows.items()},
        "faults": faults, "rss": rss_table, "rss_growth": growth, "rss_by_age": by_age, "etcd_gauges": etcd, "alive": alive, "index_check": index,
    }


def print_summary(s: dict) -> None:
    mib = 2 ** 20
    print("\nfaults:")
    for f in s["faults"]:
        print(f"  {f['at_s']:7.1f} s  {', '.join(f['faults']):<40} healed at {f['healed_s']:.1f} s")
    print(f"requests {s['requests']}: answered {s['answered']} (retried {s['retried']}), failed {s['failed']}, "
          f"late {s['late']}, wrong {s['wrong']}; failed attempts {s['attempts_failed']}")
    for e in s["error_samples"]:
        print(f"  attempt error: {e}")
    print("hit rate: " + ", ".join(f"{k} {v:.3f}" for k, v in s["hit_rate"].items()))
    print("hit rate per window: " + " ".join(f"{b['from_s']}s:{b['hit_rate']:.2f}" for b in s["hit_rate_windows"]))
    print(f"TTFT p50 / p99 (s): {s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f}; by phase: "
          + ", ".join(f"{k} {v['p50']:.2f}/{v['p99']:.2f}" for k, v in s["ttft_by_phase"].items()))
    print("RSS start / end / peak (MiB):")
    for n, r in s["rss"].items():
        print(f"  {n:<8} {r['start'] / mib:6.0f} / {r['end'] / mib:6.0f} / {r['peak'] / mib:6.0f}")
    if s["rss_growth"]:
        print("RSS end / baseline by name (MiB; baseline: first sample from --rss-baseline on; not judged: "
              "a name's process at the end may be younger than its process at the baseline):")
        for n, g in s["rss_growth"].items():
            print(f"  {n:<8} {g['end'] / mib:6.0f} / {g['base'] / mib:6.0f} at {g['base_t_s']:.0f} s = {g['ratio']:.3f}"
                  f" (started again {g['restarts']} times since)")
    by_age = s.get("rss_by_age") or rss_by_age([], 0.0)  # a summary written before the rule
    if by_age["lived"]:
        print("RSS at the end of each process that ran twice --rss-baseline / at that age (MiB):")
        for g in by_age["lived"]:
            print(f"  {g['name']:<8} from {g['from_s']:6.0f} s: {g['end'] / mib:6.0f} at {g['end_t_s']:.0f} s / "
                  f"{g['base'] / mib:6.0f} at {g['base_t_s']:.0f} s = {g['ratio']:.3f}")
    if by_age["restarted"]:
        print("RSS at the age of --rss-baseline, the name's last process / its first (MiB):")
        for n, g in by_age["restarted"].items():
            print(f"  {n:<8} {g['last'] / mib:6.0f} (started {g['last_from_s']:.0f} s) / {g['first'] / mib:6.0f} "
                  f"(started {g['first_from_s']:.0f} s) = {g['ratio']:.3f}; {g['compared']} of its "
                  f"{g['processes']} processes reached that age")
    judged = {g["name"] for g in by_age["lived"]} | set(by_age["restarted"])
    if s["rss_growth"] and set(s["rss_growth"]) - judged:
        print("  not judged (no process of it ran twice --rss-baseline, nor two to its age): "
              + ", ".join(sorted(set(s["rss_growth"]) - judged)))
    if any(g["baseline"] and g["end"] for g in s.get("etcd_gauges", {}).values()):
        print("etcd's own gauges, baseline -> end (MiB; keys):")
        for n, g in s["etcd_gauges"].items():
            b, e = g["baseline"], g["end"]
            print(f"  {n:<8} " + ", ".join(
                f"{k} {b.get(k, 0) / (1 if k == 'keys' else mib):.0f} -> {e.get(k, 0) / (1 if k == 'keys' else mib):.0f}"
                for k in ("db", "db_in_use", "heap_inuse", "heap_sys", "keys")))
    faults = [f for e in s["faults"] for f in e["faults"]]
    print(f"fault events {len(s['faults'])}, faults {len(faults)}: double {sum(e['double'] for e in s['faults'])}, "
          f"quorum losses {sum(e['quorum_loss'] for e in s['faults'])}, "
          f"partitions {sum(f.startswith('partition') for f in faults)}, disk {sum(f.startswith('disk') for f in faults)}")
    for rep, checks in s["index_check"].items():
        print(f"index = holdings on {rep}: " + ", ".join(f"{c['node']} {c['index_blocks']}/{c['pool_blocks']}"
                                                         for c in checks))
    for k, ok in s["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {k}")
    print(f"verdict: {s['verdict']}")


def check_index(cluster: ChaosCluster, timeout_s: float = 60.0) -> dict[str, list[dict]]:
    """Each replica's index against the nodes' holdings, polled until they agree or `timeout_s`."""
    shim = SimpleNamespace(nodes=cluster.nodes)
    out: dict[str, list[dict]] = {}
    for i, m in enumerate(cluster.replicas):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                checks = index_vs_holdings(shim, timeout_s=30, address=m.address)
            except Exception as err:  # noqa: BLE001 -- a replica that does not answer fails the rule
                checks = [{"node": "?", "pool_blocks": 0, "index_blocks": -1, "error": str(err)[:200]}]
            if all(c["pool_blocks"] == c["index_blocks"] for c in checks) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        out[f"ms-{i}"] = checks
    return out


# ---- the command ------------------------------------------------------------------------

def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("chaos", help="faults under load: right answers, no lost requests, index = holdings")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of nemesis (after the warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=60.0, help="fault-free seconds first")
    p.add_argument("--quiet", type=float, default=60.0, help="fault-free seconds after the last heal")
    p.add_argument("--interval-min", type=float, default=20.0, help="seconds from a heal to the next fault, min")
    p.add_argument("--interval-max", type=float, default=60.0)
    p.add_argument("--heal-min", type=float, default=3.0, help="seconds a fault lasts, min")
    p.add_argument("--heal-max", type=float, default=10.0)
    p.add_argument("--double-p", type=float, default=0.35, help="probability of two faults at once")
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--request-bound", type=float, default=180.0, help="seconds a request may take, retries included")
    p.add_argument("--attempt-timeout", type=float, default=60.0, help="socket read timeout of one attempt")
    p.add_argument("--max-hit-drop", type=float, default=0.05,
                   help="quiet hit rate may be at most this far (absolute) under the warm-up's")
    p.add_argument("--rss-limit-mib", type=float, default=3072.0)
    p.add_argument("--rss-baseline", type=float, default=600.0,
                   help="seconds into the run of the RSS baseline (the leak rule: runs of twice as long)")
    p.add_argument("--rss-growth", type=float, default=0.10, help="RSS at the end over the baseline's, max growth")
    p.add_argument("--distinct-conversations", type=int, default=0,
                   help="batches of conversations before they come round again (0: never)")
    p.add_argument("--etcd-compaction", default="10m", help="etcd --auto-compaction-retention (periodic)")
    p.add_argument("--etcd-snapshot-count", type=int, default=10000,
                   help="etcd --snapshot-count (the Helm chart's default; etcd 3.4's own is 100000)")
    p.add_argument("--etcd-gomemlimit", default="80MiB",
                   help="each etcd member's GOMEMLIMIT (the chart's etcd.goMemLimit; '': none). Sized for "
                        "this cluster's members: about 50 MiB of live heap")
    p.add_argument("--pool-size", default="48MiB", help="each node's DRAM pool (small: it evicts to disk)")
    p.add_argument("--pool-disk-size", default="192MiB", help="each node's disk tier")
    p.add_argument("--kv-cache-bytes", default="64MiB")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=20.0, help="hit-rate window in the report")
    p.add_argument("--run-dir", default="runs/chaos")
    p.add_argument("--out", default="", help="JSON report (default RUN_DIR/report.json)")


def main(args: argparse.Namespace) -> int:
    if min(args.duration, args.warmup, args.quiet, args.interval_min, args.heal_min, args.clients) <= 0 \
            or args.interval_max < args.interval_min or args.heal_max < args.heal_min:
        print("kvpool bench chaos: error: durations, intervals and --clients must be positive (min <= max)",
              file=sys.stderr)
        return 2
    events = schedule(args.seed, args.duration, (args.interval_min, args.interval_max),
                      (args.heal_min, args.heal_max), args.double_p)
    print(f"seed {args.seed}: {len(events)} fault events: "
          + "; ".join(", ".join(map(str, e.faults)) for e in events), flush=True)
    run_dir = Path(args.run_dir)
    cluster = ChaosCluster(run_dir, args)
    faults: list[dict] = []
    try:
        cluster.up()
        t0 = time.perf_counter()
        clients = Clients(cluster.router.url, args.clients, args.seed, args.output_tokens, args.request_bound,
                          args.attempt_timeout, t0, args.distinct_conversations)
        sampler = RssSampler(cluster, args.sample_s, t0)
        time.sleep(args.warmup)
        chaos_at = time.perf_counter() - t0
        run_nemesis(cluster, events, t0, faults)
        time.sleep(max(args.duration - (time.perf_counter() - t0 - chaos_at), 0))
        quiet_at = time.perf_counter() - t0
        time.sleep(args.quiet)
        hung = clients.stop()
        end_at = time.perf_counter() - t0
        sampler.stop()
        index = check_index(cluster)
        alive = {n: cluster.pid(n) is not None for n in cluster.procs()}
    except RuntimeError as err:
        print(f"kvpool bench chaos: error: {err}", file=sys.stderr)
        return 1
    finally:
        cluster.down()
    outs = clients.outcomes
    references(outs, run_dir, args.model, cluster.engine_args)
    phases = {"warmup": (args.warmup / 3, chaos_at), "chaos": (chaos_at, quiet_at), "quiet": (quiet_at, end_at)}
    s = summarize(outs, phases, faults, sampler.samples, index, hung, alive, args)
    print_summary(s)
    report = {"bench": "chaos", "seed": args.seed, "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
              "schedule": [{"at_s": e.at_s, "faults": [str(f) for f in e.faults], "heal_s": e.heal_s} for e in events],
              "summary": s, "rss_samples": sampler.samples,
              "requests": [{k: v for k, v in asdict(o).items() if k not in ("prompt", "output")} for o in outs]}
    out = Path(args.out or run_dir / "report.json")
    write_report(str(out), report)
    print(f"timeline: {plot(report, out.with_name(out.stem + '-timeline.png'))}")
    return 0 if s["verdict"] == "PASS" else 1
