"""Helpers of the fault drills (`test_faults.py`): a whole pool as real processes on
127.0.0.1, requests whose effect is read from usage and /stats, and probes of the index
(through the metaserver) and of etcd (through its JSON gateway).

The pool: one etcd, two metaserver replicas on it, and three `kvpool serve` nodes running
the real model (SmolLM2-135M, fp32, one torch thread each):
- A (`node-a`): kv_both, lease TTL 3 s (its death leaves the index within seconds);
- B (`node-b`): kv_both, lease TTL 30 s (its lease outlives a metaserver outage and a
  restart), `debug_load_delay_s` (a window between its query and its read, in which a test
  kills or freezes the source) and small transfer/read timeouts (a frozen source costs
  seconds, not the defaults' 10 s);
- C (`node-c`): connector off, the reference every output is compared with.
A and B know both replicas (`--metaserver M1,M2`). Every process is ended by PID.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.block_pool import chain_seed, hash_blocks
from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from metaserver.client import MetaClient, ServerStats
from metaserver.errors import MetaError
from metaserver.types import BlockHash, NodeRecord
from tests.conftest import tokens, wait_for

BS = 16                   # tokens per block (the engine's default)
PREFIX_BLOCKS = 6         # a shared prefix: 6 full blocks
PREFIX_TOKENS = PREFIX_BLOCKS * BS
MAX_TOKENS = 6
ENGINE_ARGS = ("--kv-cache-bytes", "64MiB", "--max-num-batched-tokens", "512", "--threads", "1")
LOAD_DELAY_S = 2.0        # B waits this long between its query and its read
B_READ_TIMEOUT_S = 2.0    # B gives up on a read after this (frozen source)
A_LEASE_TTL_S = 3
LOOKUP_DEADLINE_S = 3.0   # how long a request waits for its lookup (see _kv_config)
B_LEASE_TTL_S = 30
# Nodes share 2 cores: OpenMP threads that spin after their work would steal the CPU.
NODE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}




def prompt_pair(seed: int) -> tuple[list[int], list[int]]:
    """(prefix of PREFIX_BLOCKS blocks, the prefix plus an 8-token suffix)."""
    prefix = tokens(seed, PREFIX_TOKENS)
    return prefix, prefix + tokens(seed + 100_000, 8)


def block_hashes(namespace: str, token_ids: list[int]) -> list[BlockHash]:
    """The chained hashes the engines compute for the full blocks of `token_ids`."""
    return hash_blocks(chain_seed(namespace, None), token_ids, BS)


# ---- requests ---------------------------------------------------------------------------

@dataclass
class Outcome:
    """One request and what it did on its node (from usage and the node's /stats deltas)."""

    node: str
    label: str
    latency_s: float
    remote_tokens: int = 0        # prompt tokens loaded from the pool
    local_tokens: int = 0         # prompt tokens hit in the node's own prefix cache
    failed_blocks: int = 0        # blocks whose load failed (recomputed)
    query_errors: int = 0         # lookups that went without an answer: failed, past the deadline, breaker open
    out_ids: list[int] = field(default_factory=list)
    correct: bool | None = None   # output == the connector-off reference
    error: str = ""
    prompt: list[int] = field(default_factory=list, repr=False)
    done_at: float = 0.0          # time.monotonic() when the answer arrived

    @property
    def kind(self) -> str:
        if self.error:
            return "error"
        if self.remote_tokens:
            return "remote hit" + (f" ({self.failed_blocks} blocks failed)" if self.failed_blocks else "")
        if self.failed_blocks:
            return f"recompute ({self.failed_blocks} blocks failed to load)"
        if self.query_errors:
            return "local compute (lookup missed)"
        return "local compute"

    def line(self) -> str:
        ok = {True: "correct", False: "WRONG", None: "-"}[self.correct]
        return (f"  {self.label:<34} on {self.node:<7} {self.latency_s:6.2f} s  remote {self.remote_tokens:>3} "
                f"local {self.local_tokens:>3}  {self.kind:<38} {ok}")


def ask(node: EngineProcess, prompt: list[int], label: str, with_stats: bool = True) -> Outcome:
    """A greedy completion on `node`; its counters are read before and after (so do not run
    two at once on one node). A failed HTTP call becomes an Outcome with `error` set."""
    before = node.stats() if with_stats else {}
    t0 = time.monotonic()
    try:
        body = node.complete(prompt, MAX_TOKENS)
    except (RuntimeError, OSError) as err:
        now = time.monotonic()
        return Outcome(node.node_id, label, now - t0, error=str(err), prompt=prompt, done_at=now)
    now = time.monotonic()
    details = body["usage"]["prompt_tokens_details"]
    out = Outcome(node.node_id, label, now - t0, details["remote_cached_tokens"], details["local_cached_tokens"],
                  out_ids=body["choices"][0]["token_ids"], prompt=prompt, done_at=now)
    if with_stats:
        after = node.stats()
        out.failed_blocks = int(after["failed_load_blocks"] - before["failed_load_blocks"])
        # The request went on without an answer for one of these reasons (one of them per lookup:
        # a deadline miss drops the late answer, the open breaker sends nothing).
        misses = ("lookup_query_errors", "lookup_deadline_misses", "lookup_breaker_skips")
        out.query_errors = int(sum(after.get(k, 0) - before.get(k, 0) for k in misses))
    return out


class Background:
    """A request run on a thread (the test acts while it is in flight)."""

    def __init__(self, fn: Callable[[], Outcome]) -> None:
        self._result: list[Outcome] = []
        self._thread = threading.Thread(target=lambda: self._result.append(fn()), daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float = 120.0) -> Outcome:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"request still running after {timeout_s:g} s"
        return self._result[0]


class FirstTrue:
    """Polls `predicate` on a thread from now on, until it holds or `timeout_s` passes;
    `wait()` gives the time.monotonic() at which it first held (the test fails otherwise)."""

    def __init__(self, predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05) -> None:
        self.at: float | None = None
        self._timeout_s = timeout_s

        def run() -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if predicate():
                    self.at = time.monotonic()
                    return
                time.sleep(interval_s)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait(self) -> float:
        self._thread.join(self._timeout_s + 10)
        if self.at is None:
            pytest.fail(f"condition not met within {self._timeout_s:g}s")
        return self.at


def wait_loading(node: EngineProcess, before: int, timeout_s: float = 30.0) -> None:
    """Until `node` parks one more request in WAITING_FOR_REMOTE_KVS."""
    wait_for(lambda: node.stats()["num_requests_loading"] > before, timeout_s=timeout_s, interval_s=0.02)


def poll(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Like `wait_for`, but answers False at the deadline instead of failing the test."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def log_count(path: Path, text: str) -> int:
    try:
        return path.read_text(errors="replace").count(text)
    except FileNotFoundError:
        return 0


# ---- the pool ---------------------------------------------------------------------------

class Pool:
    """etcd, metaserver replicas M1 and M2, and engine nodes A, B, C (see the module docstring)."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.etcd = EtcdProcess(run / "etcd")
        self.replicas = [MetaserverProcess(self.etcd.endpoint, run / f"metaserver-{i + 1}.log", log_level="INFO")
                         for i in range(2)]
        endpoints = ",".join(m.address for m in self.replicas)
        self.a = EngineProcess(run / "A.log", "node-a", endpoints, pool_size="64MiB", extra_args=ENGINE_ARGS,
                               env=NODE_ENV, kv_transfer_config=_kv_config({"lease_ttl_s": A_LEASE_TTL_S}))
        self.b = EngineProcess(run / "B.log", "node-b", endpoints, pool_size="64MiB", extra_args=ENGINE_ARGS,
                               env=NODE_ENV, kv_transfer_config=_kv_config({
                                   "lease_ttl_s": B_LEASE_TTL_S, "debug_load_delay_s": LOAD_DELAY_S,
                                   "transfer_timeout_s": 1, "progress_timeout_s": 1,
                                   "read_timeout_s": B_READ_TIMEOUT_S}))
        self.c = EngineProcess(run / "C.log", "node-c", extra_args=ENGINE_ARGS, env=NODE_ENV)
        self.nodes = [self.a, self.b, self.c]
        self.frozen: set[int] = set()       # PIDs stopped with SIGSTOP
        self.killed_for_good: set[str] = set()  # node ids a test ended on purpose (not healed)
        self._replica_clients = [MetaClient(m.address, timeout_s=2.0) for m in self.replicas]
        self._refs: dict[tuple[int, ...], list[int]] = {}
        self.namespace = ""

    # lifecycle
    def up(self) -> Pool:
        self.etcd.start()
        for m in self.replicas:
            m.start()
        for n in self.nodes:  # load the models in parallel
            n.start()
        for n in self.nodes:
            n.wait_ready(timeout_s=240)
        self.namespace = self.node_record("node-a").namespace
        return self

    def down(self) -> None:
        for pid in list(self.frozen):
            _signal(pid, signal.SIGCONT)
        for n in self.nodes:
            n.stop()
        for m in self.replicas:
            m.stop()
        self.etcd.stop()
        for c in self._replica_clients:
            c.close()

    def heal(self) -> None:
        """Undo what a failed test may have left: thaw, restart dead processes."""
        for pid in list(self.frozen):
            self.thaw(pid)
        if self.etcd.proc is None or self.etcd.proc.poll() is not None:
            self.etcd.start()
        for m in self.replicas:
            if not m.alive():
                m.start()
        dead = [n for n in self.nodes if not n.alive() and n.node_id not in self.killed_for_good]
        for n in dead:
            n.start()
        for n in dead:
            n.wait_ready(timeout_s=240)

    def freeze(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.frozen.add(pid)

    def thaw(self, pid: int) -> None:
        _signal(pid, signal.SIGCONT)
        self.frozen.discard(pid)

    # the reference
    def reference(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._refs:
            self._refs[key] = self.c.complete(prompt, MAX_TOKENS)["choices"][0]["token_ids"]
        return self._refs[key]

    def check(self, outcome: Outcome) -> Outcome:
        outcome.correct = None if outcome.error else outcome.out_ids == self.reference(outcome.prompt)
        return outcome

    # the index
    def replica_stats(self, i: int) -> ServerStats | None:
        try:
            return self._replica_clients[i].stats()
        except MetaError:
            return None

    def health(self, i: int, service: str) -> int:
        """grpc.health.v1 status of `service` on replica i (UNKNOWN when it does not answer)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.replicas[i].address) as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=1).status
            except grpc.RpcError:
                return health_pb2.HealthCheckResponse.UNKNOWN

    def node_record(self, node_id: str, replica: int | None = None) -> NodeRecord:
        """The node's record in the index (waits up to 20 s for it)."""
        rec = wait_for(lambda: self.listed(node_id, replica), timeout_s=20, interval_s=0.05)
        assert isinstance(rec, tuple)
        return rec[0]

    def listed(self, node_id: str, replica: int | None = None) -> tuple[NodeRecord, int] | None:
        """(record, number of blocks) of `node_id` in replica `replica`'s index or, with
        `replica` None, in the first replica that lists it; None if absent or unreachable."""
        for i in range(len(self.replicas)) if replica is None else (replica,):
            try:
                nodes = self._replica_clients[i].list_nodes()
            except MetaError:
                continue
            found = next(((r, n) for r, n in nodes if r.node_id == node_id), None)
            if found is not None:
                return found
        return None

    def located(self, token_ids: list[int], replica: int | None = None) -> list[str]:
        """The node each block of `token_ids`'s matched prefix is located at, by replica
        `replica` or (None) by the replica that matches the most (replicas agree only
        through etcd, so they differ while it is down)."""
        best: list[str] = []
        for i in range(len(self.replicas)) if replica is None else (replica,):
            try:
                res = self._replica_clients[i].query_prefix(self.namespace, block_hashes(self.namespace, token_ids))
            except MetaError:
                continue
            if len(res.locations) > len(best):
                best = [loc.node_id for loc in res.locations]
        return best

    def wait_indexed(self, token_ids: list[int], node_id: str, replica: int | None = None,
                     anywhere: bool = False, timeout_s: float = 20.0) -> None:
        """Until every full block of `token_ids` is located at `node_id` by replica
        `replica`, or (None) by every replica, or with `anywhere` by at least one (replicas
        learn each other's changes only through etcd)."""
        want = [node_id] * (len(token_ids) // BS)
        if replica is not None or anywhere:
            wait_for(lambda: self.located(token_ids, replica) == want, timeout_s=timeout_s, interval_s=0.05)
        else:
            wait_for(lambda: all(self.located(token_ids, i) == want for i in range(len(self.replicas))),
                     timeout_s=timeout_s, interval_s=0.05)

    def etcd_count(self, key: bytes, prefix: bool = False) -> int:
        """Keys in etcd equal to `key` (or under it, with `prefix`), through the v3 JSON gateway."""
        body: dict[str, object] = {"key": base64.b64encode(key).decode(), "count_only": True}
        if prefix:
            body["range_end"] = base64.b64encode(key[:-1] + bytes([key[-1] + 1])).decode()
        req = urllib.request.Request(f"http://{self.etcd.endpoint}/v3/kv/range", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=2) as resp:
            return int(json.loads(resp.read()).get("count", 0))

    def etcd_has_node(self, node_id: str) -> bool:
        return self.etcd_count(b"/kvpool/nodes/" + node_id.encode()) > 0


def _kv_config(extra: dict[str, object]) -> dict[str, object]:
    # Lookups by RPC: these drills test the path a node falls back to whenever its index view
    # is not current (deadline, breaker); the view's own faults are in tests/metaserver/test_view.py.
    # A lookup waits up to LOOKUP_DEADLINE_S, not the default 0.1 s: on a slow, loaded machine a
    # healthy lookup could miss 0.1 s, and the drills assert hits where the pool is healthy; a
    # lookup to a dead or frozen metaserver still ends within query_timeout_s (1 s).
    return {"kv_connector": "mooncake", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_view": False, "lookup_deadline_s": LOOKUP_DEADLINE_S, **extra}}


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---- the record -------------------------------------------------------------------------

@dataclass
class FaultRecord:
    fault: str
    outcomes: list[Outcome] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        return outcome

    def text(self) -> str:
        lines = [f"== {self.fault}"]
        lines += [o.line() for o in self.outcomes]
        lines += [f"  {k}: {v:.2f} s" for k, v in self.timings.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
