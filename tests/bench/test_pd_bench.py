"""`kvpool bench pd`: its arguments (the runs themselves are benchmarks, in docs/BENCHMARKS.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, message", [
    (["--engine", "vllm", "--configs", "colocated-prefix,pd"], "colocated-prefix needs our engine's nodes"),
    (["--configs", "pd,split"], "--configs takes some of"),
    (["--long-prompt", "9,2"], "--long-prompt takes MIN,MAX"),
])
def test_bad_arguments_are_a_one_line_error_before_any_node_starts(tmp_path, args: list[str], message: str) -> None:  # noqa: ANN001
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "pd", *args, "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("kvpool bench pd: error: " + message[:8])
    assert message in r.stderr and not (tmp_path / "run").exists()
