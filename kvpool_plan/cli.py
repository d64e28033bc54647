"""`kvpool plan`: replay a Mooncake-format trace over N simulated nodes (`kvpool_plan.sim`).

    kvpool plan --trace FILE --nodes 16 --kv-cache 96MiB --pool 1GiB [--disk 8GiB] --policy prefix \\
        --model-profile cpu-smollm2-135m [--sweep nodes=2,4,8,16,32,64] [--json OUT]

Prints the hit rate per tier beside the infinite / LRU / Belady oracles over the same
capacity (all KV caches, pools and disk tiers together), TTFT and TPOT p50 / p99, and the
bytes the pools moved between nodes; `--sweep KEY=V1,V2,...` (nodes, pool, disk, kv-cache,
policy) prints one row per value. Bad input: one line on stderr, exit code 2.

    kvpool plan calibrate --out my-node.json [--device cpu|cuda] [--threads N] ...

measures a model profile on this machine with the real engine (`kvpool_plan.calibrate`) for
`--model-profile`.

    kvpool plan capacity --trace A.jsonl[,B.jsonl] [--capacities 1e4,...] [--mark 3e6] [--all] [--plot OUT.png]

prints the prefix hit rate a shared cache of each size reaches on the traces, LRU and Belady
beside the infinite cache (the Mooncake FAST'25 paper's Figure 9; `kvpool_plan.capacity`).

    kvpool plan compare --sim-report sim.json --real-report report.json [--config pool-on]

sets a replay's requests (`--json` writes them) beside a `kvpool bench cross-node` run's,
request by request: TTFT p50 / p99 predicted and measured, and their ratio's distribution
(`kvpool_plan.compare`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvpool.layout import parse_size
from kvpool_bench.report import TPOT_SLO_S, TTFT_SLO_S
from kvpool_bench.workloads import load_trace
from kvpool_plan import capacity, compare
from kvpool_plan.compare import sim_rows
from kvpool_plan.profile import load_profile
from kvpool_plan.sim import SimConfig, build_requests, simulate, summarize
from router.policy import POLICIES

SWEEP_KEYS = ("nodes", "pool", "disk", "kv-cache", "policy")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="simulate the pool at cluster scale on a trace (issue 43)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=["calibrate", "compare", "capacity"],
                   help="calibrate: measure a model profile with the real engine (below); compare: a "
                        "replay's requests beside a real run's (below); none: simulate")
    p.add_argument("--trace", help="Mooncake-format JSONL trace (to simulate)")
    p.add_argument("--nodes", default="2", help="simulated nodes (default 2)")
    p.add_argument("--kv-cache", default="96MiB", help="each node's engine KV cache, bytes (e.g. 96MiB)")
    p.add_argument("--pool", default="1GiB", help="each node's pool DRAM, bytes (0: pool off)")
    p.add_argument("--disk", default="0",
                   help="each node's disk tier under its pool, bytes (0: none, the default; none when the "
                        "pool is off); its reads cost the profile's disk_read_* figures")
    p.add_argument("--policy", default="round-robin", help=f"routing: {', '.join(POLICIES)}")
    p.add_argument("--model-profile", default="cpu-smollm2-135m",
                   help="profile JSON file, or a shipped one: cpu-smollm2-135m, h100-llama3.1-8b, "
                        "h200-smollm2-135m (measured by `kvpool plan calibrate`)")
    p.add_argument("--block-size", default="0",
                   help="tokens per simulated block (default: the profile's, the engine's); coarser blocks "
                        "replay faster (e.g. 512 = one block per hash id of a full-size trace), hits counted at "
                        "that granularity")
    p.add_argument("--tokens-per-hash-id", default="16", help="tokens each trace hash id becomes (default 16)")
    p.add_argument("--max-prompt-tokens", default="0", help="cut prompts here (0: no cut)")
    p.add_argument("--max-output-tokens", default="0", help="cap output lengths (0: the trace's)")
    p.add_argument("--first-request", default="0", help="first trace row replayed")
    p.add_argument("--max-requests", default="0", help="rows replayed (0: to the end)")
    p.add_argument("--time-scale", default="1.0", help="multiply arrival times by this (0.5: twice the rate)")
    p.add_argument("--concurrency", default="0",
                   help="a closed loop of this many requests in flight instead of the trace's arrival times "
                        "(as `kvpool bench cross-node` without --time-scale); 0 = arrival times")
    p.add_argument("--sweep", default="",
                   help="KEY=V1,V2,...: one run per value (nodes, pool, disk, kv-cache, policy)")
    p.add_argument("--ttft-slo", default=str(TTFT_SLO_S), help="goodput: TTFT objective (s)")
    p.add_argument("--tpot-slo", default=str(TPOT_SLO_S), help="goodput: TPOT objective (s)")
    p.add_argument("--sync-loads", action="store_true",
                   help="load inside the prefill's engine step (the first version's model) instead of "
                        "asynchronously from arrival, as the real connectors do")
    p.add_argument("--no-oracles", action="store_true", help="skip the LRU / Belady oracles (faster)")
    p.add_argument("--json", default="", help="write the report (every run) to this file")
    m = p.add_argument_group("compare (kvpool_plan.compare)")
    m.add_argument("--sim-report", default="", help="a `kvpool plan --json` report (its per-request rows)")
    m.add_argument("--real-report", default="", help="a `kvpool bench cross-node` report.json")
    m.add_argument("--config", default="", help="the real report's config (default: pool-on, or its only one)")
    m.add_argument("--run", default="0", help="which run of the sim report (a sweep holds several)")
    k = p.add_argument_group("capacity (kvpool_plan.capacity): --trace takes FILE[,FILE...]")
    k.add_argument("--capacities", default=",".join(f"{c:g}" for c in capacity.DEFAULT_CAPACITIES),
                   help="cache sizes in tokens, comma-separated (1e6 or 1000000)")
    k.add_argument("--mark", default="3e6", help="say what fraction of the maximum a cache this size reaches")
    k.add_argument("--all", action="store_true", help="also the traces merged by time (the paper's 'All')")
    k.add_argument("--hash-id-tokens", default="512", help="tokens a trace hash id names (512 in Mooncake's)")
    k.add_argument("--names", default="", help="the traces' names, comma-separated (default: their file names)")
    k.add_argument("--plot", default="", help="draw the curves (or a --sweep's figures) into this PNG")
    k.add_argument("--reference", default="",
                   help='published points to draw beside ours: JSON {"label": ..., "curves": {NAME: [[tokens, rate], ...]}}')
    c = p.add_argument_group("calibrate (kvpool_plan.calibrate)")
    c.add_argument("--out", default="", help="the profile JSON to write")
    c.add_argument("--model", default="smollm2-135m", help="the model the engine serves")
    c.add_argument("--device", default="cpu", help="cpu or cuda")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--threads", default="0", help="torch threads (0: torch's default)")
    c.add_argument("--prefill-lengths", default="128,512,2048", help="prompt lengths of the prefill rates")
    c.add_argument("--decode-batches", default="1,8,32", help="batch sizes of the decode rates")
    c.add_argument("--decode-steps", default="16", help="tokens decoded per decode measurement")
    c.add_argument("--repeats", default="2", help="each figure is the best of this many runs")
    c.add_argument("--link-bytes-per-s", default="1e9", help="the pool link's rate (not measured here)")
    c.add_argument("--link-latency-s", default="0.00025", help="the pool link's fixed cost of a pull")


class BadInput(ValueError):
    pass


def _int(name: str, text: str, low: int = 0) -> int:
    try:
        v = int(text)
    except ValueError:
        raise BadInput(f"{name} must be an integer, got {text!r}") from None
    if v < low:
        raise BadInput(f"{name} must be >= {low}, got {v}")
    return v


def _size(name: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise BadInput(f"{name}: {err}") from None


def _policy(text: str) -> str:
    if text not in POLICIES:
        raise BadInput(f"--policy must be one of {', '.join(POLICIES)}, got {text!r}")
    return text


def _configs(args: argparse.Namespace) -> list[dict]:
    base = {"nodes": _int("--nodes", args.nodes, 1), "kv_cache_bytes": _size("--kv-cache", args.kv_cache),
            "pool_bytes": _size("--pool", args.pool), "disk_bytes": _size("--disk", args.disk),
            "policy": _policy(args.policy)}
    if not args.sweep:
        return [base]
    key, sep, values = args.sweep.partition("=")
    if not sep or key not in SWEEP_KEYS or not values:
        raise BadInput(f"--sweep must be KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}, got {args.sweep!r}")
    out = []
    for v in values.split(","):
        if key == "nodes":
            out.append({**base, "nodes": _int("--sweep nodes", v, 1)})
        elif key == "pool":
            out.append({**base, "pool_bytes": _size("--sweep pool", v)})
        elif key == "disk":
            out.append({**base, "disk_bytes": _size("--sweep disk", v)})
        elif key == "kv-cache":
            out.append({**base, "kv_cache_bytes": _size("--sweep kv-cache", v)})
        else:
            out.append({**base, "policy": _policy(v)})
    return out


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"


def _disk_lines(s: dict) -> list[str]:
    """The disk tier's hits and traffic (nothing without a disk tier: the report as before)."""
    if not s.get("disk_slots_per_node"):
        return []
    return [f"disk tier           {_pct(s['hit_rate_disk'])} of prompt tokens (own disk "
            f"{_pct(s['hit_rate_own_disk'])}, other nodes' disks {_pct(s['hit_rate_remote_disk'])}); "
            f"{s['disk_slots_per_node']:,} slots per node, writes / evictions {s['disk_writes']:,} / "
            f"{s['disk_evictions']:,}"]


def report(s: dict) -> str:
    disk = " DRAM" if s.get("disk_slots_per_node") else ""
    lines = [
        f"{s['requests']} requests on {s['nodes']} nodes, {s['policy']}, profile {s['profile']}: "
        f"KV cache {s['kv_cache_blocks_per_node']} blocks and pool {s['pool_slots_per_node']} slots per node"
        + (f", disk {s['disk_slots_per_node']} slots" if disk else ""),
        f"hit rate            {_pct(s['hit_rate'])}  (local {_pct(s['hit_rate_local'])}, "
        f"pool {_pct(s['hit_rate_pool'])}: own{disk} {_pct(s['hit_own_pool_tokens'] / s['prompt_tokens'])}, "
        f"pulled{disk} {_pct(s['hit_remote_tokens'] / s['prompt_tokens'])})",
        *_disk_lines(s),
    ]
    if "oracle_lru" in s:
        lines.append(f"oracles             infinite {_pct(s['oracle_infinite'])}, "
                     f"over {s['capacity_blocks']:,} blocks: "
                     f"LRU {_pct(s['oracle_lru'])}, Belady {_pct(s['oracle_belady'])}")
    lines += [
        f"TTFT p50 / p99      {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} s  "
        f"(queueing p50 / p99 {s['queue_p50_s']:.3f} / {s['queue_p99_s']:.3f} s)",
        f"TPOT p50 / p99      {1000 * s['tpot_p50_s']:.1f} / {1000 * s['tpot_p99_s']:.1f} ms",
        f"goodput             {s['goodput_rps']:.3f} req/s ({s['slo_met']:,} of {s['requests']:,} within TTFT "
        f"{s['ttft_slo_s']:g} s and TPOT {1000 * s['tpot_slo_s']:g} ms)",
        (f"loads               {s['loads']} asynchronous, done p50 / p99 {s['load_done_p50_s']:.3f} / "
         f"{s['load_done_p99_s']:.3f} s after arrival; failed reads {s['failed_read_tokens']:,} tokens"
         if s.get("async_loads") else "loads               inside the prefill's step (--sync-loads)"),
        f"bytes moved         {_gib(s['bytes_moved'])} over {s['links_used']} links (busiest link "
        f"{_gib(s['link_bytes_max'])}; most into one node {_gib(s['node_in_bytes_max'])}, "
        f"out of one {_gib(s['node_out_bytes_max'])})",
        f"pool puts / evictions {s['pool_puts']:,} / {s['pool_evictions']:,}; simulated {s['simulated_s']:.1f} s",
    ]
    return "\n".join(lines)


def _swept(s: dict, key: str) -> str:
    """A run's value of the swept `key`, as the table and the plot label it."""
    return {"nodes": str(s["nodes"]), "pool": _gib(s["_pool_bytes"]), "disk": _gib(s["_disk_bytes"]),
            "kv-cache": _gib(s["_kv_cache_bytes"]), "policy": s["policy"]}[key]


def table(rows: list[dict], key: str) -> str:
    head = (f"{key:>12} {'hit':>6} {'local':>6} {'pool':>6} {'disk':>6} {'inf':>6} {'LRU':>6} {'Belady':>6} "
            f"{'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'goodput':>8} {'moved':>10} {'wall':>6}")
    out = [head]
    for s in rows:
        val = _swept(s, key)
        o = [_pct(s[k]) if k in s else "     -" for k in ("oracle_infinite", "oracle_lru", "oracle_belady")]
        out.append(f"{val!s:>12} {_pct(s['hit_rate'])} {_pct(s['hit_rate_local'])} {_pct(s['hit_rate_pool'])} "
                   f"{_pct(s['hit_rate_disk'])} "
                   f"{o[0]} {o[1]} {o[2]} {s['ttft_p50_s']:8.3f}s {s['ttft_p99_s']:6.2f}s "
                   f"{1000 * s['tpot_p50_s']:7.1f}ms {s['goodput_rps']:8.3f} {_gib(s['bytes_moved']):>10} "
                   f"{s['_wall_s']:5.1f}s")
    return "\n".join(out)


def plot_sweep(rows: list[dict], key: str, out: str) -> str:
    """A sweep's figures against the swept value: hit rate (with the oracles) and goodput on
    the left, TTFT p50 and p99 on the right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [_swept(s, key) for s in rows]
    x = list(range(len(rows)))
    fig, (ax, at) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax.plot(x, [s["hit_rate"] for s in rows], marker="o", label="hit rate")
    for k, name in (("oracle_lru", "LRU oracle"), ("oracle_belady", "Belady")):
        if all(k in s for s in rows):
            ax.plot(x, [s[k] for s in rows], ls=":", marker=".", label=name)
    ax.set_ylim(0, 1)
    ax.set_ylabel("hit rate (of prompt tokens)")
    g = ax.twinx()
    g.plot(x, [s["goodput_rps"] for s in rows], color="tab:green", marker="s", ms=3, label="goodput")
    g.set_ylabel("goodput (req/s)")
    ax.legend(fontsize=7, loc="upper left")
    g.legend(fontsize=7, loc="lower right")
    at.plot(x, [s["ttft_p50_s"] for s in rows], marker="o", label="TTFT p50")
    at.plot(x, [s["ttft_p99_s"] for s in rows], marker="o", label="TTFT p99")
    at.set_yscale("log")
    at.set_ylabel("seconds")
    at.legend(fontsize=7)
    for a in (ax, at):
        a.set_xticks(x, labels)
        a.set_xlabel(key)
        a.grid(alpha=0.3)
    fig.suptitle(f"{rows[0]['requests']} requests, profile {rows[0]['profile']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ints(name: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise BadInput(f"{name} must be integers >= 1, got {text!r}")
    return values


def _float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"{name} must be a number, got {text!r}") from None
    if not value > 0:
        raise BadInput(f"{name} must be > 0, got {text}")
    return value


def run_calibrate(args: argparse.Namespace) -> int:
    from kvpool_plan.calibrate import calibrate, write_profile
    from kvpool_plan.profile import load_profile

    if not args.out:
        raise BadInput("calibrate needs --out FILE (the profile to write)")
    if args.device not in ("cpu", "cuda"):
        raise BadInput(f"--device must be cpu or cuda, got {args.device!r}")
    kw = dict(model=args.model, device=args.device, dtype=args.dtype, threads=_int("--threads", args.threads),
              prefill_lengths=_ints("--prefill-lengths", args.prefill_lengths),
              decode_batches=_ints("--decode-batches", args.decode_batches),
              decode_steps=_int("--decode-steps", args.decode_steps, 1), repeats=_int("--repeats", args.repeats, 1),
              link_bytes_per_s=_float("--link-bytes-per-s", args.link_bytes_per_s),
              link_latency_s=_float("--link-latency-s", args.link_latency_s))
    profile = calibrate(**kw)  # type: ignore[arg-type]
    write_profile(args.out, profile)
    load_profile(args.out)  # what `--model-profile` will read: valid
    print(profile["_what"])
    for key in ("block_size", "kv_bytes_per_token", "prefill_tok_per_s", "prefill_overhead_s", "decode_tok_per_s",
                "local_copy_bytes_per_s", "link_bytes_per_s", "link_latency_s"):
        print(f"  {key:24s} {profile[key]}")
    print(f"wrote {args.out}: kvpool plan --model-profile {args.out} --trace ...")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    if not args.sim_report or not args.real_report:
        raise BadInput("compare needs --sim-report FILE (kvpool plan --json) and --real-report FILE "
                       "(kvpool bench cross-node's report.json)")
    try:
        sim, real, config = compare.load_reports(args.sim_report, args.real_report, args.config,
                                                 _int("--run", args.run))
    except ValueError as err:
        raise BadInput(str(err)) from None
    print(compare.report(compare.compare(sim, real), config))
    return 0


def _trace(path: str, limit: int = 0, first: int = 0) -> list[dict]:
    """`load_trace`, its failures as one-line BadInput."""
    try:
        return load_trace(path, limit, first)
    except OSError as err:
        raise BadInput(f"--trace {path}: {err.strerror or err}") from None
    except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
        raise BadInput(f"--trace {path}: {err}") from None


def run_capacity(args: argparse.Namespace) -> int:
    if not args.trace:
        raise BadInput("capacity: --trace FILE[,FILE...] is required")
    caps = [_float("--capacities", v) for v in args.capacities.split(",")]
    mark = _float("--mark", args.mark)
    block = _int("--hash-id-tokens", args.hash_id_tokens, 1)
    if not caps or min(caps) < block or mark < 0:
        raise BadInput(f"--capacities must each be >= --hash-id-tokens ({block}), --mark >= 0")
    if mark and mark not in caps:
        caps = sorted({*caps, mark})
    paths = args.trace.split(",")
    names = args.names.split(",") if args.names else [p.rsplit("/", 1)[-1].removesuffix(".jsonl") for p in paths]
    if len(names) != len(paths) or len(set(names)) != len(names):
        raise BadInput(f"--names must name each of the {len(paths)} traces once, got {args.names!r}")
    reference = None
    if args.reference:
        try:
            with open(args.reference) as f:
                reference = json.load(f)
            if not isinstance(reference.get("curves"), dict):
                raise ValueError('no "curves" object')
        except (OSError, ValueError, AttributeError) as err:
            raise BadInput(f"--reference {args.reference}: {err}") from None
    traces = {}
    for name, path in zip(names, paths, strict=True):
        traces[name] = _trace(path)
    if args.all and len(traces) > 1:
        traces["all"] = capacity.merge(list(traces.values()))
    try:
        curves = {n: capacity.curve(rows, caps, block, belady=not args.no_oracles) for n, rows in traces.items()}
    except ValueError as err:
        raise BadInput(str(err)) from None
    for n, c in curves.items():
        line = f"{n}: {c['requests']} requests, {c['blocks']} hash ids ({c['unique_blocks']} distinct)"
        if mark:
            f = capacity.at_mark(c, mark, block)
            line += f"; at {mark:,.0f} tokens: " + ", ".join(f"{k} {100 * v:.0f}% of the maximum" for k, v in f.items())
        print(line)
    print(capacity.table(curves))
    if args.plot:
        print(f"plot: {capacity.plot(curves, args.plot, mark, reference)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"traces": args.trace.split(","), "hash_id_tokens": block, "mark": mark, "curves": curves}, f, indent=1)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "calibrate":
        return run_calibrate(args)
    if args.action == "compare":
        return run_compare(args)
    if args.action == "capacity":
        return run_capacity(args)
    if not args.trace:
        raise BadInput("--trace FILE is required (or `kvpool plan calibrate --out FILE`)")
    configs = _configs(args)
    tpi = _int("--tokens-per-hash-id", args.tokens_per_hash_id, 1)
    max_prompt = _int("--max-prompt-tokens", args.max_prompt_tokens)
    max_output = _int("--max-output-tokens", args.max_output_tokens)
    first = _int("--first-request", args.first_request)
    limit = _int("--max-requests", args.max_requests)
    concurrency = _int("--concurrency", args.concurrency)
    try:
        scale = float(args.time_scale)
    except ValueError:
        raise BadInput(f"--time-scale must be a number, got {args.time_scale!r}") from None
    if not scale >= 0:
        raise BadInput(f"--time-scale must be >= 0, got {args.time_scale}")
    block_size = _int("--block-size", args.block_size)
    ttft_slo, tpot_slo = _float("--ttft-slo", args.ttft_slo), _float("--tpot-slo", args.tpot_slo)
    try:
        profile = load_profile(args.model_profile)
        if block_size:
            profile = dataclasses.replace(profile, block_size=block_size)
    except ValueError as err:
        raise BadInput(str(err)) from None
    rows = _trace(args.trace, limit, first)
    if not rows:
        raise BadInput(f"--trace {args.trace}: no requests in the window")
    results = []
    for c in configs:
        t0 = time.perf_counter()
        try:
            reqs = build_requests(rows, profile.block_size, tpi, max_prompt, max_output, scale)
        except (ValueError, TypeError, KeyError) as err:
            raise BadInput(f"--trace {args.trace}: {err}") from None
        try:
            cfg = SimConfig(c["nodes"], c["kv_cache_bytes"], c["pool_bytes"], c["policy"], profile,
                            async_loads=not args.sync_loads, disk_bytes=c["disk_bytes"])
        except (ValueError, TypeError, KeyError) as err:
            raise BadInput(str(err)) from None
        res = simulate(reqs, cfg, concurrency)
        s = summarize(res, not args.no_oracles, ttft_slo, tpot_slo)
        if args.json:  # per request, for `kvpool plan compare`
            s["request_rows"] = sim_rows(res.requests)
        s.update({"_wall_s": time.perf_counter() - t0, "_pool_bytes": c["pool_bytes"],
                  "_disk_bytes": c["disk_bytes"], "_kv_cache_bytes": c["kv_cache_bytes"]})
        results.append(s)
        if not args.sweep:
            print(report(s))
            print(f"(replayed in {s['_wall_s']:.2f} s)")
    if args.sweep:
        print(f"{len(rows)} requests, profile {profile.name}; sweep of {args.sweep.partition('=')[0]}")
        print(table(results, args.sweep.partition("=")[0]))
        if args.plot:
            print(f"plot: {plot_sweep(results, args.sweep.partition('=')[0], args.plot)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "runs": results}, f, indent=1)
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except BadInput as err:
        print(f"kvpool plan: {err}", file=sys.stderr)
        return 2
