"""`kvpool bench vllm-reads`: do the vLLM plug-in's cross-node loads all land on a busy machine?

Real processes: etcd, a metaserver, two vLLM-CPU servers with the plug-in (`pool_size` as the
README gives it, 4GiB), one core each, and `--burners` busy-looping processes competing for
both cores, while `--busy-clients` per node keep both servers computing other requests (the
contention is the point: a loaded serving host, whose vLLM threads spin on the core the
transfer engine's threads share). Each round, A computes a
fresh prompt (its full blocks saved and published), then B answers the same prompt plus a
suffix, loading A's blocks through the pool; with `--stall-every`, A stops answering for
`--stall-s` seconds as B reads (SIGSTOP/SIGCONT: what swapping or a starved host does to the
transfer engine's threads). Per transfer setting (`--configs`, the transfer
engine's progress/transfer timeouts in seconds), one cluster, and one line: blocks offered
(vLLM's external-hit counter / block size), loaded and validated, failed, the failed reads'
reasons counted in B's log, and whether B's answers matched A's (greedy, same tokens).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

BS = 128  # vLLM's block size on CPU
REASONS = {  # B's log lines of a failed read, by what they say
    "progress timeout": re.compile(r"no transfer progress within"),
    "status frame aborted": re.compile(r"failed to read READ status frame"),
    "batch failed": re.compile(r"transfer batch \d+ failed"),
    "read buffer exhausted": re.compile(r"read buffer exhausted"),
    "validation": re.compile(r"did not validate"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("vllm-reads", help="vLLM plug-in cross-node loads under CPU contention: offered/loaded/failed")
    p.add_argument("--configs", default="2/5,10/30",
                   help="comma-separated PROGRESS/TRANSFER timeouts (s) of the transfer engine, one cluster each")
    p.add_argument("--rounds", type=int, default=12, help="prompts A computes and B loads, per config")
    p.add_argument("--blocks", type=int, default=4, help="full vLLM blocks (128 tokens) per prompt")
    p.add_argument("--burners", type=int, default=2, help="busy-looping processes competing for the cores")
    p.add_argument("--busy-clients", type=int, default=1,
                   help="clients per node sending other requests all the while (the nodes compute as they serve reads)")
    p.add_argument("--pool-size", default="4GiB", help="each node's pool (the README's)")
    p.add_argument("--stall-every", type=int, default=0,
                   help="every Kth round, the source stalls (SIGSTOP) as B reads from it: a host that stops "
                        "answering for a while (swapping, starved, a long GC); 0 = never")
    p.add_argument("--stall-s", type=float, default=3.0, help="how long a stall lasts")
    p.add_argument("--lookup-deadline-s", type=float, default=0.0,
                   help="the nodes' lookup_deadline_s and query_timeout_s (0: the connector's defaults); "
                        "a test raises it so that what is offered does not depend on the machine's speed")
    p.add_argument("--run-dir", default="runs/bench-vllm-reads")


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _keep_busy(node, seed: int, stop: threading.Event, gate: threading.Lock) -> None:  # noqa: ANN001  # a VllmProcess
    """Other requests to `node` until `stop` (fresh prompts: computed, never loaded), each one
    under `gate`, which the round holds while it needs the node's publishes to be its own."""
    k = 0
    while not stop.is_set():
        k += 1
        try:
            with gate:
                node.complete(_tokens(seed * 100003 + k, 300), 32)
        except (OSError, RuntimeError):
            return


def _metric_now(node, name: str) -> float:  # noqa: ANN001  # a VllmProcess
    """`node`'s connector counter as of now. vLLM sends the connector's counters to /metrics
    with a step's output, and a publish acknowledged after a request's last step waits for the
    next one: on an idle node it would wait for ever. So first a step: a one-token request on a
    prompt shorter than a block (it saves and publishes nothing)."""
    node.complete(_tokens(random.randrange(1 << 30), BS // 16), 1)
    return node.metric(name)


def _settled(node, name: str, quiet_s: float = 2.0, limit_s: float = 60.0) -> float:  # noqa: ANN001
    """`node`'s connector counter once it has not moved for `quiet_s` (at most `limit_s`)."""
    value, since, end = _metric_now(node, name), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < end:
        time.sleep(0.25)
        now = _metric_now(node, name)
        if now != value:
            value, since = now, time.monotonic()
    return value


def _reasons(log: Path, start: int) -> Counter[str]:
    text = log.read_text(errors="replace")[start:]
    return Counter({k: len(rx.findall(text)) for k, rx in REASONS.items() if rx.search(text)})


def run_config(run: Path, progress_s: int, transfer_s: int, args: argparse.Namespace) -> dict:
    """One cluster with these timeouts: `rounds` cross-node loads under contention."""
    from kvpool_harness.processes import EtcdProcess, MetaserverProcess
    from kvpool_harness.vllm_node import VllmProcess, export_model

    model = export_model()
    # B asks the metaserver (lookup_view false), not its node-local view of the index: the
    # round waits until A's publishes are acknowledged, and a view that a push has not reached
    # yet would offer fewer blocks. What reads do under contention is what this bench measures,
    # not how fast the view follows (metaserver/view.py; tests/metaserver/test_view.py).
    extra = {"progress_timeout_s": progress_s, "transfer_timeout_s": transfer_s, "lookup_view": False}
    if args.lookup_deadline_s > 0:  # and a lookup's RPC may take as long as the lookup may
        extra.update(lookup_deadline_s=args.lookup_deadline_s, query_timeout_s=args.lookup_deadline_s)
    out: dict = {"progress_timeout_s": progress_s, "transfer_timeout_s": transfer_s}
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        a = VllmProcess(run / "A.log", model, "vllm-a", ms.address, cpus="0", pool_size=args.pool_size,
                        extra_config=extra)
        b = VllmProcess(run / "B.log", model, "vllm-b", ms.address, cpus="1", pool_size=args.pool_size,
                        extra_config=extra)
        burners: list[subprocess.Popen[bytes]] = []
        stop, busy = threading.Event(), []
        try:
            a.start()
            b.start()
            a.wait_ready(600)
            b.wait_ready(600)
            burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
            stop = threading.Event()
            gates = [[threading.Lock() for _ in range(args.busy_clients)] for _ in (a, b)]
            busy = [threading.Thread(target=_keep_busy, args=(node, 7919 * k + i, stop, gates[k][i]), daemon=True)
                    for k, node in enumerate((a, b)) for i in range(args.busy_clients)]
            for t in busy:
                t.start()
            log_start = b.log_path.stat().st_size
            names = ("vllm:external_prefix_cache_hits_total", "kvpool:connector_loaded_blocks_total",
                     "kvpool:connector_failed_blocks_total")
            before = {n: b.metric(n) for n in names}
            same, waits = 0, []
            t0 = time.monotonic()
            for r in range(args.rounds):
                t_round = time.monotonic()
                prompt = _tokens(1000 * progress_s + r, args.blocks * BS + 40)
                # A's busy clients publish too: paused (their last publishes landed) until the
                # round's own blocks are in the index, which A's saves reach asynchronously; a
                # count of all A's publishes let B look up before them (1 of 4 blocks offered).
                with contextlib.ExitStack() as paused:
                    for gate in gates[0]:
                        paused.enter_context(gate)
                    published = _settled(a, "kvpool:pool_published_total")
                    ref = a.complete(prompt + [13], 8)["choices"][0]["token_ids"]
                    deadline = time.monotonic() + 60
                    while _metric_now(a, "kvpool:pool_published_total") < published + args.blocks and \
                            time.monotonic() < deadline:
                        time.sleep(0.2)
                t_ready = time.monotonic()  # A's busy clients paused, its answer given and published
                stall = args.stall_every and r % args.stall_every == args.stall_every - 1
                if stall:  # A stops answering as B's request arrives, for stall_s
                    os.killpg(a.pid, signal.SIGSTOP)
                    threading.Timer(args.stall_s, os.killpg, (a.pid, signal.SIGCONT)).start()
                got = b.complete(prompt + [13], 8)["choices"][0]["token_ids"]
                same += got == ref
                # where a round's time goes: getting A ready, then B's answer
                waits.append([round(t_ready - t_round, 1), round(time.monotonic() - t_ready, 1)])
            out["seconds"] = round(time.monotonic() - t0, 1)
            deadline = time.monotonic() + 30  # the connector's counters reach /metrics after the step
            while time.monotonic() < deadline:
                after = {n: b.metric(n) for n in names}
                if after[names[1]] + after[names[2]] - before[names[1]] - before[names[2]] >= \
                        (after[names[0]] - before[names[0]]) // BS:
                    break
                time.sleep(0.5)
            out.update(offered=int(after[names[0]] - before[names[0]]) // BS,
                       loaded=int(after[names[1]] - before[names[1]]), failed=int(after[names[2]] - before[names[2]]),
                       same_answers=same, rounds=args.rounds, reasons=dict(_reasons(b.log_path, log_start)),
                       round_s=waits)
        finally:
            stop.set()
            for t in busy:
                t.join(120)
            for p in burners:
                p.kill()
                p.wait()
            a.stop()
            b.stop()
    return out


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",")]
        if any(len(c) != 2 for c in configs):
            raise ValueError
    except ValueError:
        print(f"kvpool bench vllm-reads: --configs must be PROGRESS/TRANSFER[,..] in seconds, got {args.configs!r}",
              file=sys.stderr)
        return 2
    results = []
    for progress_s, transfer_s in configs:
        sub = run_dir / f"p{progress_s}-t{transfer_s}"
        sub.mkdir(parents=True, exist_ok=True)
        results.append(run_config(sub, progress_s, transfer_s, args))
    stalls = f", the source stalled {args.stall_s:g} s every {args.stall_every} rounds" if args.stall_every else ""
    print(f"vLLM plug-in loads, {args.rounds} rounds x {args.blocks} blocks, pool {args.pool_size}, "
          f"{args.burners} busy processes on the machine's cores, {args.busy_clients} other client(s) per node"
          f"{stalls}")
    print(f"{'progress/transfer (s)':>22} {'offered':>8} {'loaded':>7} {'failed':>7} {'same answers':>13} "
          f"{'seconds':>8}  failed reads' log lines")
    for r in results:
        print(f"{r['progress_timeout_s']:>10}/{r['transfer_timeout_s']:<11} {r['offered']:>8} {r['loaded']:>7} "
              f"{r['failed']:>7} {r['same_answers']:>6}/{r['rounds']:<6} {r['seconds']:>8}  {r['reasons'] or '-'}")
        print(f"{'':>22} each round, s (A ready + B's answer): "
              + " ".join(f"{ready:g}+{answer:g}" for ready, answer in r["round_s"]))
    (run_dir / "result.json").write_text(json.dumps(results, indent=1))
    return 0
