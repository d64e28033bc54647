"""`kvpool bench transfer` at toy size: every method of a cell is measured on the same bytes
(ours, raw TE, TCP, memcpy, Mooncake Store) and the report is complete."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_tiny_transfer_bench_reports_every_method_per_cell(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    r = subprocess.run([sys.executable, "-m", "kvpool", "--log-level", "WARNING", "bench", "transfer", "--sizes",
                        "64KiB,256KiB", "--chains", "1,4", "--max-bytes", "1MiB", "--repeat", "2", "--out",
                        str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(c["block_bytes"], c["chain"]) for c in rows] == [(65536, 1), (65536, 4), (262144, 1), (262144, 4)]
    for c in rows:
        assert c["bytes"] == c["block_bytes"] * c["chain"]
        for name in ("kvpool_get", "raw_te", "tcp", "memcpy", "mooncake_store"):
            assert c[f"{name}_s"] > 0 and c[f"{name}_GBps"] > 0, (name, c)
