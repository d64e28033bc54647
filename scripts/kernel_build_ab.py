"""The engine's C kernels built two ways, timed in one process, alternating: this tree's build
(engine/native/build.py, the CPU's ISA class) against the same sources at another git revision
built with other flags (by default -march=native, as before the per-class build).

    .venv/bin/python scripts/kernel_build_ab.py [--rev HEAD] [--flags "-O3 -march=native ..."] [--rounds 6]

Both builds serve one in-process engine (kernels "c", 2 threads): a 2,048-token prefill, then 8
prompts of 256 tokens decoding 64 tokens each; the medians of the rounds and new / old.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine import layer_ops
from engine.attention import cpu_kernel
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.native import build
from engine.request import SamplingParams

OLD_FLAGS = "-O3 -march=native -fopenmp -ffast-math -fPIC"
SOURCES = ("layer_ops.c", "paged_decode.c", "paged_prefill.c")


def old_build(rev: str, flags: str, where: Path) -> dict[str, object]:
    for name in (*SOURCES, "simd.h"):
        text = subprocess.run(["git", "show", f"{rev}:engine/native/csrc/{name}"], capture_output=True, check=True).stdout
        (where / name).write_bytes(text)
    libs = []
    for name in SOURCES:
        src, so = where / name, where / name.replace(".c", ".so")
        subprocess.run(["cc", *flags.split(), "-c", str(src), "-o", str(src.with_suffix(".o"))], check=True)
        subprocess.run(["cc", str(src.with_suffix(".o")), *build.LINK_FLAGS, "-o", str(so)], check=True)
        libs.append(ctypes.CDLL(str(so)))
    return {"layer": layer_ops._bind(libs[0]), "dec": cpu_kernel._bind(libs[1]), "pre": cpu_kernel._bind_prefill(libs[2])}


def use(d: dict[str, object]) -> None:
    layer_ops._library._value, cpu_kernel._kernel._value, cpu_kernel._prefill_kernel._value = d["layer"], d["dec"], d["pre"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--flags", default=OLD_FLAGS)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(2)
    new = {"layer": layer_ops._library.get(), "dec": cpu_kernel._kernel.get(), "pre": cpu_kernel._prefill_kernel.get()}
    tmp = tempfile.TemporaryDirectory()
    old = old_build(args.rev, args.flags, Path(tmp.name))
    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kernels="c", kv_cache_bytes=1 << 30,
                                    enable_prefix_caching=False, max_num_batched_tokens=2048))
    gen = torch.Generator().manual_seed(0)

    def run(prompts: list[list[int]], n: int) -> float:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t

    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in ("old", "new")}
    for r in range(args.rounds):
        order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
        for name, libs in order:
            use(libs)
            times[name]["prefill"].append(run([torch.randint(100, 40000, (2048,), generator=gen).tolist()], 1))
            decode = [torch.randint(100, 40000, (256,), generator=gen).tolist() for _ in range(8)]
            times[name]["decode"].append(run(decode, 64))
    print(f"old: {args.rev} built with {args.flags}; new: this tree, {' '.join(build.compile_flags())}")
    for k, what in (("prefill", "one 2,048-token prefill"), ("decode", "8 x 256-token prompts + 64 tokens each")):
        o, n = statistics.median(times["old"][k]), statistics.median(times["new"][k])
        print(f"{what:40s} old {o:7.3f} s  new {n:7.3f} s  new / old {n / o:.3f}  (rounds: old "
              f"{', '.join(f'{x:.2f}' for x in times['old'][k])}; new {', '.join(f'{x:.2f}' for x in times['new'][k])})")
    engine.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
