"""`kvpool plan capacity`: the hit rate of a shared cache per size (the FAST'25 Figure 9
analysis) on hand-computed traces, the merge of traces, and its command line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_cli.main import main
from kvpool_plan.capacity import at_mark, curve, merge

B = 512  # tokens per hash id, as in Mooncake's traces


def row(t: int, ids: list[int], n: int) -> dict:
    return {"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids}


def test_a_shared_prefix_hits_in_a_big_cache_and_not_in_a_one_block_cache() -> None:
    rows = [row(0, [1, 2, 3], 3 * B), row(1, [1, 2, 4], 2 * B + 100)]
    c = curve(rows, [B, 100 * B], B)
    total = 3 * B + 2 * B + 100
    assert c["infinite"] == pytest.approx(2 * B / total)        # the second request hits ids 1, 2
    assert c["points"][1]["lru"] == c["points"][1]["belady"] == pytest.approx(2 * B / total)
    # one block: the first request leaves only id 3, so id 1 (and all behind it) misses
    assert c["points"][0]["lru"] == 0.0 and c["points"][0]["belady"] == 0.0
    assert c["blocks"] == 6 and c["unique_blocks"] == 4 and c["prompt_tokens"] == total


def test_a_hit_last_block_counts_only_the_tokens_the_prompt_has() -> None:
    rows = [row(0, [7], 100), row(1, [7], 100)]
    assert curve(rows, [B], B)["infinite"] == pytest.approx(0.5)  # 100 of 200 tokens, not 512


def test_belady_keeps_the_block_used_again_where_lru_does_not() -> None:
    # two blocks of room: LRU drops id 1 for id 3; Belady keeps 1 (asked again) and drops 2
    rows = [row(0, [1], B), row(1, [2], B), row(2, [3], B), row(3, [1], B)]
    p = curve(rows, [2 * B], B)["points"][0]
    assert p["lru"] == 0.0 and p["belady"] == pytest.approx(0.25)


def test_merge_orders_by_time_and_keeps_the_traces_ids_apart() -> None:
    a = [row(0, [0, 1], 2 * B), row(20, [0, 1], 2 * B)]
    b = [row(10, [0, 1], 2 * B)]
    m = merge([a, b])
    assert [r["timestamp"] for r in m] == [0, 10, 20]
    assert m[1]["hash_ids"] == [2, 3]  # b's ids moved past a's: its id 0 is not a's
    assert curve(m, [100 * B], B)["infinite"] == pytest.approx(2 / 6)  # only a's second request hits


def test_at_mark_is_a_fraction_of_the_maximum() -> None:
    rows = [row(0, [1, 2], 2 * B), row(1, [1, 2], 2 * B), row(2, [3], B), row(3, [1, 2], 2 * B)]
    c = curve(rows, [B, 2 * B, 10 * B], B)
    assert at_mark(c, 10 * B) == {"lru": 1.0, "belady": 1.0}
    assert 0 < at_mark(c, 2 * B)["lru"] < 1.0
    with pytest.raises(ValueError, match="not among"):
        at_mark(c, 5 * B)


def _trace(tmp_path: Path, rows: list[dict]) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_the_command_prints_the_table_the_mark_and_draws_beside_a_reference(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = _trace(tmp_path, [row(i, [0, 1 + i % 3], 2 * B) for i in range(30)])
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"label": "paper", "curves": {"mine": [[1024, 0.1], [1e6, 0.5]]}}))
    png, out = tmp_path / "c.png", tmp_path / "c.json"
    assert main(["plan", "capacity", "--trace", f"{trace},{trace}", "--names", "mine,again", "--all",
                 "--capacities", "1024,4096,1e6", "--mark", "4096", "--reference", str(ref),
                 "--plot", str(png), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mine: 30 requests" in text and "% of the maximum" in text and "infinite" in text
    curves = json.loads(out.read_text())["curves"]
    assert set(curves) == {"mine", "again", "all"}
    assert curves["mine"]["points"][-1]["lru"] == pytest.approx(curves["mine"]["infinite"])
    assert curves["all"]["requests"] == 60
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("extra, says", [
    (["--capacities", "100"], "--capacities must each be >= --hash-id-tokens"),
    (["--capacities", "lots"], "--capacities must be a number"),
    (["--names", "a,b"], "--names must name each of the 1 traces"),
    (["--reference", "/nonexistent.json"], "--reference /nonexistent.json"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str],
                                          says: str) -> None:
    trace = _trace(tmp_path, [row(0, [0], B)])
    assert main(["plan", "capacity", "--trace", trace, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_no_trace_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "capacity"]) == 2
    assert "--trace FILE[,FILE...] is required" in capsys.readouterr().err
