"""The C kernels of every ISA class, not only this CPU's (engine/native/build.py).

CI's machines have AVX-512, so without these tests the AVX2 and x86-64 builds, which users'
CPUs run (AMD Zen 3 is AVX2 only), would be compiled and tested nowhere: each class this CPU
can run is built and the kernel tests run against it in a child process
($KVPOOL_KERNEL_ISA). And a class's build must give every CPU of the class the same bits
(nodes of a class share KV blocks): it targets the class, not this CPU, and holds no estimate
instruction, whose results differ between Intel and AMD cores.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.attention import cpu_kernel
from engine.native import build

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (build.CSRC / "layer_ops.c", cpu_kernel.SOURCE, cpu_kernel.PREFILL_SOURCE)
# rcp / rsqrt estimates (rcpps, rsqrtss, vrcp14ps, vrsqrt14ps, vrcp28ps, ...): their bits are the core's
ESTIMATE = re.compile(r"^\s*[0-9a-f]+:\s.*\t(v?rcp\w*|v?rsqrt\w*)\s", re.MULTILINE)


runnable = build.supported_isas  # the classes this CPU can run, best first


@pytest.fixture(autouse=True)
def no_forced_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.ISA_ENV, raising=False)


def test_the_build_targets_the_class_not_this_cpu() -> None:
    assert build.kernel_isa() == runnable()[0]
    flags = build.compile_flags()
    assert not any(f in ("-march=native", "-mtune=native") or f.startswith("-mcpu") for f in flags), flags
    if build.kernel_isa() != build.OTHER_ISA:
        assert "-mtune=generic" in flags and "-mno-recip" in flags


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils) to read the builds")
@pytest.mark.parametrize("isa", runnable())
def test_no_build_holds_an_estimate_instruction(isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.ISA_ENV, isa)
    monkeypatch.setenv("KVPOOL_KERNEL_CACHE", str(tmp_path))
    for source in SOURCES:
        build.build(source)
    libraries = sorted(tmp_path.rglob("*.so"))
    assert len(libraries) == len(SOURCES)
    for lib in libraries:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                              check=True).stdout
        assert "file format elf" in text and "\tret" in text  # a disassembly, not an error
        found = sorted({m.group(1) for m in ESTIMATE.finditer(text)})
        assert not found, f"{lib.name} ({isa}) uses {found}"


def test_a_class_this_cpu_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    known = [name for name, _, _ in build._classes()]
    missing = [name for name in known if name not in runnable()]
    monkeypatch.setenv(build.ISA_ENV, missing[0] if missing else "avx9000")
    with pytest.raises(build.KernelBuildError, match=build.ISA_ENV):
        build.compile_flags()


def test_a_server_given_a_class_this_cpu_lacks_says_so_in_one_line() -> None:
    env = {**os.environ, build.ISA_ENV: "avx9000"}
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "generate", "--prompt", "hi", "--max-tokens", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpool generate: error: KVPOOL_KERNEL_ISA='avx9000'") and "can be built for" in last
    assert "Traceback" not in r.stderr


KERNEL_TESTS = ("tests/engine/test_layer_ops.py", "tests/engine/test_cpu_attention.py",
                "tests/engine/test_prefill_kernel.py")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("isa", runnable()[1:] or [pytest.param("none", marks=pytest.mark.skip(reason="one class"))])
def test_the_kernel_tests_pass_on_a_lower_class(isa: str, tmp_path: Path) -> None:
    """The kernel tests (layer ops, panels, attention; with AVX2, an engine's greedy tokens with
    and without the fused ops too) on this class's build, in a child process. Without AVX2 the
    calibration gives the linears to oneDNN (the panels there are scalar code), so the engine
    test's premise, the panels in use, does not hold."""
    env = {**os.environ, build.ISA_ENV: isa, "KVPOOL_KERNEL_CACHE": str(tmp_path / "kernels"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    select = ["-k", "not test_engine_with_and_without_the_fused_ops"] if isa == "x86_64" else []
    r = subprocess.run([sys.executable, "-m", "pytest", *KERNEL_TESTS, *select, "-q", "-p", "no:cacheprovider", "-x",
                        f"--basetemp={tmp_path / 'pytest'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert re.search(r"\b\d+ passed", r.stdout) and " failed" not in r.stdout, tail
