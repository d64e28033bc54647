"""Workload generators and the oracle of `kvpool bench cross-node`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_bench.cross_node import Result, dram_overflow, hit_windows, print_table, route
from kvpool_bench.report import pct
from kvpool_bench.workloads import (BenchRequest, Conversations, distinct_blocks, fill_index, hash_id_oracle, load_trace,
                                    mooncake_trace, multi_turn, oracle_hits, prefix_oracle)

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def test_oracle_on_a_hand_made_sequence() -> None:
    a = tuple(range(100, 148))            # 3 blocks of 16
    reqs = [BenchRequest("1", a, 1),
            BenchRequest("2", a + (7,) * 16, 1),   # a's 3 blocks hit; its own 4th block is new
            BenchRequest("3", a[:32] + (9,) * 17, 1),  # first 2 blocks hit, then it diverges
            BenchRequest("4", a, 1),          # all 3 blocks seen, but the last token is computed: 2 blocks
            BenchRequest("5", (5,) + a[1:], 1)]  # differs in token 0: nothing hits
    assert oracle_hits(reqs, 16) == [0, 48, 32, 32, 0]


def test_hash_id_oracle_of_a_hand_made_trace() -> None:
    rows = [{"hash_ids": [0, 1, 2]}, {"hash_ids": [0, 1, 3]}, {"hash_ids": [4]}, {"hash_ids": [0, 1, 2, 5]}]
    assert hash_id_oracle(rows) == pytest.approx((0 + 2 + 0 + 3) / 11)


@pytest.mark.skipif(not TRACE.exists(), reason="shared/data is not beside this checkout")
def test_synthetic_trace_oracle_is_64_percent() -> None:
    rows = load_trace(TRACE)
    assert len(rows) == 3993
    assert round(hash_id_oracle(rows), 3) == 0.640


def test_trace_scaling_keeps_the_sharing_structure(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 50, "hash_ids": [0, 1, 2]},
            {"timestamp": 2000, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 9]},
            {"timestamp": 3000, "input_length": 3000, "output_length": 9, "hash_ids": [4, 5, 6, 7, 8, 9]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = mooncake_trace(load_trace(path), tokens_per_hash_id=32, max_prompt_tokens=100, max_output_tokens=8,
                          time_scale=0.5)
    assert [len(r.prompt) for r in reqs] == [96, 96, 100]  # cut at the context limit
    assert reqs[0].prompt[:64] == reqs[1].prompt[:64] and reqs[0].prompt[64:] != reqs[1].prompt[64:]
    assert [r.max_tokens for r in reqs] == [8, 3, 8]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 1.5]
    # with chunks that are a multiple of the block size, the token-level oracle equals the id-level one
    full = mooncake_trace(load_trace(path), 32, 10_000, 8)
    hits = oracle_hits(full, 16)
    assert hits == [0, 64, 0]


def test_a_trace_window_starts_at_its_first_request(tmp_path: Path) -> None:
    rows = [{"timestamp": 1000 * i, "input_length": 10, "output_length": 1, "hash_ids": [i]} for i in range(6)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    window = load_trace(path, limit=3, start=2)
    assert [r["hash_ids"] for r in window] == [[2], [3], [4]]
    assert [r["timestamp"] for r in window] == [0, 1000, 2000]  # arrivals relative to the window
    assert [r["hash_ids"] for r in load_trace(path, start=4)] == [[4], [5]]
    with pytest.raises(ValueError, match=">= 0"):
        load_trace(path, start=-1)


def test_trace_rows_need_every_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5}))
    with pytest.raises(ValueError, match="missing 'output_length'"):
        load_trace(path)


def test_multi_turn_prompts_are_the_conversation_so_far() -> None:
    reqs = multi_turn(users=3, rounds=3, groups=2, system_tokens=32, user_tokens=8, reply_tokens=4, output_tokens=2)
    assert len(reqs) == 9 and [r.rid for r in reqs[:3]] == ["u0-r0", "u1-r0", "u2-r0"]
    by = {r.rid: r for r in reqs}
    for u in range(3):
        r0, r1, r2 = by[f"u{u}-r0"], by[f"u{u}-r1"], by[f"u{u}-r2"]
        assert len(r0.prompt) == 40 and len(r1.prompt) == 52 and len(r2.prompt) == 64
        assert r1.prompt[:40] == r0.prompt and r2.prompt[:52] == r1.prompt
    assert by["u0-r0"].prompt[:32] == by["u2-r0"].prompt[:32] != by["u1-r0"].prompt[:32]  # groups share a system prompt
    with pytest.raises(ValueError):
        multi_turn(2, 1, 3, 8, 8, 8, 1)


def test_multi_turn_with_the_models_replies_continues_each_conversation() -> None:
    reqs = multi_turn(users=2, rounds=3, groups=1, system_tokens=32, user_tokens=8, reply_tokens=0, output_tokens=5)
    by = {r.rid: r for r in reqs}
    assert [r.continues for r in reqs] == [False, False, True, True, True, True]
    assert len(by["u0-r0"].prompt) == 40 and len(by["u0-r1"].prompt) == 8  # later rounds carry the user turn only
    conv = Conversations()
    with pytest.raises(ValueError, match="no answered request"):
        conv.prompt(by["u0-r1"])
    p0 = conv.prompt(by["u0-r0"])
    assert p0 == by["u0-r0"].prompt
    conv.answered(by["u0-r0"], p0, (1, 2, 3, 4, 5))
    conv.answered(by["u1-r0"], by["u1-r0"].prompt, (9, 9, 9, 9, 9))
    p1 = conv.prompt(by["u0-r1"])
    assert p1 == p0 + (1, 2, 3, 4, 5) + by["u0-r1"].prompt  # the conversation so far, with the model's reply
    conv.answered(by["u0-r1"], p1, (6, 7, 8, 9, 10))
    assert conv.prompt(by["u0-r2"]) == p1 + (6, 7, 8, 9, 10) + by["u0-r2"].prompt
    assert conv.prompt(by["u1-r1"])[:45] == by["u1-r0"].prompt + (9,) * 5  # sessions do not mix
    with pytest.raises(ValueError, match="reply and context tokens >= 0"):
        multi_turn(2, 1, 1, 8, 8, -1, 1)


def test_multi_turn_user_context_is_the_users_own_and_opens_the_conversation() -> None:
    reqs = multi_turn(users=3, rounds=2, groups=1, system_tokens=16, user_tokens=4, reply_tokens=2, output_tokens=1,
                      context_tokens=24)
    by = {r.rid: r for r in reqs}
    r0 = [by[f"u{u}-r0"].prompt for u in range(3)]
    assert all(len(p) == 16 + 24 + 4 for p in r0)
    assert r0[0][:16] == r0[1][:16] == r0[2][:16]                  # one group: one system prompt
    contexts = {p[16:40] for p in r0}
    assert len(contexts) == 3                                      # each user's context is their own
    assert by["u1-r1"].prompt[:44] == r0[1] and len(by["u1-r1"].prompt) == 44 + 2 + 4
    assert multi_turn(3, 2, 1, 16, 4, 2, 1, context_tokens=0)[0].prompt == multi_turn(3, 2, 1, 16, 4, 2, 1)[0].prompt
    with pytest.raises(ValueError, match="reply and context tokens >= 0"):
        multi_turn(3, 2, 1, 16, 4, 2, 1, context_tokens=-1)


def test_oracle_keeps_what_was_generated_but_the_last_token() -> None:
    a = tuple(range(100, 132))                        # 2 blocks of prompt
    out = tuple(range(500, 517))                       # 17 generated tokens: 16 computed, the last never fed back
    follow = a + out + (7,) * 16                       # the next round: prompt + reply + user turn
    assert prefix_oracle([a, follow], [a + out[:-1], follow], 16) == [0, 48]  # the reply's full block is cached
    assert prefix_oracle([a, follow], [a, follow], 16) == [0, 32]            # prompts only: the reply is recomputed
    short = a + out[:15] + (7,) * 16                   # 15 output tokens computed (16 generated): no full block
    assert prefix_oracle([a, short], [a + out[:15], short], 16) == [0, 32]
    with pytest.raises(ValueError):
        prefix_oracle([a], [], 16)


def test_routing() -> None:
    assert route("round-robin", 5, 2, 0) == [0, 1, 0, 1, 0]
    r = route("random", 200, 3, 7)
    assert r == route("random", 200, 3, 7) and set(r) == {0, 1, 2}


def test_lru_and_belady_hit_counts_match_hand_computed_ones() -> None:
    from kvpool_bench.workloads import belady_hits, lru_hits

    # One block per request, capacity 2: A B C A B D A.
    seq = [["A"], ["B"], ["C"], ["A"], ["B"], ["D"], ["A"]]
    # LRU: every reference misses (A, B and C chase each other out; D evicts A before its reuse).
    assert lru_hits(seq, seq, 2) == [0, 0, 0, 0, 0, 0, 0]
    # MIN: C (never used again) goes at once, so A and B hit; D goes at once, so A hits again.
    assert belady_hits(seq, seq, 2) == [0, 0, 0, 1, 1, 0, 1]
    # Prefixes: a block counts only behind its whole prefix; capacity 3.
    refs = [["s", "x"], ["s", "y"], ["s", "x", "z"], ["s", "y"]]
    puts = [["s", "x"], ["s", "y"], ["s", "x", "z"], ["s", "y"]]
    # LRU: after request 2 the cache holds s, x, z (y evicted as least recent): request 3 hits s only.
    assert lru_hits(refs, puts, 3) == [0, 1, 2, 1]
    # MIN keeps y (used by request 3) and drops a block never used again (x or z).
    assert belady_hits(refs, puts, 3) == [0, 1, 2, 2]
    # Unbounded, both are the infinite-cache oracle.
    assert lru_hits(refs, puts, 100) == belady_hits(refs, puts, 100) == [0, 1, 2, 2]


def test_bounded_oracles_agree_with_the_infinite_oracle_when_everything_fits() -> None:
    from kvpool_bench.workloads import bounded_oracles, prefix_oracle, unique_prompts

    reqs = multi_turn(3, 3, 1, 64, 16, 8, 4, seed=1, context_tokens=32)
    prompts = [r.prompt for r in reqs]
    lru, belady = bounded_oracles(prompts, prompts, 16, 10_000)
    assert lru == belady == prefix_oracle(prompts, prompts, 16) and sum(lru) > 0
    small_lru, small_belady = bounded_oracles(prompts, prompts, 16, 4)
    assert sum(small_lru) <= sum(small_belady) <= sum(lru)
    unique = [r.prompt for r in unique_prompts(20, 40, 80, 4, seed=2)]
    assert bounded_oracles(unique, unique, 16, 10_000) == ([0] * 20, [0] * 20)


def test_a_trace_can_open_every_prompt_with_one_shared_system_prompt(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8]}]
    reqs = mooncake_trace(rows, 32, 80, 8, system_tokens=16)
    assert reqs[0].prompt[:16] == reqs[1].prompt[:16] and reqs[0].prompt[16:48] != reqs[1].prompt[16:48]
    assert [len(r.prompt) for r in reqs] == [80, 80]              # the cut counts the system prompt too
    assert reqs[0].prompt[16:] == mooncake_trace(rows, 32, 64, 8)[0].prompt
    with pytest.raises(ValueError, match="system tokens"):
        mooncake_trace(rows, 32, 80, 8, system_tokens=80)


def test_fill_index_is_the_request_after_which_the_distinct_blocks_outgrow_the_capacity() -> None:
    prompts = [list(range(i * 100, i * 100 + 32)) for i in range(5)]   # 2 new blocks of 16 each
    assert fill_index(prompts, 16, 5) == 2                            # 2, 4, then 6 > 5
    assert fill_index(prompts, 16, 100) == 5                          # never


def test_hit_windows_compare_each_window_with_lru() -> None:
    def res(i: int, hit: int, err: str = "") -> Result:
        return Result(f"r{i}", 0, 100, 1, hit // 2, hit - hit // 2, 0.1, 0.2, err)
    results = [res(0, 0), res(1, 20), res(2, 50), res(3, 40, "boom"), res(4, 80)]
    lru = [0, 40, 50, 40, 40]
    w = hit_windows(results, lru, 2, first_full=1)
    assert [x["first"] for x in w] == [0, 2, 4] and [x["requests"] for x in w] == [2, 1, 1]
    assert [x["hit_rate"] for x in w] == [0.1, 0.5, 0.8] and [x["lru_hit_rate"] for x in w] == [0.2, 0.5, 0.4]
    assert [x["hit_rate_of_lru"] for x in w] == [0.5, 1.0, 2.0] and [x["full"] for x in w] == [False, True, True]


def test_dram_overflow_splits_ttft_where_the_computed_kv_outgrows_dram() -> None:
    prompts = [tuple(range(i * 100, i * 100 + 32)) for i in range(5)]   # 2 new blocks each
    ttfts = [1.0, 1.0, 3.0, 2.0, 4.0]
    results = [Result(f"r{i}", 0, 32, 1, 0, 0, t, t, "boom" if i == 3 else "") for i, t in enumerate(ttfts)]
    out = dram_overflow(results, list(prompts), 16, 5)                  # 2, 4, then 6 > 5: after request 2
    assert out["dram_overflow_request"] == 2
    assert out["ttft_p50_before_overflow_s"] == pct([1.0, 1.0, 3.0], 50)
    assert out["ttft_p50_after_overflow_s"] == 4.0                      # request 3 failed: left out
    assert out["ttft_after_over_before_overflow"] == 4.0 / out["ttft_p50_before_overflow_s"]
    never = dram_overflow(results, list(prompts), 16, 100)
    assert never["dram_overflow_request"] == 5 and never["ttft_after_over_before_overflow"] != \
        never["ttft_after_over_before_overflow"]                        # nan: nothing after



def test_the_table_says_never_when_the_kv_never_outgrew_dram(capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo`'s table: a workload that fits in DRAM prints "never" and "-", not nan."""
    base = {"requests": 5, "errors": 0, "prompt_tokens": 100, "local_hit_tokens": 0, "remote_hit_tokens": 0,
            "recomputed_tokens": 100, "hit_rate": 0.0, "oracle_hit_rate": 0.5, "hit_rate_of_oracle": 0.0,
            "ttft_p50_s": 1.0, "ttft_p90_s": 1.0, "ttft_p99_s": 1.0, "tpot_mean_s": 0.05, "requests_per_s": 1.0,
            "output_tokens_per_s": 1.0, "bytes_transferred": 0, "wall_s": 5.0}
    prompts = [tuple(range(i * 100, i * 100 + 32)) for i in range(5)]
    results = [Result(f"r{i}", 0, 32, 1, 0, 0, 1.0, 1.0) for i in range(5)]
    print_table({"pool-on": {**base, **dram_overflow(results, list(prompts), 16, 100)},
                 "pool-off": {**base, **dram_overflow(results, list(prompts), 16, 5)}})
    rows = {line[:26].strip(): line[26:].split() for line in capsys.readouterr().out.splitlines() if line[:26].strip()}
    assert rows["DRAM outgrown after req."] == ["never", "2"]
    assert rows["TTFT p50 before / after"] == ["-", "1.00", "/", "1.00", "s"]
    assert rows["TTFT p50 after / before"] == ["-", "1.00x"]
    assert not any("nan" in cell for cells in rows.values() for cell in cells)


def test_hit_windows_report_each_windows_ttft_p50() -> None:
    results = [Result(f"r{i}", 0, 10, 1, 0, 0, float(i), float(i)) for i in range(4)]
    w = hit_windows(results, [0] * 4, 2, first_full=0)
    assert [x["ttft_p50_s"] for x in w] == [pct([0.0, 1.0], 50), pct([2.0, 3.0], 50)]


@pytest.mark.parametrize("interleave", [False, True])
def test_interleaved_multi_turn_sends_every_users_round_before_the_next(monkeypatch: pytest.MonkeyPatch,
                                                                       interleave: bool) -> None:
    import threading
    import time

    from kvpool_bench import cross_node

    sent: list[str] = []
    lock = threading.Lock()

    def fake(url: str, req: BenchRequest, node: int, prompt: tuple[int, ...] | None = None, **_: object) -> Result:
        with lock:
            sent.append(req.rid)
        time.sleep(0.001)
        return Result(req.rid, node, len(prompt or ()), 2, 0, 0, 0.0, 0.0, prompt_ids=prompt or (),
                      output_ids=(1, 2))

    monkeypatch.setattr(cross_node, "stream_completion", fake)
    reqs = multi_turn(users=5, rounds=3, groups=1, system_tokens=4, user_tokens=2, reply_tokens=0, output_tokens=2)
    results, _ = cross_node.run_workload(["u0", "u1"], reqs, "round-robin", 2, 0, interleave=interleave)
    assert [r.rid for r in results] == [r.rid for r in reqs] and not any(r.error for r in results)
    rounds = [int(rid.split("-r")[1]) for rid in sent]
    for user in range(5):   # a session's rounds stay in order either way
        mine = [rid for rid in sent if rid.startswith(f"u{user}-")]
        assert mine == [f"u{user}-r{r}" for r in range(3)]
    if interleave:          # round-major; two in flight may swap neighbours' sends
        assert max(rounds[:3]) == 0 and min(rounds[-3:]) == 2
    else:                   # two users at once, each through its rounds: u2 starts after u0's last
        assert rounds != sorted(rounds)
    assert all(r.start_s >= 0 for r in results) and max(r.start_s for r in results) > 0


def test_distinct_blocks_counts_each_chain_block_once() -> None:
    a = list(range(48))                         # 3 blocks
    assert distinct_blocks([a, a[:32] + [7] * 16, a[:40]], 16) == 4   # the second's third block differs
