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


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(k) for k in (task / "children").read_text().split()}
    return kids


def _running(pid: int) -> bool:
    """Not exited (a zombie nobody has reaped yet has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_a_bench_sent_sigterm_stops_its_servers(tmp_path: Path) -> None:
    """`kill PID` of a running bench stops the etcd and metaserver it started, not only itself."""
    from tests.conftest import wait_for

    bench = subprocess.Popen([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "metaserver",
                              "--chains", "20", "--loads", "100", "--seconds", "600", "--out",
                              str(tmp_path / "bench.json")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(_children(bench.pid)) >= 2, timeout_s=120)  # etcd and the metaserver
        servers = _children(bench.pid)
        bench.terminate()
        assert bench.wait(120) == 128 + 15
        wait_for(lambda: not any(_running(p) for p in servers), timeout_s=60)
    finally:
        bench.kill()
        bench.wait()
