"""`kvpool bench lookup` at toy size: every method of the capacity part is measured and every
answer is right, the view's memory and staleness are reported, and the engine part runs the
three metaserver conditions with a row each (the real model, the real connector)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_tiny_lookup_bench_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "lookup.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "lookup",
                        "--nodes", "2", "--chains", "8", "--seconds", "0.3", "--batch", "4", "--memory-blocks", "20000", "--readers", "2", "--requests", "3",
                        "--modes", "view", "--rounds", "1", "--decodes", "2", "--decode-tokens", "6", "--arrival-s", "0.1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    cap = report["capacity"]
    assert [row["method"].split(" ")[0] for row in cap] == ["Mooncake", "QueryPrefix", "QueryPrefixBatch", "index"]
    for row in cap:
        assert row["lookups_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] and row["wrong"] == 0, row
    assert all(row["vs_mooncake"] > 0 for row in cap[1:])
    assert 0 < report["staleness"]["publish_to_view_p50_ms"] <= report["staleness"]["publish_to_view_p99_ms"]
    fr = report["failed_reads"]
    assert len(fr["failed_reads_per_reader"]) == 2 and max(fr["failed_reads_per_reader"]) <= 1
    assert sum(fr["failed_reads_per_reader"]) >= 1  # someone read from the dead source first
    mem = report["memory"]
    assert mem["blocks"] == 20000 and mem["bytes_per_block"] > 32 and mem["feed_bytes_per_block"] > 32
    eng = report["engine"]
    assert [(row["metaserver"], row["round"]) for row in eng["runs"]] == [("healthy", 0), ("frozen", 0), ("killed", 0)]
    for row in eng["runs"]:
        assert row["new_requests"] >= 1 and row["tpot_ms"] > 0 and row["req_us_p50"] > 0, row
    assert eng["runs"][0]["lookup_view_answers"] >= 1  # healthy: answered by the view
    assert [row["metaserver"] for row in eng["summary"]] == ["healthy", "frozen", "killed"]
    assert eng["summary"][0]["tpot_vs_healthy"] == 1.0
