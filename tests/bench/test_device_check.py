"""scripts/device_check.sh (the CUDA path's one-call check, kvpool_bench/device_check.py) on a
machine without a GPU: it says what it skipped and why; and its steps run end to end on CPU
(`--device cpu --quick`: the Triton kernel interpreted, the engine, two nodes with pools), so
the script a GPU machine runs is checked here. The figures on a GPU are in docs/BENCHMARKS.md."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = dict(os.environ, NO_BUNDLE="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--out", str(out), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    report = json.loads((out / "device_check.json").read_text())
    return proc, report


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs for real there")
def test_without_a_gpu_every_step_says_it_skipped_and_why(tmp_path: Path) -> None:
    proc, report = run_check(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(report["steps"]) == {"triton", "engine", "pool"}
    for name, step in report["steps"].items():
        assert step["status"] == "skipped" and "no CUDA device" in step["reason"], (name, step)
        assert f"device_check: {name}: skipped" in proc.stdout


def test_an_unknown_step_is_a_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--out", str(tmp_path), "--steps",
                           "warp"], cwd=ROOT, env=dict(os.environ, NO_BUNDLE="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "unknown step" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_every_step_runs_on_cpu_and_passes(tmp_path: Path) -> None:
    proc, report = run_check(tmp_path, "--device", "cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = report["steps"]
    assert {n: s["status"] for n, s in steps.items()} == {"triton": "passed", "engine": "passed", "pool": "passed"}
    assert all(c["ok"] for c in steps["triton"]["cases"])
    assert steps["engine"]["equal"] == steps["engine"]["prompts"] > 0
    rows = steps["pool"]["requests"]
    assert rows and all(r["equal"] and r["remote_cached_tokens"] > 0 for r in rows)
