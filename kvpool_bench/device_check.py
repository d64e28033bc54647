"""`python -m kvpool_bench.device_check`: the CUDA path proven on a GPU, in one run
(scripts/device_check.sh sets up a bare GPU machine and calls it).

Steps, each independent (one failing does not stop the others), each reported as passed,
failed (with the error) or skipped (with the reason: no CUDA device, no model, ...):
1. `triton`: the Triton paged-attention kernel against a float64 reference written here
   (gather each sequence's K/V from its block table, causal softmax), at the model's shapes
   and larger ones: decode, prefill with history, fresh prefill, GQA and MHA, ragged lengths,
   float32 and bfloat16; and its time per call at a decode batch.
2. `engine`: the engine on CUDA with the real model: greedy outputs on the correctness prompts
   (kvpool_bench.prompts) token for token equal to the CPU engine's, computed in the same run;
   prefill and decode throughput on CUDA (float32 and bfloat16).
3. `pool`: etcd, a metaserver and two `kvpool serve --device cuda` nodes over TCP loopback
   (kvpool_harness.cluster): prompts computed on node-0 (its saves staged device-to-host),
   then asked of node-1, whose remote hits land in GPU memory (host-to-device); every answer
   equal to node-0's (computed with no pool hit) and the remote tokens counted.
The report (`--out`, JSON) holds every figure and the device's name; the summary is printed.
`--device cpu --quick` runs the same code on CPU (Triton under its interpreter, small cases):
a check of this script, its figures meaningless (tests/bench/test_device_check.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

GREEDY_TOKENS = 32
BLOCK_TOKENS = 16  # kvpool serve's default --block-size


class Skip(Exception):
    """A step that cannot run here (the reason is reported)."""


DEVICE = "cuda"   # --device: cpu checks this script without a GPU
QUICK = False     # --quick: the smallest cases of each step


def _cuda() -> object:
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise Skip("no CUDA device (torch.cuda.is_available() is False)")
    return torch


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---- 1. the Triton kernel -----------------------------------------------------------------

def reference_attention(q, cache, layer: int, seqs, scale: float):  # noqa: ANN001, ANN201
    """float64 attention of each sequence's query rows over its cached K/V (block table order)."""
    import torch

    kv = cache.blocks[:, layer]  # [blocks, 2, block_size, kv_heads, head_dim]
    heads, kvh = q.shape[1], kv.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for s in seqs:
        k = kv[s.block_table, 0].reshape(-1, kvh, kv.shape[-1])[:s.context_len].double()
        v = kv[s.block_table, 1].reshape(-1, kvh, kv.shape[-1])[:s.context_len].double()
        k = k.repeat_interleave(heads // kvh, dim=1)
        v = v.repeat_interleave(heads // kvh, dim=1)
        qs = q[s.query_start:s.query_start + s.num_query].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(s.context_len - s.num_query, s.context_len, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(s.context_len, device=q.device)[None, :] > q_pos, float("-inf"))
        out[s.query_start:s.query_start + s.num_query] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _attention_case(torch, heads: int, kv_heads: int, head_dim: int, dtype, specs: list[tuple[int, int]],  # noqa: ANN001
                    block_size: int = 16) -> dict:
    from engine.attention.metadata import AttentionMetadata, SeqSpan
    from engine.attention.triton_backend import paged_attention
    from engine.kv_cache import CacheLayout, PagedKVCache

    dev = torch.device(DEVICE)
    blocks = sum(-(-ctx // block_size) for _, ctx in specs) + 4
    cache = PagedKVCache(CacheLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                                     dtype=dtype), blocks, device=dev)
    cache.blocks.normal_()
    perm = torch.randperm(blocks, device=dev)
    seqs, start, used = [], 0, 0
    for nq, ctx in specs:
        nb = -(-ctx // block_size)
        seqs.append(SeqSpan(start, nq, ctx, perm[used:used + nb].clone()))
        start, used = start + nq, used + nb
    meta = AttentionMetadata(seqs, torch.zeros(start, dtype=torch.long, device=dev),
                             torch.zeros(start, dtype=torch.long, device=dev))
    q = torch.randn(start, heads, head_dim, device=dev, dtype=dtype)
    scale = head_dim ** -0.5
    out = paged_attention(q, cache, 0, meta, scale)
    ref = reference_attention(q, cache, 0, seqs, scale)
    err = (out.double() - ref).abs().max().item()
    _sync()
    t0 = time.perf_counter()
    reps = 1 if QUICK else 20
    for _ in range(reps):
        paged_attention(q, cache, 0, meta, scale)
    _sync()
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
            "query_tokens": start, "context_tokens": sum(c for _, c in specs), "max_abs_err": err,
            "us_per_call": (time.perf_counter() - t0) / reps * 1e6}


def step_triton(_args: argparse.Namespace) -> dict:
    torch = _cuda()
    torch.manual_seed(0)
    mixed = [(1, 37), (5, 20), (9, 9), (1, 16), (64, 300), (1, 1000), (200, 713)]  # ragged, history, fresh
    decode = [(1, 100 + 37 * i) for i in range(64)]                                  # a decode batch
    shapes = ((9, 3, 64), (32, 8, 128), (16, 16, 128))                               # the model, GQA 4, MHA
    dtypes = ((torch.float32, 2e-4), (torch.bfloat16, 3e-2))
    batches = (("mixed", mixed), ("decode64", decode))
    if QUICK:  # the interpreter on CPU: small, float32 (it computes wrongly in bfloat16)
        shapes, dtypes, batches = shapes[:1], dtypes[:1], (("mixed", mixed[:4]),)
    cases = []
    for heads, kvh, hd in shapes:
        for dtype, tol in dtypes:
            for name, specs in batches:
                c = _attention_case(torch, heads, kvh, hd, dtype, specs)
                c.update(case=name, tolerance=tol, ok=c["max_abs_err"] <= tol)
                cases.append(c)
    bad = [c for c in cases if not c["ok"]]
    if bad:
        raise AssertionError(f"{len(bad)} of {len(cases)} cases off the reference: {bad}")
    return {"cases": cases}


# ---- 2. the engine on CUDA ----------------------------------------------------------------

def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    return [done[r.request_id] for r in reqs]


def _throughput(engine, prompts: list[list[int]], max_tokens: int) -> float:  # noqa: ANN001
    """Tokens per second: prompt tokens for max_tokens=1 (prefill), else output tokens."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params, cache_salt=f"t{time.monotonic_ns()}")  # no prefix hits between runs
    _sync()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync()
    dt = time.perf_counter() - t0
    return (sum(map(len, prompts)) if max_tokens == 1 else max_tokens * len(prompts)) / dt


def step_engine(args: argparse.Namespace) -> dict:
    torch = _cuda()
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from kvpool_bench.prompts import varied_prompts

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides: equal greedy tokens expected
    torch.backends.cudnn.allow_tf32 = False
    loaded = load_model(args.model)
    prompts = varied_prompts(loaded.tokenizer)[:3 if QUICK else None]
    cpu = LLMEngine(EngineConfig(device="cpu", kv_cache_bytes=1 << 30), loaded)
    t0 = time.perf_counter()
    want = _greedy(cpu, prompts)
    cpu_s = time.perf_counter() - t0
    del cpu
    gpu = LLMEngine(EngineConfig(device=DEVICE, kv_cache_bytes=(1 if QUICK else 4) << 30), loaded)
    assert gpu.device.type == DEVICE
    got = _greedy(gpu, prompts)
    diverged = [{"prompt": i, "prompt_tokens": len(p), "first_diff": next(k for k, (a, b) in enumerate(zip(g, w)) if a != b)
                 if any(a != b for a, b in zip(g, w)) else min(len(g), len(w))}
                for i, (p, g, w) in enumerate(zip(prompts, got, want)) if g != w]
    result: dict = {"prompts": len(prompts), "equal": len(prompts) - len(diverged), "diverged": diverged,
                    "cpu_reference_s": cpu_s, "throughput": {}}
    text = loaded.tokenizer.encode(" ".join(f"Entry {i}: the river bends around the old mill." for i in range(400)))
    runs = {"prefill_512x32_tok_s": (512, 32, 1), "prefill_2048x8_tok_s": (2048, 8, 1),
            "decode_b1_tok_s": (128, 1, 64), "decode_b8_tok_s": (128, 8, 64), "decode_b64_tok_s": (128, 64, 64)}
    if QUICK:
        runs = {"prefill_64x2_tok_s": (64, 2, 1), "decode_b2_tok_s": (16, 2, 4)}
    for dtype in ("float32",) if QUICK else ("float32", "bfloat16"):
        eng = gpu if dtype == "float32" else LLMEngine(EngineConfig(device=DEVICE, dtype=dtype, kv_cache_bytes=4 << 30),
                                                       load_model(args.model))
        _throughput(eng, [text[:64]] * 2, 1)  # warm-up (kernels compiled, memory allocated)
        result["throughput"][dtype] = {name: _throughput(eng, [text[k:k + n] for k in range(count)], out)
                                       for name, (n, count, out) in runs.items()}
    if diverged:
        raise AssertionError(f"{len(diverged)} of {len(prompts)} greedy outputs differ from the CPU engine's: "
                             f"{diverged}; {json.dumps(result['throughput'])}")
    return result


# ---- 3. two nodes with pools on CUDA --------------------------------------------------------

def step_pool(args: argparse.Namespace) -> dict:
    _cuda()
    import shutil

    from engine.loader import load_model
    from kvpool_harness.cluster import ClusterSpec, LocalCluster
    from kvpool_bench.prompts import PARAGRAPH

    if shutil.which("etcd") is None:
        raise Skip("etcd is not on PATH")
    tok = load_model(args.model).tokenizer
    prompts = [tok.encode(f"Document {d}. " + "".join(f"Fact {i}: {PARAGRAPH}" for i in range(4 + 3 * d)))
               for d in range(2 if QUICK else 4)]
    run_dir = Path(tempfile.mkdtemp(prefix="kvpool-device-pool-"))
    spec = ClusterSpec(nodes=2, pool_size="512MiB", engine_args=("--device", DEVICE, "--kv-cache-bytes", "2GiB"))
    rows = []
    with LocalCluster(run_dir, spec) as cluster:
        a, b = cluster.nodes
        published = 0
        for i, p in enumerate(prompts):
            ref = a.complete(p, max_tokens=GREEDY_TOKENS, ignore_eos=True)
            published += len(p) // BLOCK_TOKENS
            deadline = time.monotonic() + 60  # its saves staged, put and published (asynchronous)
            while a.stats().get("pool_published", 0) < published and time.monotonic() < deadline:
                time.sleep(0.1)
            t0 = time.perf_counter()
            got = b.complete(p, max_tokens=GREEDY_TOKENS, ignore_eos=True)
            ttft_s = time.perf_counter() - t0
            d = got["usage"]["prompt_tokens_details"]
            rows.append({"prompt": i, "prompt_tokens": len(p), "remote_cached_tokens": d["remote_cached_tokens"],
                         "local_cached_tokens": d["local_cached_tokens"],
                         "equal": got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"],
                         "remote_request_s": ttft_s})
        stats = {n.node_id: n.stats() for n in cluster.nodes}
    # Each node's own word for which copy path its connector took (connector.pool_worker).
    paths = {log.stem: [line.split("kvpool: ", 1)[-1].strip() for line in log.read_text(errors="replace").splitlines()
                        if "the KV cache is on" in line] for log in sorted(run_dir.glob("node-*.log"))}
    shutil.rmtree(run_dir, ignore_errors=True)
    result = {"requests": rows, "node_stats": stats, "copy_paths": paths}
    if not all(r["equal"] for r in rows) or not any(r["remote_cached_tokens"] for r in rows):
        raise AssertionError(f"remote hits on CUDA: {rows}")
    if DEVICE == "cuda" and not all(paths.values()):
        raise AssertionError(f"a node did not take the CUDA copy path: {paths}")
    return result


STEPS: dict[str, Callable[[argparse.Namespace], dict]] = {"triton": step_triton, "engine": step_engine,
                                                          "pool": step_pool}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool_bench.device_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/device_check.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {','.join(STEPS)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run the steps on CPU to check this script (Triton interpreted; figures meaningless)")
    p.add_argument("--quick", action="store_true", help="the smallest cases of each step")
    args = p.parse_args(argv)
    global DEVICE, QUICK
    DEVICE, QUICK = args.device, args.quick
    if DEVICE == "cpu":  # before any @triton.jit runs
        os.environ["TRITON_INTERPRET"] = "1"
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"device_check: unknown step(s) {unknown}; choose from {list(STEPS)}", file=sys.stderr)
        return 2
    report: dict = {"python": platform.python_version(), "device_arg": DEVICE, "quick": QUICK, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "steps": {}}
    try:
        import torch

        report["torch"] = torch.__version__
        if torch.cuda.is_available():
            report["device"] = torch.cuda.get_device_name(0)
        import triton

        report["triton"] = triton.__version__
    except Exception as err:  # noqa: BLE001 - reported, every step then says why it skipped
        report["setup_error"] = repr(err)
    failed = 0
    for name in steps:
        t0 = time.perf_counter()
        try:
            res = {"status": "passed", **STEPS[name](args)}
        except Skip as why:
            res = {"status": "skipped", "reason": str(why)}
        except Exception as err:  # noqa: BLE001 - one step's failure is reported; the next runs
            failed += 1
            res = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:4000],
                   "traceback": traceback.format_exc()[-4000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["steps"][name] = res
        print(f"device_check: {name}: {res['status']} in {res['seconds']} s"
              + (f" ({res.get('reason') or res.get('error')})" if res["status"] != "passed" else ""), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str)[:6000])
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
