"""`kvpool plan` on the command line: a report, a sweep, JSON, and bad input (one line, exit 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_cli.main import main

TRACE = "/work/shared/data/mooncake_synthetic_trace.jsonl"
BASE = ["plan", "--trace", TRACE, "--first-request", "3500", "--max-requests", "200", "--max-prompt-tokens", "256",
        "--max-output-tokens", "16"]


def test_a_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(BASE + ["--nodes", "4", "--policy", "prefix", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("hit rate", "oracles", "LRU", "Belady", "TTFT p50 / p99", "TPOT p50 / p99", "bytes moved"):
        assert word in text
    run = json.loads(out.read_text())["runs"][0]
    assert run["nodes"] == 4 and run["requests"] == 200 and 0 < run["hit_rate"] <= run["oracle_infinite"]


def test_a_sweep_of_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE + ["--sweep", "nodes=2,8", "--model-profile", "h100-llama3.1-8b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "sweep of nodes" in lines[0] and "Belady" in lines[1]
    assert [ln.split()[0] for ln in lines[2:]] == ["2", "8"]


@pytest.mark.parametrize("extra, says", [
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--nodes", "many"], "--nodes must be an integer"),
    (["--pool", "lots"], "--pool: cannot parse size"),
    (["--kv-cache", "1KiB"], "holds no"),
    (["--policy", "random"], "--policy must be one of"),
    (["--sweep", "gpus=1,2"], "--sweep must be KEY=V1"),
    (["--model-profile", "/nonexistent.json"], "model profile /nonexistent.json"),
    (["--time-scale", "-1"], "--time-scale must be >= 0"),
    (["--block-size", "-16"], "--block-size must be >= 0"),
    (["--concurrency", "x"], "--concurrency must be an integer"),
    (["--disk", "-1"], "--disk: cannot parse size"),
    (["--disk", "lots"], "--disk: cannot parse size"),
    (["--sweep", "disk=1GiB,x"], "--sweep disk: cannot parse size"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], extra: list[str], says: str) -> None:
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("content, says", [
    (None, "No such file"),
    ("not json\n", "Expecting value"),
    ('{"timestamp": 0}\n', "missing 'input_length'"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 5}\n', "--trace"),
    ("", "no requests"),
])
def test_a_bad_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None, says: str) -> None:
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["plan", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_a_bad_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"block_size": 16, "kv_bytes_per_token": 10, "prefill_tok_per_s": [[1, 0]],
                             "decode_tok_per_s": [[1, 10]], "link_bytes_per_s": 1e9}))
    assert main(BASE + ["--model-profile", str(p)]) == 2
    err = capsys.readouterr().err
    assert "prefill_tok_per_s must be" in err and err.count("\n") == 1
    p.write_text(json.dumps({"block_size": 16}))
    assert main(BASE + ["--model-profile", str(p)]) == 2
    assert "missing" in capsys.readouterr().err


def test_coarser_blocks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One block per hash id (16 tokens): the profile's block size is replaced."""
    out = tmp_path / "plan.json"
    assert main(BASE + ["--block-size", "16", "--tokens-per-hash-id", "16", "--json", str(out)]) == 0
    fine = json.loads(out.read_text())["runs"][0]
    assert main(BASE + ["--block-size", "64", "--tokens-per-hash-id", "64", "--max-prompt-tokens", "1024",
                        "--json", str(out)]) == 0
    coarse = json.loads(out.read_text())["runs"][0]
    assert coarse["prompt_tokens"] == 4 * fine["prompt_tokens"]
    assert coarse["kv_cache_blocks_per_node"] * 4 == fine["kv_cache_blocks_per_node"]


def test_a_sweep_of_pool_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE + ["--sweep", "pool=0,64MiB,1GiB", "--no-oracles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split() for ln in lines[2:]]
    assert [r[0] for r in rows] == ["0.00", "0.06", "1.00"]
    hits = [float(r[2].rstrip("%")) for r in rows]
    assert hits[0] < hits[2]  # a pool helps on 2 nodes


SMALL_POOL = ["--nodes", "2", "--kv-cache", "12MiB", "--pool", "24MiB", "--no-oracles"]


def test_a_report_with_a_disk_tier(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(BASE + SMALL_POOL + ["--disk", "1GiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "disk tier" in text and "own disk" in text and "other nodes' disks" in text
    run = json.loads(out.read_text())["runs"][0]
    assert run["disk_slots_per_node"] == (1 << 30) // 741376 and run["disk_writes"] > 0
    assert run["hit_rate_disk"] > 0
    assert main(BASE + SMALL_POOL) == 0
    assert "disk tier" not in capsys.readouterr().out  # no disk: the report as before


def test_a_sweep_of_disk_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE + SMALL_POOL + ["--sweep", "disk=0,1GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "sweep of disk" in lines[0] and lines[1].split()[:6] == ["disk", "hit", "local", "pool", "disk", "inf"]
    rows = [ln.split() for ln in lines[2:]]
    assert [r[0] for r in rows] == ["0.00", "1.00"]
    hits = [float(r[2].rstrip("%")) for r in rows]
    disk = [float(r[5].rstrip("%")) for r in rows]
    assert hits[0] < hits[1] and disk[0] == 0 < disk[1]


def test_a_sweep_prints_goodput_and_draws_its_figures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    assert main(BASE + ["--sweep", "pool=0,1GiB", "--no-oracles", "--ttft-slo", "0.5", "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "goodput" in lines[1] and lines[-1] == f"plot: {png}"
    assert png.stat().st_size > 10_000
    assert main(BASE + ["--ttft-slo", "0"]) == 2
    assert "--ttft-slo must be > 0" in capsys.readouterr().err
