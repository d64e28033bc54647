"""The replay's event loop on hand-computed cases, and its block naming against the
token-level oracle of `kvpool bench cross-node`."""
from __future__ import annotations

import dataclasses
import sys

import pytest

from kvpool.disk_file import disk_slot_bytes
from kvpool.layout import slot_bytes_for
from kvpool_bench.workloads import load_trace, lru_hits, mooncake_trace, prefix_oracle
from kvpool_plan.profile import ModelProfile, load_profile
from kvpool_plan.sim import (NAMESPACE, SimConfig, SimResult, Simulator, build_requests, percentile, simulate,
                             summarize)
from metaserver.types import Medium

TRACE = "/work/shared/data/mooncake_synthetic_trace.jsonl"

# 4-token blocks of 100 bytes; prefill 100 tok/s; a decode step 0.1 s; pulls 0.01 s + 1,000 B/s.
P = ModelProfile("hand", block_size=4, kv_bytes_per_token=25, prefill_tok_per_s=((1, 100.0),),
                 decode_tok_per_s=((1, 10.0),), link_bytes_per_s=1000.0, link_latency_s=0.01,
                 local_copy_bytes_per_s=10000.0)
BIG = 1 << 20


def rows(*specs: tuple[float, list[int], int]) -> list[dict]:
    """(arrival s, hash ids, output tokens) per request: 4 tokens per hash id."""
    return [{"timestamp": t * 1000, "input_length": 4 * len(ids), "output_length": out, "hash_ids": ids}
            for t, ids, out in specs]


def run(specs: list, nodes: int = 1, pool: int = BIG, policy: str = "round-robin", kv: int = BIG):
    reqs = build_requests(rows(*specs), P.block_size, tokens_per_hash_id=4)
    return simulate(reqs, SimConfig(nodes, kv, pool, policy, P))


def ttft(res) -> list[float]:
    return [round(r.first_token_s - r.arrival_s, 6) for r in res.requests]


def test_a_shared_prefix_on_one_node_is_a_local_hit() -> None:
    res = run([(0, [1, 2, 3], 1), (1, [1, 2, 4], 1)])
    a, b = res.requests
    # 12 tokens: the last block holds the last token, so at most 2 blocks can hit.
    assert (a.local_blocks, a.computed_tokens) == (0, 12)
    assert (b.local_blocks, b.own_pool_blocks, b.remote_blocks, b.computed_tokens) == (2, 0, 0, 4)
    assert ttft(res) == [0.12, 0.04]  # 12 and 4 tokens at 100 tok/s
    assert res.link_bytes == {}


def test_round_robin_on_two_nodes_pulls_from_the_pool() -> None:
    res = run([(0, [1, 2, 3], 1), (1, [1, 2, 4], 1)], nodes=2)
    a, b = res.requests
    assert (a.node, b.node) == (0, 1)
    assert (b.local_blocks, b.remote_blocks, b.computed_tokens) == (0, 2, 4)
    assert ttft(res) == [0.12, 0.25]  # pull 0.01 + 200 B / 1,000 B/s, then 4 tokens
    assert res.link_bytes == {("n0", "n1"): 200}
    s = summarize(res)
    assert s["hit_rate_pool"] == pytest.approx(8 / 24) and s["hit_rate_local"] == 0
    assert s["oracle_infinite"] == pytest.approx(8 / 24)


def test_a_pull_against_a_recompute() -> None:
    """Pool off: the second request recomputes its 12 tokens (0.12 s) where the pool (slow
    link) pulled 2 blocks for 0.21 s and computed 4 (0.25 s): the model charges each."""
    off = run([(0, [1, 2, 3], 1), (1, [1, 2, 4], 1)], nodes=2, pool=0)
    assert ttft(off) == [0.12, 0.12] and off.requests[1].computed_tokens == 12
    # a longer shared prefix: 9 blocks pulled (0.01 + 0.9 s) vs 36 tokens recomputed (0.36 s)
    long = list(range(1, 10))
    on = run([(0, long + [10], 1), (5, long + [11], 1)], nodes=2)
    assert ttft(on)[1] == pytest.approx(0.01 + 0.9 + 0.04)
    off = run([(0, long + [10], 1), (5, long + [11], 1)], nodes=2, pool=0)
    assert ttft(off)[1] == pytest.approx(0.40)


def test_own_pool_hit_after_the_kv_cache_dropped_the_prefix() -> None:
    """A KV cache of 3 blocks: the third request's prefix left it, the node's own pool
    still holds it (a memcpy: 200 B at 10,000 B/s)."""
    res = run([(0, [1, 2, 3], 1), (1, [5, 6, 7], 1), (2, [1, 2, 8], 1)], kv=3 * P.block_bytes)
    c = res.requests[2]
    assert (c.local_blocks, c.own_pool_blocks, c.remote_blocks) == (0, 2, 0)
    assert ttft(res)[2] == pytest.approx(0.02 + 0.04)


def test_an_eviction_ends_the_hit() -> None:
    """A pool of 2 slots: the third save evicts both (NodePool frees up to evict_batch slots
    at once), so the index holds only block 3 and the next request pulls nothing."""
    res = run([(0, [1, 2, 3], 1), (1, [1, 2, 4], 1)], nodes=2, pool=2 * slot_bytes_for(P.block_bytes))
    b = res.requests[1]
    assert (b.remote_blocks, b.computed_tokens) == (0, 12)
    assert res.pool_evictions == 2 + 2  # n0: 1, 2 for 3; n1: 1, 2 for 4
    s = summarize(res)
    assert s["hit_rate"] == 0


def test_queueing_then_prefill() -> None:
    """Two requests at once on one node: the second waits for the first's prefill."""
    res = run([(0, [1, 2, 3], 1), (0, [5, 6, 7], 3)])
    assert ttft(res) == [0.12, 0.24]
    assert res.requests[1].tpot_s == pytest.approx(0.1)  # batch 1 at 10 tok/s
    assert res.end_s == pytest.approx(0.24 + 2 * 0.1)


def test_prefix_routing_sends_the_second_request_to_its_prefix() -> None:
    res = run([(0, [1, 2, 3], 1), (1, [1, 2, 4], 1)], nodes=2, policy="prefix")
    a, b = res.requests
    assert b.node == a.node and b.local_blocks == 2
    res = run([(0, [1, 2, 3], 1), (1, [7, 8, 9], 1), (2, [7, 8, 4], 1)], nodes=2, policy="least-loaded")
    assert [r.node for r in res.requests] == [0, 1, 0]  # all idle: in turn


def test_output_blocks_are_saved_and_take_room() -> None:
    """12 prompt + 9 output tokens: the engine computes 20, 5 full blocks (2 of them output)."""
    res = run([(0, [1, 2, 3], 9)])
    r = res.requests[0]
    assert len(r.hashes) == 3 and len(r.out_hashes) == 2
    assert res.pool_puts == 5


@pytest.mark.parametrize("tpi, max_prompt", [(16, 256), (32, 512), (8, 200), (24, 0)])
def test_block_names_hit_as_the_token_chains_do(tpi: int, max_prompt: int) -> None:
    """The hash-id naming gives every request the hit `prefix_oracle` finds on the prompts
    `kvpool bench cross-node` builds (real tokens, chained SHA-256), engine blocks of 16."""
    trace = load_trace(TRACE, 400, 3000)
    cut = max_prompt or 10**9
    prompts = [r.prompt for r in mooncake_trace(trace, tpi, cut, 16)]
    want = prefix_oracle(prompts, prompts, 16)
    reqs = build_requests(trace, 16, tpi, max_prompt)
    assert [r.num_tokens for r in reqs] == [len(p) for p in prompts]
    got = lru_hits([r.hashes[:(r.num_tokens - 1) // 16] for r in reqs], [r.hashes for r in reqs], sys.maxsize)
    assert [n * 16 for n in got] == want
    assert sum(want) > 0


def test_the_public_trace_on_16_nodes_is_quick_and_below_its_oracles() -> None:
    reqs = build_requests(load_trace(TRACE, 1000, 2993), 16, 16, 512, 32)
    s = summarize(simulate(reqs, SimConfig(16, 96 << 20, 256 << 20, "prefix", load_profile("cpu-smollm2-135m"))))
    assert 0 < s["hit_rate"] <= s["oracle_infinite"] + 1e-9
    assert s["oracle_lru"] <= s["oracle_infinite"] and s["oracle_belady"] <= s["oracle_infinite"]
    assert s["ttft_p50_s"] > 0 and sum(s["requests_per_node"]) == 1000


def test_percentile() -> None:
    assert percentile([], 50) == 0
    assert percentile([3, 1, 2], 50) == 2 and percentile(list(range(1, 101)), 99) == 100


def test_a_closed_loop_sends_the_next_request_when_one_ends() -> None:
    """Concurrency 1: the second request is sent when the first has ended (its prefill
    0.12 s, then 2 decode steps of 0.1 s), whatever the trace's times say."""
    reqs = build_requests(rows((0, [1, 2, 3], 3), (0, [5, 6, 7], 1)), P.block_size, tokens_per_hash_id=4)
    res = simulate(reqs, SimConfig(2, BIG, BIG, "round-robin", P), concurrency=1)
    assert [r.arrival_s for r in res.requests] == [0, pytest.approx(0.32)]
    assert ttft(res) == [0.12, 0.12]


def test_prefill_and_decode_share_the_node() -> None:
    """A generates 3 tokens: first at 0.12, then decode steps of 0.1 s. B arrives at 0.15,
    in A's step, and waits for it (0.22); its prefill step carries A's last decode token
    (0.12 + 0.1 s): both at 0.44. B's TTFT 0.29; A's TPOT (0.44 - 0.12) / 2."""
    res = run([(0, [1, 2, 3], 3), (0.15, [5, 6, 7], 1)])
    a, b = res.requests
    assert ttft(res) == [0.12, 0.29]
    assert b.start_s == pytest.approx(0.22)
    assert a.end_s == pytest.approx(0.44) and a.tpot_s == pytest.approx(0.16)


def test_local_hits_refresh_the_pool() -> None:
    """The connector's Recency rule on a 3-slot pool freeing one slot at a time: a local hit
    touches its blocks in the node's pool (so a later save evicts others), and a local-hit
    block the index holds nowhere is saved again."""
    from kvpool_plan.sim import Simulator

    def h(i: int) -> int:  # the name of hash id i's (only) block: 4 tokens per id and block
        return i * 4 + 3

    specs = [(0, [1, 2, 3], 1), (1, [1, 2, 4, 5], 1), (2, [1, 2, 6, 7], 1)]
    sim = Simulator(SimConfig(1, BIG, 3 * slot_bytes_for(P.block_bytes), "round-robin", P, evict_batch=1))
    sim.run(build_requests(rows(*specs[:2]), 4, 4))
    # request 1: local hit 1, 2 touched -> [3, 1, 2]; its saves 4, 5 evict 3 and 1
    assert sim.nodes[0].pool.blocks() == [h(2), h(4), h(5)]
    sim = Simulator(SimConfig(1, BIG, 3 * slot_bytes_for(P.block_bytes), "round-robin", P, evict_batch=1))
    sim.run(build_requests(rows(*specs), 4, 4))
    # request 2: block 1 is a local hit the index holds nowhere: saved again (evicting 4), then 6, 7
    assert sim.nodes[0].pool.blocks() == [h(1), h(6), h(7)]
    assert sim.index.prefix_by_node("plan", [h(1)]) == (1, {"n0": 1})


def test_time_scale_and_limits() -> None:
    reqs = build_requests(rows((2, [1, 2, 3], 50)), 4, tokens_per_hash_id=4, max_prompt_tokens=6,
                          max_output_tokens=5, time_scale=0.5)
    r = reqs[0]
    assert (r.arrival_s, r.num_tokens, r.output_tokens, len(r.hashes)) == (1.0, 6, 5, 1)
    assert len(r.out_hashes) == (6 + 5 - 1) // 4 - 1  # computed 10 tokens: 2 full blocks, 1 of the prompt
    with pytest.raises(ValueError, match="hash_ids must be"):
        build_requests(rows((0, [1, -2], 1)), 4)


# ---- asynchronous loads (SimConfig.async_loads) -------------------------------------------


def run_mode(specs: list, async_loads: bool, nodes: int = 2, pool: int = BIG, evict_batch: int = 16):
    reqs = build_requests(rows(*specs), P.block_size, tokens_per_hash_id=4)
    return simulate(reqs, SimConfig(nodes, BIG, pool, "round-robin", P, evict_batch=evict_batch,
                                    async_loads=async_loads))


def test_a_load_runs_outside_the_steps_and_its_request_waits_for_the_next_boundary() -> None:
    """Round-robin on 2 nodes. A [5,6,7] on n0 (out 5): prefill 0-0.12, then decode steps of
    0.1 s ending at 0.22, 0.32, 0.42, 0.52. B [1,2,3] on n1: prefill 0-0.12, saves its
    blocks. C [1,2,4] arrives at 0.15 on n0, in A's step: looked up at arrival (blocks 1, 2
    on n1), its load issued at the boundary 0.22: 0.01 + 200 B / 1,000 B/s = 0.21 s, done
    at 0.43, in A's step 0.42-0.52; admitted at 0.52 (A has just ended), prefills its last
    4 tokens, 0.04 s: first token 0.56, TTFT 0.07 + 0.21 + 0.09 + 0.04 = 0.41. A's steps
    are not slowed by C's load. D [9,10,11] at 0.3 on n1 (the load's source): 0.12."""
    specs = [(0, [5, 6, 7], 5), (0, [1, 2, 3], 1), (0.15, [1, 2, 4], 1), (0.3, [9, 10, 11], 1)]
    res = run_mode(specs, async_loads=True)
    a, b, c, d = res.requests
    assert [r.node for r in res.requests] == [0, 1, 0, 1]
    assert (c.local_blocks, c.remote_blocks, c.computed_tokens) == (0, 2, 4)
    assert (c.load_start_s, c.load_end_s) == (pytest.approx(0.22), pytest.approx(0.43))
    assert c.start_s == pytest.approx(0.52)
    assert ttft(res) == [0.12, 0.12, 0.41, 0.12]
    assert a.end_s == pytest.approx(0.52) and a.tpot_s == pytest.approx(0.1)
    s = summarize(res, with_oracles=False)
    assert s["loads"] == 1 and s["load_done_p50_s"] == pytest.approx(0.43 - 0.15)
    # The first version: C's load and prefill in n0's step at 0.22 with A's token:
    # 0.21 + 0.04 + 0.1 s, C's first token at 0.57 (TTFT 0.42), A's next tokens at 0.57,
    # 0.67, 0.77.
    old = run_mode(specs, async_loads=False)
    assert ttft(old) == [0.12, 0.12, 0.42, 0.12]
    assert old.requests[0].end_s == pytest.approx(0.77)


@pytest.mark.parametrize("specs, nodes", [
    ([(0, [1, 2, 3], 1), (1, [1, 2, 4], 1)], 1),                      # local hits only
    ([(0, [1, 2, 3], 3), (0.15, [5, 6, 7], 1)], 1),                   # queueing behind a step
    ([(0, [1, 2, 3], 1), (0, [5, 6, 7], 3), (0, [8, 9], 2)], 2),      # no hit at all
])
def test_requests_without_pool_hits_are_unaffected(specs: list, nodes: int) -> None:
    on = run_mode(specs, async_loads=True, nodes=nodes)
    off = run_mode(specs, async_loads=False, nodes=nodes)
    assert ttft(on) == ttft(off)
    assert [(r.start_s, r.end_s, r.local_blocks, r.computed_tokens) for r in on.requests] == \
        [(r.start_s, r.end_s, r.local_blocks, r.computed_tokens) for r in off.requests]
    assert summarize(on, with_oracles=False)["loads"] == 0


def test_a_block_evicted_between_lookup_and_load_is_a_failed_read() -> None:
    """Pools of 3 slots freeing one at a time. A (40 tokens) prefills on n0 0-0.4. B [1,2,3]
    on n1 saves 1, 2, 3 at 0.12. C [1,2,4] arrives at 0.13 on n0: its lookup finds 1, 2 on
    n1, but its load is issued only at n0's boundary 0.4; D [9,10,11] at 0.14 on n1 saves 9,
    10, 11 at 0.26, evicting 1, 2, 3: both reads fail, C recomputes its 12 tokens, 0.4-0.52."""
    specs = [(0, list(range(20, 30)), 1), (0, [1, 2, 3], 1), (0.13, [1, 2, 4], 1), (0.14, [9, 10, 11], 1)]
    res = run_mode(specs, async_loads=True, pool=3 * slot_bytes_for(P.block_bytes), evict_batch=1)
    c = res.requests[2]
    assert (c.failed_blocks, c.remote_blocks, c.computed_tokens, c.loaded) == (2, 0, 12, False)
    assert ttft(res)[2] == pytest.approx(0.52 - 0.13)
    assert summarize(res, with_oracles=False)["failed_read_tokens"] == 8


def test_a_nodes_loads_share_its_link_one_after_another() -> None:
    """3 nodes in turn. n0 and n1 hold [1,2,..] and [5,6,..]; at 1 s two requests pulling 2
    blocks each (from n0 and n1) reach idle n2 at once: the second load starts when the
    first ends (0.21 s each), and each is prefilled (4 tokens, 0.04 s) after its own load."""
    specs = [(0, [1, 2, 3], 1), (0, [5, 6, 7], 1), (0, [30], 1),
             (1, [40], 1), (1, [41], 1), (1, [1, 2, 4], 1), (1, [50], 1), (1, [51], 1), (1, [5, 6, 8], 1)]
    res = run_mode(specs, async_loads=True, nodes=3)
    c, e = res.requests[5], res.requests[8]
    assert (c.node, e.node, c.remote_blocks, e.remote_blocks) == (2, 2, 2, 2)
    assert (c.load_start_s, c.load_end_s) == (pytest.approx(1.0), pytest.approx(1.21))
    assert (e.load_start_s, e.load_end_s) == (pytest.approx(1.21), pytest.approx(1.42))
    assert ttft(res)[5] == pytest.approx(0.25) and ttft(res)[8] == pytest.approx(0.46)


# ---- the disk tier ---------------------------------------------------------------------------

# P with a disk: a block read from disk costs 0.005 s + 100 B / 1,000 B/s = 0.105 s.
PD = dataclasses.replace(P, disk_read_bytes_per_s=1000.0, disk_read_latency_s=0.005)
SLOT = slot_bytes_for(P.block_bytes)
DISK_SLOT = disk_slot_bytes(P.block_bytes)


def run_disk(specs: list, nodes: int = 1, disk_slots: int = 8, kv_blocks: int = 2,
             policy: str = "round-robin") -> tuple[Simulator, SimResult]:
    """Pools of 2 slots (a third block evicts both), disks of `disk_slots`, KV caches of
    `kv_blocks` (small, so a prompt's first blocks leave it)."""
    reqs = build_requests(rows(*specs), P.block_size, tokens_per_hash_id=4)
    sim = Simulator(SimConfig(nodes, kv_blocks * P.block_bytes, 2 * SLOT, policy, PD,
                              disk_bytes=disk_slots * DISK_SLOT))
    return sim, sim.run(reqs)


def media(sim: Simulator, node: int, hashes: list[int]) -> list:
    """How the index lists `node`'s copy of each block: its medium, None if it has none."""
    nid = sim.nodes[node].node_id
    res = sim.index.query(NAMESPACE, hashes, requester=nid, sparse=True)
    return [loc.medium if loc is not None and loc.node_id == nid else None for loc in res.held]


# hash ids 1, 2, 3 at 4 tokens each: blocks 7, 11, 15 (the hash id's last token names a block)
A_PROMPT, A_AGAIN = [1, 2, 3], [1, 2, 8]


@pytest.mark.parametrize("disk_slots, own_disk, ttft_again", [
    (0, 0, 0.12),   # no disk tier: 7 and 11 left the pool, recomputed (12 tokens)
    (1, 0, 0.12),   # one disk slot: 11's write evicted 7; a run never starts after a gap
    (2, 2, 0.25),   # both on disk: 2 x 0.105 s read, then 4 tokens (0.04 s)
])
def test_a_block_evicted_to_disk_is_hit_there_by_its_own_node(disk_slots: int, own_disk: int,
                                                               ttft_again: float) -> None:
    """The first prompt's saves evict 7 and 11 from a 2-slot pool (the third save evicts both)
    into the disk tier; its KV cache of 2 blocks keeps 11 and 15 only. The same prefix again
    reads 7 and 11 from the node's disk, if the disk still holds both."""
    sim, res = run_disk([(0, A_PROMPT, 1), (1, A_AGAIN, 1)], disk_slots=disk_slots)
    a, b = res.requests
    assert (b.local_blocks, b.own_pool_blocks, b.remote_blocks, b.remote_disk_blocks) == (0, 0, 0, 0)
    assert b.own_disk_blocks == own_disk and b.computed_tokens == 12 - 4 * own_disk
    assert ttft(res) == [0.12, pytest.approx(ttft_again)]
    assert res.link_bytes == {}
    if own_disk:
        # Read back = promoted into DRAM: 7 into a free slot; 11's put evicts 15 and 7, whose
        # writes to the full disk drop 7 and then 11 (not in DRAM yet: unpublished), and 11
        # is published from DRAM, as NodePool does it (tests/plan/test_eviction.py).
        assert sim.nodes[0].disk is not None and sim.nodes[0].disk.blocks() == [15, 7]
        assert media(sim, 0, [7, 11, 15]) == [Medium.DISK, Medium.DRAM, Medium.DISK]
        s = summarize(res)
        assert s["hit_rate_own_disk"] == s["hit_rate_disk"] == pytest.approx(8 / 24)
        assert s["hit_rate"] == s["hit_rate_pool"] == pytest.approx(8 / 24) and s["hit_own_pool_tokens"] == 0
        assert s["disk_slots_per_node"] == 2 and s["capacity_blocks"] == 2 + 2 + 2


def test_the_index_lists_each_block_with_the_tier_it_is_in() -> None:
    """After the first prompt: 7 and 11 went to disk (DISK), 15 is in DRAM; a disk of one
    slot keeps 11 only, and 7 leaves the index."""
    sim, _ = run_disk([(0, A_PROMPT, 1)])
    assert media(sim, 0, [7, 11, 15]) == [Medium.DISK, Medium.DISK, Medium.DRAM]
    sim, _ = run_disk([(0, A_PROMPT, 1)], disk_slots=1)
    assert media(sim, 0, [7, 11, 15]) == [None, Medium.DISK, Medium.DRAM]
    assert sim.nodes[0].disk is not None and sim.nodes[0].disk.evictions == 1


def test_another_nodes_disk_block_is_staged_and_pulled() -> None:
    """Round-robin: n0 computes the prompt and holds 7 and 11 on its disk only; n1's request
    stages them (a disk read on n0, 2 x 0.105 s) and pulls them (0.01 + 200 B / 1,000 B/s),
    then computes 4 tokens. n0 promoted them: 7 into DRAM, then 11's promotion evicted 15 and
    7 back to disk."""
    sim, res = run_disk([(0, A_PROMPT, 1), (1, A_AGAIN, 1)], nodes=2)
    a, b = res.requests
    assert (a.node, b.node) == (0, 1)
    assert (b.remote_disk_blocks, b.remote_blocks, b.own_disk_blocks, b.computed_tokens) == (2, 0, 0, 4)
    assert ttft(res) == [0.12, pytest.approx(0.21 + 0.21 + 0.04)]
    assert res.link_bytes == {("n0", "n1"): 200}
    assert media(sim, 0, [7, 11, 15]) == [Medium.DISK, Medium.DRAM, Medium.DISK]
    s = summarize(res)
    assert s["hit_rate_remote_disk"] == pytest.approx(8 / 24) and s["hit_remote_tokens"] == 0
    # without disks the same requests recompute everything
    _, off = run_disk([(0, A_PROMPT, 1), (1, A_AGAIN, 1)], nodes=2, disk_slots=0)
    assert off.requests[1].computed_tokens == 12 and summarize(off)["hit_rate"] == 0


def test_a_disk_block_gone_before_the_load_is_a_failed_read() -> None:
    """Disks of 2 slots, round-robin. n1 is prefilling a 40-token prompt (0.5 to 0.9 s) when
    the same prefix arrives there at 0.7: its lookup finds 7 and 11 on n0's disk. At 0.72
    n0's saves of another prompt push them off its disk; the load issued at n1's step boundary
    (0.9) fails at the run's first block and the prompt is recomputed."""
    _, res = run_disk([(0, A_PROMPT, 1), (0.5, list(range(30, 40)), 1), (0.6, [40, 41, 42], 1),
                       (0.7, A_AGAIN, 1)], nodes=2, disk_slots=2)
    d = res.requests[3]
    assert [r.node for r in res.requests] == [0, 1, 0, 1]
    assert (d.failed_blocks, d.pool_blocks, d.computed_tokens) == (2, 0, 12)
    assert ttft(res)[3] == pytest.approx(0.9 - 0.7 + 0.12)
    assert summarize(res)["failed_read_tokens"] == 8
    # a third prompt of one block evicts nothing: the same load reads both from n0's disk
    _, res = run_disk([(0, A_PROMPT, 1), (0.5, list(range(30, 40)), 1), (0.6, [40], 1), (0.7, A_AGAIN, 1)],
                      nodes=2, disk_slots=2)
    d = res.requests[3]
    assert (d.node, d.remote_disk_blocks, d.failed_blocks, d.computed_tokens) == (1, 2, 0, 4)


def test_a_disk_tier_raises_the_hit_rate_on_a_trace() -> None:
    """A window of the public trace on 2 nodes with small DRAM pools: a disk tier under them
    holds what DRAM drops, so more prompt tokens hit; never above the infinite oracle."""
    rows_ = load_trace(TRACE, 300, 3500)
    prof = load_profile("cpu-smollm2-135m")
    out = {}
    for disk in (0, 1 << 30):
        reqs = build_requests(rows_, 16, 16, 256, 16)
        cfg = SimConfig(2, 16 * prof.block_bytes, 32 * slot_bytes_for(prof.block_bytes), "round-robin", prof,
                        disk_bytes=disk)
        out[disk] = summarize(simulate(reqs, cfg))
    off, on = out[0], out[1 << 30]
    assert off["hit_rate_disk"] == 0 and off["disk_writes"] == 0
    assert on["hit_rate"] > off["hit_rate"] and on["hit_rate_disk"] > 0 and on["disk_writes"] > 0
    assert on["hit_rate"] <= on["oracle_infinite"] + 1e-9
    assert on["hit_rate_disk"] == pytest.approx(on["hit_rate_own_disk"] + on["hit_rate_remote_disk"])
    assert on["hit_rate_pool"] == pytest.approx(on["hit_rate_own_pool"] + on["hit_rate_remote"] + on["hit_rate_disk"])


def test_no_disk_tier_without_a_pool_and_bad_sizes() -> None:
    assert SimConfig(1, BIG, 0, "round-robin", PD, disk_bytes=BIG).disk_slots == 0
    assert SimConfig(1, BIG, SLOT, "round-robin", PD, disk_bytes=3 * DISK_SLOT - 1).disk_slots == 2
    with pytest.raises(ValueError, match="--disk must be >= 0"):
        SimConfig(1, BIG, SLOT, "round-robin", PD, disk_bytes=-1)
    with pytest.raises(ValueError, match="disk_read_bytes_per_s"):
        dataclasses.replace(P, disk_read_bytes_per_s=0)


def test_goodput_counts_the_requests_within_both_objectives() -> None:
    # TTFTs 0.12 and 0.04 s (the first test's case); request a decodes 2 more tokens (TPOT 0.1 s)
    res = run([(0, [1, 2, 3], 3), (1, [1, 2, 4], 1)])
    assert ttft(res) == [0.12, 0.04]
    assert res.requests[0].tpot_s == pytest.approx(0.1)
    end = res.end_s
    assert summarize(res, False, 1.0, 1.0)["slo_met"] == 2
    s = summarize(res, False, 0.1, 1.0)  # a's TTFT misses
    assert s["slo_met"] == 1 and s["goodput_rps"] == pytest.approx(1 / end)
    assert summarize(res, False, 1.0, 0.05)["slo_met"] == 1  # a's TPOT misses; b has no TPOT
