"""`kvpool bench spec`: decode speed with and without speculative decoding, in one run.

Two workloads, greedy, at most `--output-tokens` each (answers end at EOS, as served; greedy,
so every configuration emits the same tokens):
    copy   rewrite a given text or code with small changes (four text edits, four code edits:
           the answer copies from the prompt, where n-gram drafts are accepted)
    chat   open questions (little to copy)
Configurations (`--configs`): off, ngram (`--ngram` JSON), draft (a self-draft, `--draft`
JSON). Each workload runs at batch 1 (one request at a time) and batch 8 (eight at once):
decode tokens/s = tokens after the first / the time from the first of them to the last.
Also per configuration: acceptance rate (accepted / proposed drafts) and mean accepted length
(tokens emitted per verify step), and whether the outputs equal the `off` configuration's.
All engines share one loaded model in this process, one after the other.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvpool_bench.report import write_report

CONFIGS = ("off", "ngram", "draft")
DEFAULT_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
DEFAULT_DRAFT = '{"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 10}'

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i + 1 >= window:
            out.append(total / window)
    return out
'''
TEXT = ("The river bends around the old mill where the miller's family kept the ledgers of every harvest for "
        "two hundred years, noting rain, frost, prices and the names of the people who came to trade. Each "
        "spring the water rose to the third stone of the wall, and each autumn the ledgers were carried up to "
        "the loft so that no flood could reach them.")
COPY_ASKS = [
    f"Copy the following paragraph, changing 'river' to 'stream':\n\n{TEXT}",
    f"Rewrite this function, renaming `values` to `data`. Keep everything else the same.\n\n{CODE}",
    f"Repeat this text exactly:\n\n{TEXT}",
    f"Rewrite this function with `window` renamed to `size`.\n\n{CODE}",
    "Correct the spelling in this text and return it: "
    + TEXT.replace("river", "rivr").replace("harvest", "harvst").replace("autumn", "autum"),
    f"Add type hints to this function and return it in full:\n\n{CODE}",
    f"Copy this paragraph and then summarize it:\n\n{TEXT}",
    f"Convert this function to use a for loop over range(len(values)) and return it:\n\n{CODE}",
]
CHAT_ASKS = [
    "What are three good habits for a healthy life?", "Write a short poem about autumn.",
    "Explain why the sky is blue to a child.", "Give me ideas for a weekend trip.",
    "What is the difference between a list and a tuple in Python?", "Tell me a story about a brave mouse.",
    "How do airplanes stay in the air?", "Suggest a name for a coffee shop and explain it.",
]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("spec", help="speculative decoding: decode tokens/s on/off, acceptance, per proposer")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--ngram", default=DEFAULT_NGRAM, help="the ngram configuration (--speculative-config JSON)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft configuration (--speculative-config JSON)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload (of 8)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench-spec.json")


def _prompts(tokenizer, asks: list[str]) -> list[list[int]]:  # noqa: ANN001
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": a}])) for a in asks]


def decode_run(engine, prompts: list[list[int]], batch: int, out_tokens: int) -> dict:  # noqa: ANN001
    """Prompts in waves of `batch`; decode tokens/s over every wave, the outputs, the acceptance."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=out_tokens)
    tokens, seconds, outputs = 0, 0.0, []
    for i in range(0, len(prompts), batch):
        reqs = [engine.add_request(p, params) for p in prompts[i:i + batch]]
        first: dict[str, float] = {}
        final: dict[str, object] = {}
        while engine.has_unfinished():
            for o in engine.step():
                first.setdefault(o.request_id, time.perf_counter())
                if o.finished:
                    final[o.request_id] = o
        done = time.perf_counter()
        seconds += done - min(first.values())
        tokens += sum(len(final[r.request_id].token_ids) - 1 for r in reqs)
        outputs += [list(final[r.request_id].token_ids) for r in reqs]
    s = engine.stats()
    return {"decode_tok_per_s": tokens / seconds, "outputs": outputs,
            "proposed": s.get("spec_proposed_tokens", 0), "accepted": s.get("spec_accepted_tokens", 0),
            "verify_steps": s.get("spec_verify_steps", 0)}


def main(args: argparse.Namespace) -> int:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from engine.spec_decode.config import SpeculativeConfig

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    try:
        if bad:
            raise ValueError(f"unknown configs {bad}; known: {', '.join(CONFIGS)}")
        batches = [int(b) for b in args.batches.split(",")]
        specs = {"off": None, "ngram": SpeculativeConfig.parse(args.ngram), "draft": SpeculativeConfig.parse(args.draft)}
    except ValueError as e:
        print(f"kvpool bench spec: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    workloads = {"copy": _prompts(loaded.tokenizer, COPY_ASKS[:args.prompts]),
                 "chat": _prompts(loaded.tokenizer, CHAT_ASKS[:args.prompts])}
    results: dict = {}
    print(f"{len(workloads['copy'])} prompts per workload, at most {args.output_tokens} output tokens each (greedy, "
          f"to EOS), {args.threads} threads, float32", flush=True)
    for wl, prompts in workloads.items():
        for batch in batches:
            for cfg in configs:
                # a fresh engine per cell: statistics and the prefix cache start empty
                engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", kv_cache_bytes=1 << 30,
                                                speculative_config=specs[cfg]), loaded)
                r = decode_run(engine, prompts, batch, args.output_tokens)
                results[f"{wl}/b{batch}/{cfg}"] = r
                print(f"  {wl:5} batch {batch}: {cfg:6} {r['decode_tok_per_s']:7.1f} decode tok/s", flush=True)
    print_table(results, workloads, batches, configs)
    write_report(args.out, {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "output_tokens": args.output_tokens,
                            "configs": {c: json.loads(getattr(args, c)) if c != "off" else None for c in configs},
                            "results": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                        for k, v in results.items()}})
    return 0


def print_table(results: dict, workloads: dict, batches: list[int], configs: list[str]) -> None:
    print(f"\n{'workload':9} {'batch':>5} {'config':7} {'decode tok/s':>12} {'vs off':>7} {'accept':>7} "
          f"{'mean len':>8} {'= off':>6}")
    for wl in workloads:
        for batch in batches:
            base = results.get(f"{wl}/b{batch}/off")
            for cfg in configs:
                r = results[f"{wl}/b{batch}/{cfg}"]
                ratio = r["decode_tok_per_s"] / base["decode_tok_per_s"] if base else float("nan")
                acc = r["accepted"] / r["proposed"] if r["proposed"] else float("nan")
                mean_len = 1 + r["accepted"] / r["verify_steps"] if r["verify_steps"] else float("nan")
                same = sum(a == b for a, b in zip(r["outputs"], base["outputs"])) if base else 0
                print(f"{wl:9} {batch:>5} {cfg:7} {r['decode_tok_per_s']:>12.1f} {ratio:>6.2f}x {acc:>7.2f} "
                      f"{mean_len:>8.2f} {same:>3}/{len(r['outputs'])}")
    for wl, target in (("copy", "ngram >= 1.8x off at batch 1"), ("chat", "every config >= 0.95x off")):
        print(f"target ({wl}): {target}")
