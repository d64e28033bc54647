"""`kvpool bench transfer` at toy size: every method of a cell is measured on the same bytes
(ours, the validated floor, raw TE, TCP, memcpy, Mooncake Store), the report is complete,
and --phases splits a one-block get into its phases beside a raw read of the same range."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_tiny_transfer_bench_reports_every_method_per_cell(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "transfer", "--sizes",
                        "64KiB,256KiB", "--chains", "1,4", "--max-bytes", "1MiB", "--repeat", "2", "--phases", "--out",
                        str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(c["block_bytes"], c["chain"]) for c in rows] == [(65536, 1), (65536, 4), (262144, 1), (262144, 4)]
    for c in rows:
        assert c["bytes"] == c["block_bytes"] * c["chain"]
        for name in ("kvpool_get", "floor", "raw_te", "raw_te_ranges", "tcp", "memcpy", "mooncake_store"):
            assert c[f"{name}_s"] > 0 and c[f"{name}_GBps"] > 0, (name, c)
        assert c["ranges"] == 1  # a chain of 4 back-to-back blocks: one batch, one merged range
        if c["chain"] == 1:  # --phases: where a one-block get's time goes, beside a raw read
            p = c["phases_us"]
            assert set(p["kvpool_get"]) == {"pre", "submit", "between", "transfer", "post", "total", "validate"}
            assert set(p["raw_te_async"]) == {"pre", "submit", "between", "transfer", "post", "total"}
            for name in ("kvpool_get", "raw_te_async"):
                assert all(v >= 0 for v in p[name].values()) and p[name]["total"] >= p[name]["transfer"] > 0
            assert 0 < p["kvpool_get"]["validate"] <= p["kvpool_get"]["post"]
        else:
            assert "phases_us" not in c


def test_scattered_destinations_are_read_as_one_range_per_block(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "transfer", "--sizes",
                        "64KiB", "--chains", "4", "--repeat", "2", "--min-seconds", "0", "--scatter", "--no-store",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    (cell,) = json.loads(out.read_text())["rows"]
    assert cell["ranges"] == 4 and cell["kvpool_get_GBps"] > 0  # no two blocks back to back: nothing merged
