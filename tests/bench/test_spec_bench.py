"""`kvpool bench spec` at toy size: every configuration runs both workloads at both batch sizes,
the table compares them with speculation off (speed ratio, acceptance, equal outputs), and bad
arguments are one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_tiny_spec_bench_compares_every_config_with_off(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "spec", "--prompts", "2",
                        "--output-tokens", "12", "--batches", "1,2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())["results"]
    for wl in ("copy", "chat"):
        for b in (1, 2):
            for cfg in ("off", "ngram", "draft"):
                assert rep[f"{wl}/b{b}/{cfg}"]["decode_tok_per_s"] > 0
            assert rep[f"{wl}/b{b}/off"]["proposed"] == 0
    assert rep["copy/b1/ngram"]["accepted"] > 0 and rep["copy/b1/draft"]["verify_steps"] > 0
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("copy ", "chat "))]
    assert len(rows) == 12
    assert all(row[-1] == "2/2" for row in rows), r.stdout   # greedy: every config's outputs equal off's
    assert "target (copy)" in r.stdout


def test_bad_spec_bench_arguments_are_one_line_errors() -> None:
    for args, needle in ((["--configs", "off,medusa"], "unknown configs"), (["--ngram", "{"], "not valid JSON")):
        r = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "spec", *args], capture_output=True,
                           text=True, timeout=120, check=False)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
