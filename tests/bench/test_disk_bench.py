"""`kvpool bench disk` on a real directory: every rate is measured and positive, the tier's
blocks read back (the bench fails otherwise), a warm restart finds every block it wrote,
and it leaves nothing behind."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_disk_reports_the_tier_beside_fio(tmp_path: Path) -> None:
    fio = shutil.which("fio") is not None
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "disk", "--dir", str(tmp_path / "d"), "--blocks",
                    "32", "--block-bytes", str(64 * 1024), "--restart-blocks", "8", "--rounds", "2", "--out", str(out),
                    *(() if fio else ("--no-fio",))],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    rates = report["mb_per_s"]
    want = {"tier_write_fresh", "tier_write_reuse", "tier_read", "python_write_direct", "python_read_direct"}
    if fio:
        want |= {"fio_write_direct", "fio_read_direct"}
    assert want <= set(rates) and all(rates[k] > 0 for k in want)
    assert len(report["rounds"]) == 2 and all(want <= set(r) for r in report["rounds"])
    if fio:   # each round's tier / fio ratio, their median reported
        assert set(report["tier_over_fio"]) == {"write", "read"} and all(v > 0 for v in report["tier_over_fio"].values())
    assert report["restart"]["blocks"] == 8 and report["restart"]["scan_s"] > 0
    assert list((tmp_path / "d").iterdir()) == []

