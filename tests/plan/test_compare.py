"""`kvpool plan compare`: a replay's requests joined with a real run's by request id."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_cli.main import main
from kvpool_plan.compare import compare

TRACE = "/work/shared/data/mooncake_synthetic_trace.jsonl"


def sim(rid: str, ttft: float, prompt: int = 64, computed: int = 64) -> dict:
    return {"rid": rid, "ttft_s": ttft, "prompt_tokens": prompt, "computed_tokens": computed}


def real(rid: str, ttft: float, local: int = 0, remote: int = 0, error: str = "") -> dict:
    return {"rid": rid, "ttft_s": ttft, "local_hit_tokens": local, "remote_hit_tokens": remote, "error": error}


def test_joined_by_id_with_ratios_and_groups() -> None:
    """t0 and t1 match; t2 failed in the real run and t3 was never simulated: left out.
    Ratios 0.5 (a pool hit, 32 tokens on both sides) and 2.0 (none, hits 0 / 0)."""
    c = compare([sim("t0", 0.1, computed=32), sim("t1", 0.4), sim("t2", 1.0)],
                [real("t1", 0.2), real("t0", 0.2, remote=32), real("t2", 0, error="boom"), real("t3", 0.3)])
    assert (c["joined"], c["real_errors"]) == (2, 1)
    assert c["ttft_ratio"]["min"] == 0.5 and c["ttft_ratio"]["max"] == 2.0
    assert c["ttft_ratio_by_group"]["real pool hit"]["p50"] == 0.5
    assert c["ttft_ratio_by_group"]["no real pool hit"]["p50"] == 2.0
    assert c["same_hit_tokens"] == 1.0
    assert {w["rid"] for w in c["worst"]} == {"t0", "t1"}


def test_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A replay's --json and a fake cross-node report: each real TTFT twice the simulated."""
    sim_json = tmp_path / "sim.json"
    assert main(["plan", "--trace", TRACE, "--first-request", "3500", "--max-requests", "50",
                 "--max-prompt-tokens", "256", "--max-output-tokens", "8", "--no-oracles",
                 "--json", str(sim_json)]) == 0
    rows = json.loads(sim_json.read_text())["runs"][0]["request_rows"]
    assert [r["rid"] for r in rows] == [f"t{i}" for i in range(50)]
    real_json = tmp_path / "report.json"
    real_json.write_text(json.dumps({"requests": {"pool-on": [real(r["rid"], 2 * r["ttft_s"]) for r in rows],
                                                  "pool-off": []}}))
    capsys.readouterr()
    assert main(["plan", "compare", "--sim-report", str(sim_json), "--real-report", str(real_json)]) == 0
    out = capsys.readouterr().out
    assert "50 requests joined" in out and "real config pool-on" in out
    assert "p50 0.50" in out and "(-50%)" in out
    assert main(["plan", "compare", "--sim-report", str(sim_json), "--real-report", str(real_json),
                 "--config", "pool-x"]) == 2
    assert "no config 'pool-x'" in capsys.readouterr().err
    assert main(["plan", "compare", "--sim-report", str(sim_json)]) == 2
