"""A short end-to-end run of `kvpool bench cross-node`: real etcd, metaserver and two engine
nodes (pool on, then pool off), a handful of multi-turn requests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_short_cross_node_run_writes_a_complete_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "cross-node", "--users", "3",
         "--rounds", "2", "--groups", "1", "--system-tokens", "96", "--context-tokens", "32", "--user-tokens", "16",
         "--output-tokens", "17", "--concurrency", "2", "--run-dir", str(tmp_path / "run"), "--out", str(out),
         "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["configs"]) == {"pool-on", "pool-off"}
    keys = {"requests", "errors", "prompt_tokens", "local_hit_tokens", "remote_hit_tokens", "recomputed_tokens",
            "hit_rate", "oracle_hit_rate", "hit_rate_of_oracle", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
            "tpot_mean_s", "requests_per_s", "output_tokens_per_s", "bytes_transferred"}
    for name, s in report["configs"].items():
        assert keys <= set(s), f"{name} lacks {keys - set(s)}"
        assert s["requests"] == 6 and s["errors"] == 0
        assert s["local_hit_tokens"] + s["remote_hit_tokens"] + s["recomputed_tokens"] == s["prompt_tokens"]
    on, off = report["configs"]["pool-on"], report["configs"]["pool-off"]
    assert on["remote_hit_tokens"] > 0 and on["bytes_transferred"] > 0
    assert off["remote_hit_tokens"] == 0
    assert on["hit_rate"] > off["hit_rate"]
    assert len(report["requests"]["pool-on"]) == 6
    # round 1 continues the conversation with the model's own reply: prompt + 17 generated + 16 user tokens
    for name in ("pool-on", "pool-off"):
        by = {r["rid"]: r for r in report["requests"][name]}
        assert [by[f"u{u}-r1"]["prompt_tokens"] - by[f"u{u}-r0"]["prompt_tokens"] for u in range(3)] == [33] * 3
        assert {by[f"u{u}-r0"]["prompt_tokens"] for u in range(3)} == {96 + 32 + 16}  # system, own context, turn
    assert report["context_tokens"] == 32 and report["concurrency"] == 2
    assert report["outputs_equal"] == 6  # greedy: the pulled KV changes no token
    assert "outputs pool-on == pool-off (greedy, token for token): 6 of 6" in proc.stdout
    for p in report["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hit rate / oracle" in proc.stdout


@pytest.mark.parametrize("bad", ["5,2", "1,8", "many", "8,x"])
def test_bad_unique_prompt_lengths_are_a_one_line_error_before_any_node_starts(tmp_path: Path, bad: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "cross-node", "--workload", "unique",
                        "--unique-tokens", bad, "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("kvpool bench cross-node: error: --unique-tokens")
    assert not (tmp_path / "run").exists()  # nothing started
