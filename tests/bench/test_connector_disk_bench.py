"""`kvpool bench connector --disk --restart-blocks N` end to end, small: real etcd, metaserver
and two engine nodes with the real model, each with a small DRAM pool and KV cache over a disk
tier. A recompute, a hit on B's own disk and a hit on A's disk (staged by A) per prompt; then
B's disk is filled to N blocks, B restarted with SIGTERM and the same command, and a prompt from
before the fill is hit from B's disk. Figures are printed, never asserted on (no timings in tests)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_disk_hits_and_a_warm_restart_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "connector", "--disk",
         "--lengths", "256", "--reps", "1", "--disk-pool-size", "24MiB", "--disk-kv-cache", "48MiB",
         "--restart-blocks", "160", "--disk-size", "256MiB", "--run-dir", str(tmp_path / "run"), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["prompt_tokens"] == 256 and row["own_disk_hit_ms"] > 0 and row["peer_disk_hit_ms"] > 0
    assert "own disk hit" in run.stdout and "target <= 0.50x" in run.stdout
    for node in report["nodes"].values():     # every disk read validated, nothing failed or dropped
        assert node["pool_disk_failed_reads"] == 0 and node["failed_load_blocks"] == 0
        assert node["pool_disk_dropped_writes"] == 0
    assert report["nodes"]["A"]["pool_disk_staged"] >= 15 and report["nodes"]["B"]["pool_disk_hits"] >= 15
    restart = report["restart"]
    assert restart["disk_blocks_before"] >= 160 and restart["republished"] >= restart["disk_blocks_before"]
    assert restart["probe_disk_hit_tokens"] == 240                     # (256 - 1) // 16 * 16
    assert 0 < restart["open_s"] <= restart["republished_s"] <= restart["serving_s"]
    assert "restart of node B" in run.stdout


def test_a_bad_disk_size_is_a_one_line_error(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "connector", "--disk", "--disk-size", "lots",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "kvpool bench connector: error: --disk-size: cannot parse size 'lots'; use e.g. 4GiB, 512MiB or a number "
        "of bytes"]
    assert not (tmp_path / "run").exists()
