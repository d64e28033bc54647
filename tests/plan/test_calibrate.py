"""`kvpool plan calibrate`: a profile measured with the real engine (small settings here), that
`kvpool plan --model-profile` then reads; bad input is one line and exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_cli.main import main
from kvpool_plan.profile import load_profile
from tests.plan.test_cli import BASE

SMALL = ["--prefill-lengths", "32,96", "--decode-batches", "1,4", "--decode-steps", "4", "--repeats", "1"]


def test_a_calibrated_profile_is_the_engines_and_plan_reads_it(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    out = tmp_path / "node.json"
    assert main(["plan", "calibrate", "--out", str(out), "--threads", "2", *SMALL]) == 0
    printed = capsys.readouterr().out
    assert "Measured by `kvpool plan calibrate`" in printed and f"wrote {out}" in printed
    raw = json.loads(out.read_text())
    assert raw["_sources"]["link_bytes_per_s"].startswith("not measured by calibrate")
    profile = load_profile(out)
    # SmolLM2-135M in float32: 30 layers x K and V x 3 KV heads x 64 dims x 4 bytes; 16-token blocks.
    assert profile.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4 and profile.block_size == 16
    assert [n for n, _ in profile.prefill_tok_per_s] == [32, 96]
    assert [b for b, _ in profile.decode_tok_per_s] == [1, 4]
    assert all(r > 0 for _, r in profile.prefill_tok_per_s + profile.decode_tok_per_s)
    assert profile.prefill_overhead_s > 0 and profile.local_copy_bytes_per_s > 0
    assert main(BASE + ["--model-profile", str(out), "--nodes", "2", "--no-oracles"]) == 0
    assert "hit rate" in capsys.readouterr().out


@pytest.mark.parametrize("extra, says", [
    ([], "calibrate needs --out FILE"),
    (["--out", "x.json", "--decode-batches", "0"], "--decode-batches must be integers >= 1"),
    (["--out", "x.json", "--prefill-lengths", "a,b"], "--prefill-lengths must be comma-separated integers"),
    (["--out", "x.json", "--device", "tpu"], "--device must be cpu or cuda"),
    (["--out", "x.json", "--link-bytes-per-s", "-1"], "--link-bytes-per-s must be > 0"),
])
def test_bad_input_is_one_line_and_exit_2(extra: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "calibrate", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and not (tmp_path / "x.json").exists()


def test_simulating_needs_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--nodes", "2"]) == 2
    assert "--trace FILE is required" in capsys.readouterr().err
