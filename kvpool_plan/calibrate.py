"""`kvpool plan calibrate`: a model profile (kvpool_plan.profile) measured on this machine
with the real engine, in about a minute.

    kvpool plan calibrate --out my-node.json [--model smollm2-135m] [--device cpu|cuda]
        [--threads N] [--prefill-lengths 128,512,2048] [--decode-batches 1,8,32]

What it measures, each the best of `--repeats` runs (the least disturbed by other work):
- prefill: one prompt of each length, `max_tokens` 1, alone (tokens / s of the pass);
- the fixed cost of a pass: a one-token prompt's prefill;
- decode: `b` requests decoding together, the extra time of `--decode-steps` more tokens
  over the same requests' prefill, as output tokens / s of the batch;
- the KV bytes of a token and the block size, from the engine's cache layout;
- the local copy rate (a memcpy of 64 MiB: a load from the node's own pool).
The pool's link (bytes / s and latency of a pull from another node) is not measured here:
`--link-bytes-per-s` / `--link-latency-s`, by default the loopback figures of
docs/BENCHMARKS.md "Node pool reads" (the profile's `_sources` says which).
"""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

TEXT = ("The river bends around the old mill where the miller's family kept the ledgers of every harvest for two "
        "hundred years, noting rain, frost, prices and the names of the people who came to trade. ")
LINK_SOURCE = ("not measured by calibrate: docs/BENCHMARKS.md 'Node pool reads' (loopback TCP, 2026-11-26): "
               "1.0e9 B/s for 720 KiB blocks, 0.25 ms fixed; or what --link-bytes-per-s / --link-latency-s gave")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(engine, prompts: list[list[int]], max_tokens: int, sync) -> float:  # noqa: ANN001
    """Seconds to run `prompts` to completion (no prefix hits: each run salted anew)."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    salt = f"calibrate-{time.monotonic_ns()}"
    for p in prompts:
        engine.add_request(p, params, cache_salt=salt)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return time.perf_counter() - t0


def _copy_rate() -> float:
    import numpy as np

    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


def calibrate(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32", threads: int = 0,
              prefill_lengths: Sequence[int] = (128, 512, 2048), decode_batches: Sequence[int] = (1, 8, 32),
              decode_steps: int = 16, repeats: int = 2, link_bytes_per_s: float = 1.0e9,
              link_latency_s: float = 0.00025) -> dict:
    """The profile as a JSON-ready dict (kvpool_plan.profile's keys, with `_what` / `_sources`)."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    loaded = load_model(model)
    text = loaded.tokenizer.encode(TEXT * (max(prefill_lengths) // 30 + 8))
    if len(text) < max(prefill_lengths):
        raise ValueError(f"the calibration text has {len(text)} tokens, fewer than {max(prefill_lengths)}")
    need = max(max(prefill_lengths), max(decode_batches) * (64 + decode_steps + 2))
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype,
                                    kv_cache_bytes=max(256 << 20, 4 * need * 64 * 1024)), loaded)
    block_size = engine.config.block_size
    kv_bytes_per_token = engine.layout.block_bytes // block_size
    _timed(engine, [text[:64]], 2, sync)  # warm-up: kernels built, memory touched

    def best(prompts: list[list[int]], max_tokens: int) -> float:
        return min(_timed(engine, prompts, max_tokens, sync) for _ in range(max(1, repeats)))

    prefill = [[n, n / best([text[:n]], 1)] for n in sorted(set(prefill_lengths))]
    overhead = best([text[:1]], 1)
    decode = []
    for b in sorted(set(decode_batches)):
        prompts = [text[k:k + 64] for k in range(b)]
        extra = best(prompts, 1 + decode_steps) - best(prompts, 1)
        decode.append([b, b * decode_steps / max(extra, 1e-6)])
    where = f"{_cpu_model()}, {os.cpu_count()} cores" + (f", {torch.cuda.get_device_name(0)}"
                                                          if device.startswith("cuda") else "")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {
        "_what": f"Measured by `kvpool plan calibrate` on {where}, {when}: our engine serving {model}, {dtype}, "
                 f"device {device}, {threads or torch.get_num_threads()} torch threads.",
        "_sources": {
            "prefill_tok_per_s": f"one prompt at a time, max_tokens 1, best of {repeats}",
            "prefill_overhead_s": "a one-token prompt's prefill pass",
            "decode_tok_per_s": f"the batch's extra time for {decode_steps} more tokens over its prefill",
            "kv_bytes_per_token": "the engine's cache layout (all layers, K and V)",
            "local_copy_bytes_per_s": "numpy copy of 64 MiB, best of 5",
            "link_bytes_per_s": LINK_SOURCE, "link_latency_s": LINK_SOURCE,
        },
        "name": f"calibrated-{model}-{device}",
        "block_size": block_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "prefill_tok_per_s": [[n, round(r, 1)] for n, r in prefill],
        "prefill_overhead_s": round(overhead, 5),
        "decode_tok_per_s": [[b, round(r, 1)] for b, r in decode],
        "link_bytes_per_s": link_bytes_per_s,
        "link_latency_s": link_latency_s,
        "local_copy_bytes_per_s": round(_copy_rate(), -6),
    }


def write_profile(path: str, profile: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profile, indent=2) + "\n")
