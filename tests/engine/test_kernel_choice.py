"""engine/kernel_choice.py: the rule (oneDNN only when clearly faster and batch-invariant), the
per-machine cache under a lock, and the engine wired to it (the real model)."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import kernel_choice as kc
from engine import op_choice
from engine.attention import cpu_kernel
from engine.kernel_tags import is_kernel_tag, layout_part
from engine.native import build
from engine.op_choice import DECODE_SHAPES, PREFILL_SHAPES
from tests.engine.conftest import make_engine, run_all

OPS = [kc.Op("qkv", 960, 576), kc.Op("gate_up", 3072, 576, gated=True), kc.Op("lm_head", 4096, 576, head=True)]


def never() -> bool:
    raise AssertionError("probed although oneDNN was not faster by the margin")


def test_onednn_is_taken_only_when_faster_by_the_margin_and_batch_invariant() -> None:
    assert kc.decide(1.0, 1.0 - kc.MARGIN / 2, never) == (kc.C, None)    # a near tie: C stays
    assert kc.decide(1.0, 1.2, never) == (kc.C, None)
    assert kc.decide(1.0, 0.5, lambda: True) == (kc.ONEDNN, True)
    assert kc.decide(1.0, 0.5, lambda: False) == (kc.C, False)         # faster, but rows depend on the batch
    rounds = iter([(1.0, 0.5), (1.0, 1.1)])                           # a burst in the first round only
    assert kc.decide(1.0, 0.5, never, lambda: next(rounds)) == (kc.C, None)
    assert kc.decide(1.0, 0.5, lambda: True, lambda: (1.0, 0.6)) == (kc.ONEDNN, True)


def test_the_choice_is_measured_once_per_machine_and_shape_then_read(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    measured: list[str] = []

    def measure(op: kc.Op) -> kc.Choice:
        measured.append(op.name)
        return kc.Choice(kc.ONEDNN if op.name == "qkv" else kc.C, 1.0, 0.5, True, "calibrated")

    first = kc.choose(OPS, "auto", path, measure)
    assert measured == ["qkv", "gate_up", "lm_head"] and first["qkv"].kernel == kc.ONEDNN
    cached = kc.choose(OPS, "auto", path, lambda op: pytest.fail("measured again"))
    assert {n: c.kernel for n, c in cached.items()} == {n: c.kernel for n, c in first.items()}
    assert {c.source for c in cached.values()} == {"cached"}
    digest = hashlib.sha256(kc.machine_key().encode()).hexdigest()[:8]
    assert kc.tag(cached) == f"|onednn:qkv@{digest}" and kc.tag(kc.choose(OPS, "c", path)) == ""
    assert list(json.loads(path.read_text())) == [kc.machine_key()]
    torch_threads = torch.get_num_threads()
    try:  # engines with another thread count run the same kernels (their KV and answers agree)
        torch.set_num_threads(1 if torch_threads != 1 else 2)
        assert kc.choose(OPS, "auto", path, lambda op: pytest.fail("measured again"))["qkv"].kernel == kc.ONEDNN
    finally:
        torch.set_num_threads(torch_threads)
    kc.choose([kc.Op("down", 576, 1536)], "auto", path, measure)  # a new shape: measured, added
    assert measured[-1] == "down" and len(json.loads(path.read_text())[kc.machine_key()]) == 4


V3 = "fpu sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"


def test_the_cpu_class_tag_names_the_isa_class_the_kernels_are_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    v4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
    assert kc.isa_tag(v4) == "|isa:x86_64_v4"
    assert kc.isa_tag(V3) == "|isa:x86_64_v3"
    assert kc.isa_tag(V3.replace(" movbe", "")) == "|isa:x86_64"  # a v3 flag missing: not v3 code
    assert kc.isa_tag(v4.replace(" avx512vl", "")) == "|isa:x86_64_v3"
    assert kc.isa_tag("fpu sse2 avx") == "|isa:x86_64"
    monkeypatch.setenv(build.ISA_ENV, "x86_64_v3")  # a lower class, to test its kernels here
    assert kc.isa_tag(v4) == "|isa:x86_64_v3"
    monkeypatch.setenv(build.ISA_ENV, "x86_64_v4")
    with pytest.raises(build.KernelBuildError, match="can be built for x86_64_v3, x86_64"):
        kc.isa_tag(V3)
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    with pytest.raises(build.KernelBuildError, match="avx512"):
        kc.isa_tag(v4)
    monkeypatch.delenv(build.ISA_ENV)
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert kc.isa_tag("fp asimd") == "|isa:base" and build.isa_flags("base") == []
    for good in ("", "|isa:x86_64_v3", "|onednn:down", "|isa:x86_64_v3|onednn:down,gate_up,lm_head@0a1b2c3d",
                 "|isa:x86_64_v4|torch:attn_prefill@0a1b2c3d", "|isa:x86_64_v4|onednn:o@0a1b2c3d|torch:layer_ops@0a1b2c3d"):
        assert is_kernel_tag(good), good
    base = "smollm2-135m|float32|bs16|L30|kv3|hd64"
    for tags in ("", "|isa:x86_64_v4", "|onednn:down@0a1b2c3d", "|isa:x86_64|onednn:o,qkv", "|torch:attn_decode@0a1b2c3d"):
        assert layout_part(base + tags) == base
    for bad in ("|onednn:", "|onednn:down|isa:x86_64_v3", "|isa:x86_64_v3 ", "|bf16", "|onednn:Down",
                "|onednn:down@0a1b", "|onednn:down@0A1B2C3D", "|torch:", "|torch:layer_ops|onednn:down",
                "|torch:layer_ops|isa:x86_64_v4"):
        assert not is_kernel_tag(bad), bad


def test_block_rows_follow_the_batch_size() -> None:
    blocks = ((1, 2), (8, 3), (64, 6))
    assert [kc.block_for(blocks, m) for m in (1, 2, 8, 9, 64, 65, 5000)] == [2, 3, 3, 6, 6, 6, 6]
    assert kc.block_for((), 7) == 0   # the build's default


def test_the_calibration_times_each_block_rows_and_the_cache_keeps_them(tmp_path: Path) -> None:
    from engine import layer_ops

    op = kc.Op("o", 64, 96)
    blocks, c_s, onednn_s = kc.time_blocks(op, (1, 8, 64))
    assert [m for m, _ in blocks] == [1, 8, 64] and {r for _, r in blocks} <= set(layer_ops.panel_block_rows())
    assert c_s > 0 and onednn_s > 0
    choice = kc.calibrate(op)
    assert choice.blocks and "C rows per call" in choice.describe()
    path = tmp_path / "kernels.json"
    kc.choose([op], "auto", path, lambda o: choice)
    cached = kc.choose([op], "auto", path, lambda o: pytest.fail("measured again"))["o"]
    assert cached.source == "cached" and cached.blocks == choice.blocks


def test_forced_modes_measure_nothing_and_bad_modes_are_refused(tmp_path: Path) -> None:
    forced = kc.choose(OPS, "onednn", tmp_path / "k.json", lambda op: pytest.fail("measured"))
    assert {c.kernel for c in forced.values()} == {kc.ONEDNN} and not (tmp_path / "k.json").exists()
    with pytest.raises(ValueError, match="kernels must be one of"):
        kc.choose(OPS, "fastest")


def test_forced_c_runs_the_block_rows_calibrated_here_or_times_them(tmp_path: Path) -> None:
    """`--kernels c` fixes the kernel, not its rows per call: it takes an auto choice's block
    rows (even where auto took oneDNN), times them where the cache has none (and caches them
    alone), and an auto choice later measures over such an entry."""
    from engine import layer_ops

    path = tmp_path / "kernels.json"
    rows = layer_ops.panel_block_rows()
    auto = {"qkv": kc.Choice(kc.ONEDNN, 1.0, 0.5, True, "calibrated", ((8, rows[-1]), (512, rows[0])))}
    kc.choose(OPS[:1], "auto", path, lambda op: auto[op.name])
    timed: list[str] = []

    def blocks_only(op: kc.Op) -> kc.Choice:
        timed.append(op.name)
        return kc.Choice(kc.C, source="forced", blocks=((64, rows[-1]),))

    forced = kc.choose(OPS, "c", path, blocks_only)
    assert {c.kernel for c in forced.values()} == {kc.C} and kc.tag(forced) == ""
    assert forced["qkv"].blocks == auto["qkv"].blocks and timed == ["gate_up", "lm_head"]
    assert forced["lm_head"].describe() == f"forced: C rows per call {rows[-1]}"
    assert kc.choose(OPS, "c", path, lambda op: pytest.fail("timed again"))["gate_up"].blocks == ((64, rows[-1]),)
    measured: list[str] = []

    def full(op: kc.Op) -> kc.Choice:
        measured.append(op.name)
        return kc.Choice(kc.C, 1.0, 1.1, None, "calibrated", ((1, rows[0]),))

    again = kc.choose(OPS, "auto", path, full)
    assert measured == ["gate_up", "lm_head"] and again["qkv"].kernel == kc.ONEDNN
    assert again["gate_up"].source == "calibrated"
    # the real timing: one of the build's row counts for each batch size of the mix
    op = kc.Op("o", 64, 96)
    timed_here = kc.calibrate_blocks(op)
    assert [m for m, _ in timed_here.blocks] == list(kc.BATCHES) and {r for _, r in timed_here.blocks} <= set(rows)


def test_engines_calibrating_at_once_end_with_one_choice(tmp_path: Path) -> None:
    """Two processes, each of whose measurement would choose differently: the lock makes the
    second read the first's choice (nodes on one machine must share bit-identical KV)."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from engine import kernel_choice as kc
        here = Path({str(tmp_path)!r})
        (here / ("ready-" + sys.argv[1])).touch()
        while len(list(here.glob("ready-*"))) < 2:  # both imported: they call choose together
            time.sleep(0.01)
        def measure(op):
            time.sleep(2.0)
            return kc.Choice(sys.argv[1], 1.0, 0.5, True, "calibrated")
        got = kc.choose([kc.Op("qkv", 960, 576)], "auto", here / "kernels.json", measure)
        print(got["qkv"].kernel)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, kind], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2]) for kind in (kc.C, kc.ONEDNN)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] and outs[0] in (kc.C, kc.ONEDNN), outs


def test_an_unwritable_cache_still_gives_a_choice(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    got = kc.choose(OPS[:1], "auto", blocked / "kvpool" / "kernels.json",
                    lambda op: kc.Choice(kc.C, 1.0, 2.0, None, "calibrated"))
    assert got["qkv"].kernel == kc.C


def test_the_probe_compares_rows_bit_for_bit() -> None:
    """The real probe on oneDNN at a small shape answers; where it says invariant, a row
    computed alone equals the same row in a batch of 64."""
    op = kc.Op("o", 64, 96)
    if kc.onednn_invariant(op, batches=(1, 2, 63, 64)):
        _, onednn = kc._kernels(op)
        x = torch.randn(64, 96)
        assert torch.equal(onednn(x[7:8].contiguous()), onednn(x)[7:8])


def test_the_engine_runs_and_names_the_kernels_chosen(loaded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from engine.request import SamplingParams

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = make_engine(loaded, kv_cache_bytes=16 << 20, kernels="c")
    o = make_engine(loaded, kv_cache_bytes=16 << 20, kernels="onednn")
    auto = make_engine(loaded, kv_cache_bytes=16 << 20)
    try:
        assert c.fingerprint + "|onednn:down,gate_up,lm_head,o,qkv@" + kc.tag(o.model.kernel_choices)[-8:] == o.fingerprint
        assert c.fingerprint.endswith(kc.isa_tag()) and is_kernel_tag(o.fingerprint.split("|hd64", 1)[1])
        assert "C gated panels" in c.model.kernels()["gate+up projection and SiLU"]
        assert o.model.kernels()["qkv projection"].startswith("oneDNN packed")
        chosen = {n: ch.kernel for n, ch in auto.model.kernel_choices.items()}
        assert sorted(chosen) == ["down", "gate_up", "lm_head", "o", "qkv"]
        assert auto.fingerprint == c.fingerprint + kc.tag(auto.model.kernel_choices) + op_choice.tag(auto.model.op_choices)
        assert sorted(auto.model.op_choices) == sorted(op.name for op in op_choice.available_ops(loaded.config))
        assert (tmp_path / "kvpool" / "kernels.json").exists()
        for ch in [*auto.model.kernel_choices.values(), *auto.model.op_choices.values()]:  # oneDNN or torch
            assert ch.kernel == kc.C or ch.invariant is True                                # only where probed invariant
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        outs = [run_all(e, ["The capital of France is"], params)[0].token_ids for e in (c, o, auto)]
        assert all(len(x) == 8 for x in outs)
    finally:
        for e in (c, o, auto):
            e.close()


def test_bench_kernels_prints_each_op_and_writes_the_machine_choice(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    import os

    proc = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "kernels", "--threads", "1", "--write"],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["qkv"], ["o"], ["gate_up"],
                                                                                      ["down"], ["lm_head"])]
    assert [r[0] for r in rows] == ["qkv", "o", "gate_up", "down", "lm_head"], proc.stdout
    assert all(r[3] in ("True", "False") and ("C" in r or "oneDNN" in r) for r in rows), proc.stdout
    for r in rows:  # the C kernel's rows per call at each batch size of the mix
        batches = [int(t.split(":")[0]) for t in r if re.fullmatch(r"\d+:\d+", t)]
        assert batches == list(kc.HEAD_BATCHES if r[0] == "lm_head" else kc.BATCHES), r
    prefill = [line.split() for line in proc.stdout.splitlines() if line.startswith("prefill ")]
    decode = [line.split() for line in proc.stdout.splitlines() if line.startswith("decode ")]
    assert [(int(r[1]), int(r[3])) for r in prefill] == list(PREFILL_SHAPES), proc.stdout
    assert [(int(r[1]), int(r[3])) for r in decode] == list(DECODE_SHAPES), proc.stdout
    blocks = torch.zeros(1, 1, 2, 16, 3, 64)
    for lines, built in ((prefill, cpu_kernel.supports_prefill(torch.zeros(1, 9, 64), blocks)),
                         (decode, cpu_kernel.supports(blocks, 9, 3))):  # torch's time over the C kernel's
        assert all((float(r[4]) > 0 if built else r[4:] == ["C", "kernel", "not", "built"]) for r in lines), proc.stdout
    # then each attention / elementwise op's choice, where its C kernel is built
    gated = any(r[0] == "gate_up" and "C" in r for r in rows)  # C gated panels: the SiLU is fused
    built = [op.key for op in op_choice.available_ops(loaded.config, silu=not gated)]
    chosen = [line.split() for line in proc.stdout.splitlines() if line.split()[1:2] and line.split()[1] in built]
    assert [r[1] for r in chosen] == built, proc.stdout
    assert all(float(r[2]) > 0 and r[3] in ("True", "False") and r[4] in ("C", "torch") for r in chosen), proc.stdout
    cached = json.loads((tmp_path / "kvpool" / "kernels.json").read_text())
    (entries,) = cached.values()
    assert sorted(entries) == sorted(["960x576", "576x576", "3072x576-gated", "576x1536", "49152x576", *built])
    assert {e["kernel"] for e in entries.values()} <= {kc.C, kc.ONEDNN, kc.TORCH}
