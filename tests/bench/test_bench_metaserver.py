"""`kvpool bench metaserver` at toy size: it runs end to end and reports the no-op floor and
the other processes' CPU beside every QueryPrefix figure."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool_bench.metaserver_bench import OtherCpu


def test_bench_reports_query_and_noop_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "metaserver",
                        "--chains", "20", "--loads", "100,200", "--seconds", "0.3", "--concurrency", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [row["offered_qps"] for row in report["query_latency"]] == [100.0, 200.0]
    assert [row["offered_qps"] for row in report["noop_latency"]] == [100.0, 200.0]
    for row in report["query_latency"] + report["noop_latency"]:
        assert row["errors"] == 0 and row["p99_ms"] >= row["p50_ms"] > 0 and row["send_lag_p99_ms"] >= 0
    assert report["query_max_rate"]["max_qps"] > 0 and report["noop_max_rate"]["max_qps"] > 0
    assert "no-op" in r.stdout and "other CPU" in r.stdout


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc")
def test_other_cpu_does_not_count_our_own_work() -> None:
    meter = OtherCpu([])
    meter.start()
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:  # busy in this process: ours, not other
        pass
    other = meter.stop()
    assert other is not None and 0 <= other < 2.5
    assert OtherCpu([]).stop() is None  # never started
