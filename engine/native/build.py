"""Compile-and-cache for the engine's C sources (csrc/), loaded via ctypes.

Built with the system C compiler (`cc`, or $CC) with OpenMP for the CPU's ISA class
(`kernel_isa`), not for the CPU itself: x86-64-v4 (AVX-512), x86-64-v3 (AVX2 with FMA) or
x86-64, with generic tuning. A KV block's bits must not depend on which CPU of a class computed
it (nodes of one class share blocks: the layout fingerprint names the class, not the CPU), and
`-march=native` made them depend on it: the tuning it implies sets the vector width gcc uses
where it vectorizes a sum, and -ffast-math lets it reorder a sum to fit. So every CPU of a class
gets the same machine code from one compiler, and no estimate instruction (rcp / rsqrt,
whose results differ between Intel and AMD cores): `-mno-recip`, and csrc/layer_ops.c keeps
the one 1/sqrt gcc would estimate anyway. The class names need gcc >= 11 or clang >= 12
(an older compiler fails the build, logged, and the torch paths run). $KVPOOL_KERNEL_ISA picks
a lower class than the CPU's (to test or measure another class's kernels on this machine).
Cached in a directory keyed by the source, the flags and the compiler ($KVPOOL_KERNEL_CACHE,
default ~/.cache/kvpool/kernels); a source may include headers by a quoted relative path
(csrc/simd.h), which are part of the key. The library links libgomp by soname; torch has
loaded its own copy by then, so the kernel's threads are torch's (`torch.set_num_threads`
applies). ctypes releases the GIL for the call.

`build()` raises where no compiler works, for `make setup` and tests that must not pass
without a kernel; `LazyLibrary` logs that once and answers None (the callers' torch paths run).
Used by engine/attention/cpu_kernel.py (attention), engine/layer_ops.py (layer ops) and
kvpool_bench/roofline.py (its own source).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the engine's C sources and the header they share
# -ffast-math only when compiling: linking with it adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (every float op of Python, numpy and torch would change).
FLAGS = ["-O3", "-fopenmp", "-ffast-math", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
ISA_ENV = "KVPOOL_KERNEL_ISA"
# x86 ISA classes, best first: name, target flags, the /proc/cpuinfo flags the target needs
# (the psABI levels; "abm" is how Linux names LZCNT). The name is what the layout fingerprint says.
_V3_NEEDS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
ISA_CLASSES = (
    ("x86_64_v4", ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512", "-mno-recip"),
     _V3_NEEDS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86_64_v3", ("-march=x86-64-v3", "-mtune=generic", "-mno-recip"), _V3_NEEDS),
    ("x86_64", ("-march=x86-64", "-mtune=generic", "-mno-recip"), frozenset()),
)
OTHER_ISA = "base"  # not x86-64: the compiler's default target


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded (the message says why)."""


def cpuinfo_fields() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo, key -> value ({} where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first CPU's entry ends at the first blank line
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> str:
    """/proc/cpuinfo's first "flags" line ("" where there is none), as written: part of the
    build cache's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's name with its family and model numbers, e.g. "Intel(R) Xeon(R) Processor
    (family 6 model 207)": under a hypervisor the name alone can be generic (Cascade Lake and
    Emerald Rapids both read "Intel(R) Xeon(R) Processor"). "unknown" where there is none."""
    fields = cpuinfo_fields()
    model = fields.get("model name") or "unknown"
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']} model {fields['model']})"
    return model


def _classes() -> tuple[tuple[str, tuple[str, ...], frozenset[str]], ...]:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return ISA_CLASSES if x86 else ((OTHER_ISA, (), frozenset()),)


def supported_isas(flags: str | None = None) -> list[str]:
    """The ISA classes a CPU can run, best first (`flags`: a /proc/cpuinfo flags line; this
    CPU's by default)."""
    words = set((flags if flags is not None else cpu_flags()).split())
    return [name for name, _, needs in _classes() if needs <= words]


def kernel_isa(flags: str | None = None) -> str:
    """The ISA class the kernels are built for here: the best of `supported_isas(flags)`, or a
    lower one named by $KVPOOL_KERNEL_ISA. A class the CPU lacks, or an unknown name, raises
    KernelBuildError."""
    supported = supported_isas(flags)
    wanted = os.environ.get(ISA_ENV, "").strip()
    if not wanted:
        return supported[0]
    if wanted not in supported:
        known = ", ".join(name for name, _, _ in _classes())
        raise KernelBuildError(f"{ISA_ENV}={wanted!r}: this CPU's kernels can be built for {', '.join(supported)} "
                               f"(classes: {known})")
    return wanted


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of an ISA class (`kernel_isa`)."""
    return next(list(target) for name, target, _ in _classes() if name == isa)


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def compile_flags() -> list[str]:
    """The flags a source is compiled with here (its ISA class's; KernelBuildError for a bad
    $KVPOOL_KERNEL_ISA)."""
    return [*FLAGS, *isa_flags(kernel_isa())]


@functools.cache
def _version(compiler: str) -> str:
    """`compiler --version` (once per process: every build's cache key reads it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _library_path(compiler: str, source: Path, flags: list[str]) -> Path:
    """Where `source`'s build is cached: keyed by its text and the headers it includes by a
    quoted path (relative to it), the compiler (its path and version) and the flags."""
    text = source.read_bytes()
    headers = b"".join((source.parent / name.decode()).read_bytes() for name in _LOCAL_INCLUDE.findall(text))
    key = hashlib.sha256(text + headers + " ".join([compiler, _version(compiler), *flags, *LINK_FLAGS]).encode())
    root = Path(os.environ.get("KVPOOL_KERNEL_CACHE") or Path.home() / ".cache" / "kvpool" / "kernels")
    return root / key.hexdigest()[:16] / f"{source.stem}.so"


def build(source: Path) -> ctypes.CDLL:
    """Compile `source` (if not cached) and load the library; KernelBuildError if that fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelBuildError("no C compiler (cc or $CC) on PATH")
    flags = compile_flags()
    lib = _library_path(compiler, source, flags)
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent builders never load a half-written file.
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            obj, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
            for cmd in ([compiler, *flags, "-c", str(source), "-o", str(obj)],
                        [compiler, str(obj), *LINK_FLAGS, "-o", str(so)]):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise KernelBuildError(f"{' '.join(cmd)} failed: {r.stderr.strip()[:500]}")
            os.replace(so, lib)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        raise KernelBuildError(f"cannot load {lib}: {e}") from e


class LazyLibrary:
    """`source` built and loaded on the first `get()` (thread-safe), and `bind(lib)`'s result kept
    (the configured function or library); None where the build failed or `bind` raised
    KernelBuildError, logged once as `unavailable` (what runs instead)."""

    def __init__(self, source: Path, bind: Callable[[ctypes.CDLL], Any], unavailable: str) -> None:
        self.source, self.bind, self.unavailable = source, bind, unavailable
        self._value: Any = None
        self._failed: str | None = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        if self._value is not None:  # loaded: no lock on the hot path (every layer of every pass asks)
            return self._value
        with self._lock:
            if self._value is None and self._failed is None:
                try:  # bind may refuse a build too (a kernel this CPU's build leaves out)
                    self._value = self.bind(build(self.source))
                except KernelBuildError as e:
                    self._failed = str(e)
                    log.warning("%s: %s", self.unavailable, e)
                    return None
            return self._value
