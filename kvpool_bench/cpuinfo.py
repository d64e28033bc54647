"""The CPU a benchmark ran on, as `kvpool bench engine` prints it beside its figures: the
model, the vector units the kernels care about, the caches (Linux sysfs), the cores."""
from __future__ import annotations

import os
from pathlib import Path

from engine.native.build import cpu_model, cpuinfo_fields, kernel_isa

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_info() -> dict[str, object]:
    flags = set(cpuinfo_fields().get("flags", "").split())
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[name] = size
    return {"model": cpu_model(), "cores": os.cpu_count(), "vector": [f for f in VECTOR_FLAGS if f in flags],
            "caches": caches, "kernels_isa": kernel_isa()}


def describe(info: dict[str, object]) -> str:
    caches = ", ".join(f"{k} {v}" for k, v in info["caches"].items())  # type: ignore[union-attr]
    return (f"CPU: {info['model']}, {info['cores']} cores; {' '.join(info['vector']) or 'no AVX2'}"  # type: ignore[arg-type]
            + (f"; caches per core {caches}" if caches else "") + f"; C kernels built for {info['kernels_isa']}")


def kernels_here(model: str, dtype: str = "float32") -> dict[str, str]:
    """What our engine's kernels are for `model` on this machine (an engine with a small cache,
    built in this process: the servers a benchmark starts make the same choices)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=16 << 20))
    try:
        return engine.model.kernels()
    finally:
        engine.close()


def print_machine(kernels: dict[str, str]) -> dict[str, object]:
    """Print the CPU and the kernel each operation runs; returns both for the report."""
    info = cpu_info()
    print(describe(info))
    for op, impl in kernels.items():
        print(f"  {op:28s} {impl}")
    return {"cpu": info, "kernels": kernels}
