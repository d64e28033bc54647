"""The C decode-attention kernel at another git revision against this tree's, both built with
this CPU's class flags (engine/native/build.py) and timed in one process, alternating.

    .venv/bin/python scripts/decode_kernel_ab.py [--rev HEAD] [--threads 2] [--layers 8] [--rounds 15]

Each case is one decode step's attention over `--layers` layers of SmolLM2-135M's shapes
(9 query heads, 3 KV heads, head_dim 64, 16-token blocks), the blocks of every sequence
scattered over the cache as a long-running engine leaves them; 8 layers of the batch-64
cases hold ~1-3 GB of K/V, far past the caches. Prints the medians, new / old, the K/V read
per second, and the largest difference between the two kernels' outputs.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.attention import cpu_kernel
from engine.native import build
from kernel_build_ab import old_build  # scripts/, beside this one: builds a revision's kernels

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = old_build(args.rev, " ".join(build.compile_flags()), Path(tempfile.mkdtemp()))
    kernels = {"old": old["dec"], "new": cpu_kernel._kernel.get()}
    gen = torch.Generator().manual_seed(0)
    cases = {"1 x 512": [512], "1 x 2000": [2000], "8 x 1024": [1024] * 8, "64 x 300": [300] * 64,
             "64 x 112-1599": torch.randint(112, 1600, (64,), generator=gen).tolist()}
    print(f"old: {args.rev}; new: this tree; {' '.join(build.compile_flags())}; {args.threads} threads, "
          f"{args.layers} layers, medians of {args.rounds}")
    for label, contexts in cases.items():
        nb = sum(-(-c // BLOCK) for c in contexts)
        blocks = torch.randn(nb + 1, args.layers, 2, BLOCK, KV_HEADS, HEAD_DIM)
        perm = torch.randperm(nb, generator=gen) + 1
        tables, starts, used = [], [], 0
        for c in contexts:
            k = -(-c // BLOCK)
            starts.append(used)
            tables.append(perm[used:used + k])
            used += k
        table, start = torch.cat(tables).contiguous(), torch.tensor(starts)
        n = len(contexts)
        q, rows, ctx = torch.randn(n, KV_HEADS * GROUP, HEAD_DIM), torch.arange(n), torch.tensor(contexts)
        outs = {k: torch.empty(n, KV_HEADS * GROUP, HEAD_DIM) for k in kernels}

        def step(name: str) -> float:
            fn, out = kernels[name], outs[name]
            t = time.perf_counter()
            for layer in range(args.layers):
                fn(blocks.data_ptr(), blocks.stride(0), layer * blocks.stride(1), blocks.stride(2), blocks.stride(3),
                   q.data_ptr(), q.stride(0), out.data_ptr(), rows.data_ptr(), ctx.data_ptr(), table.data_ptr(),
                   start.data_ptr(), n, KV_HEADS, GROUP, HEAD_DIM, BLOCK, 0.125)
            return time.perf_counter() - t

        times: dict[str, list[float]] = {"old": [], "new": []}
        step("old"), step("new")  # untimed: first touches of the cache and of the threads
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[name].append(step(name))
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        gb = sum(contexts) * args.layers * KV_HEADS * HEAD_DIM * 2 * 4 / 1e9
        print(f"{label:14s} old {old * 1e3:7.2f} ms  new {new * 1e3:7.2f} ms  new / old {new / old:5.2f}  "
              f"K/V {gb / old:5.1f} / {gb / new:5.1f} GB/s  max diff {(outs['old'] - outs['new']).abs().max():.1e}")


if __name__ == "__main__":
    main()
