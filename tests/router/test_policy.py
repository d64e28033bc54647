"""Routing policies on their own: scores, ties, the route table (no network; the index view is
a stand-in object answering `prefix_by_node`, `present` and `disk`, which tests/metaserver covers for
real)."""
from __future__ import annotations

import pytest

from router.backends import Backend
from router.chain import Chain
from router.policy import LeastLoaded, Prefix, RoundRobin, RouteTable, make_policy

BS = 16


def chain(n_blocks: int, base: int = 0, extra_tokens: int = 5) -> Chain:
    return Chain(tuple(i.to_bytes(32, "big") for i in range(base, base + n_blocks)), n_blocks * BS + extra_tokens)


class View:
    """Answers as IndexView.prefix_by_node and present would for a fixed index: the pool
    holds chain blocks 0..pool-1 and `also` (past a gap)."""

    def __init__(self, pool: int, by_node: dict[str, int], also: tuple[int, ...] = (),
                 disk_only: tuple[int, ...] = (), on_disk: dict[str, set[int]] | None = None) -> None:
        self.answer = (pool, by_node)
        self.also = also
        self.disk_only = disk_only      # blocks held on disks only (IndexView.disk)
        self.on_disk = on_disk or {}    # per node, the blocks its own copy of is on its disk

    def disk(self, hashes):  # noqa: ANN001, ANN201
        return [i in self.disk_only for i in range(len(hashes))], self.on_disk

    def prefix_by_node(self, hashes):  # noqa: ANN001, ANN201
        return (min(self.answer[0], len(hashes)), {k: min(v, len(hashes)) for k, v in self.answer[1].items()})

    def present(self, hashes):  # noqa: ANN001, ANN201
        return [i < self.answer[0] or i in self.also for i in range(len(hashes))]


def nodes(*loads: int) -> list[Backend]:
    return [Backend(f"http://n{i}", node_id=f"n{i}", in_flight=load) for i, load in enumerate(loads)]


def test_round_robin_and_least_loaded() -> None:
    ns = nodes(0, 0, 0)
    rr = RoundRobin()
    assert [rr.choose(ns, None).node.url for _ in range(4)] == ["http://n0", "http://n1", "http://n2", "http://n0"]
    ns = nodes(3, 1, 1)
    ll = LeastLoaded()
    assert {ll.choose(ns, None).node.url for _ in range(4)} == {"http://n1", "http://n2"}
    ns[1].external = 5  # requests that did not come through this router count too
    assert ll.choose(ns, None).node.url == "http://n2"


def test_prefix_goes_to_the_holder_when_queues_are_close() -> None:
    ns = nodes(0, 0)
    ns[0].decoding = 1
    p = Prefix(BS, View(pool=10, by_node={"n0": 10}), load_weight=16, pull_value=0.5)
    c = p.choose(ns, chain(12))  # 197 prompt tokens
    # n0: computes 197 - 160 = 37, queue 16 -> 53; n1: computes 197 - 80 = 117 -> n0
    assert c.node.url == "http://n0" and c.predicted_hit_tokens == 160 and c.compute_tokens == 37


def test_prefix_weighs_compute_against_the_queue() -> None:
    ns = nodes(0, 0)
    p = Prefix(BS, View(pool=10, by_node={"n0": 10}), load_weight=16, pull_value=0.5)
    ns[0].prefilling = 100  # another request of this router waits for its first token there
    c = p.choose(ns, chain(12))  # n0: 37 + 100 = 137; n1: 117 -> n1, pulling the prefix
    assert c.node.url == "http://n1" and c.predicted_hit_tokens == 160 and c.compute_tokens == 117
    p.pull_value = 0.0  # pool off: the prefix is only where it was computed
    assert p.choose(ns, chain(12)).node.url == "http://n0"  # 137 < 197
    p.pull_value = 0.9
    ns[0].prefilling = 0
    ns[0].external = 3      # requests another router sent there: 48 tokens of queue
    assert p.choose(ns, chain(12)).node.url == "http://n1"  # 37 + 48 = 85 > 197 - 144 = 53


def test_prefix_without_a_hit_balances_and_records_routes() -> None:
    ns = nodes(0, 0)
    p = make_policy("prefix", BS, None, load_weight=16, pull_value=0.5)
    first = p.choose(ns, chain(8, base=100))
    assert first.predicted_hit_tokens == 0
    p.routed(first.node, chain(8, base=100))
    # The router's own record: the same conversation, longer, goes back to where it went.
    for _ in range(3):
        again = p.choose(ns, chain(12, base=100))
        assert again.node is first.node and again.predicted_hit_tokens == 8 * BS
    # Nothing in common: the tie is broken in turn, so both nodes get some.
    assert {p.choose(ns, chain(8, base=1000 + 10 * i)).node.url for i in range(4)} == {"http://n0", "http://n1"}


def test_prefix_never_counts_the_last_token_block() -> None:
    ns = nodes(0, 0)
    p = Prefix(BS, View(pool=4, by_node={"n1": 4}), load_weight=0, pull_value=0)
    exact = Chain(chain(4).hashes, 4 * BS)  # 64 tokens: the 4th block holds the last token
    assert p.choose(ns, exact).predicted_hit_tokens == 3 * BS


def test_route_table_is_an_lru_of_the_node_cache_size() -> None:
    t = RouteTable()
    n = Backend("http://n0", cache_blocks=4)
    hs = [i.to_bytes(32, "big") for i in range(6)]
    t.record(n, hs[:3])
    assert t.prefix(n, hs) == 3
    t.record(n, hs[3:6])  # 6 blocks into a 4-block cache: 0 and 1 are gone
    assert t.prefix(n, hs) == 0 and t.prefix(n, hs[2:]) == 4
    assert t.prefix(Backend("http://other"), hs) == 0


def test_bad_policy_settings() -> None:
    with pytest.raises(ValueError, match="--policy must be one of round-robin, least-loaded, prefix"):
        make_policy("random")
    with pytest.raises(ValueError, match="pull_value"):
        Prefix(BS, pull_value=1.5)


def test_prefix_counts_the_run_the_pool_holds_after_a_nodes_own_blocks_past_a_gap() -> None:
    """Block 0 is in no pool (a hot first block, a local hit everywhere), blocks 1-9 are: the
    node whose own cache holds block 0 (the route table says so) pulls 1-9, as the
    connector loads; another node pulls nothing (the run from its block 0 is empty)."""
    ns = nodes(0, 0)
    p = Prefix(BS, View(pool=0, by_node={}, also=tuple(range(1, 10))), load_weight=16, pull_value=0.5)
    p.routed(ns[1], chain(1))                      # n1's cache holds block 0
    c = p.choose(ns, chain(12))                    # n1: 197 - (1 + 0.5 * 9) * 16 = 109; n0: 197
    assert c.node.url == "http://n1" and c.predicted_hit_tokens == 160 and c.compute_tokens == 109


def test_a_dram_holder_beats_a_disk_holder_and_disk_beats_recompute() -> None:
    """n0 holds blocks 0-9 in DRAM, n1 the same blocks on its disk tier: both hit all ten,
    but n1 reads them from disk first (disk_cost a block), so n0 wins every time (without
    the disk price it is a tie, broken in turn). Still far cheaper than a recompute."""
    ns = nodes(0, 0)
    p = Prefix(BS, View(pool=10, by_node={"n0": 10, "n1": 10}, on_disk={"n1": set(range(10))}), load_weight=16,
               pull_value=0.9)
    assert {p.choose(ns, chain(12)).node.url for _ in range(4)} == {"http://n0"}
    alone = p.choose([ns[1]], chain(12))          # 197 - 160 + 0.65 * 10 = 43.5
    assert alone.predicted_hit_tokens == 160 and alone.compute_tokens == round(37 + 10 * p.disk_cost) < 197
    # n1 computed the chain itself lately (the route table): its KV cache holds it, no disk read.
    p.routed(ns[1], chain(10))
    assert p.choose([ns[1]], chain(12)).compute_tokens == 37


def test_a_run_held_on_disks_only_costs_a_pull_and_a_disk_read() -> None:
    """Blocks 0-9 are in the pool only as n1's disk copies (staged for a pull): n0 pulls
    them at a pull's price plus a disk read each; a DRAM run is cheaper; recompute dearer."""
    ns = nodes(0)
    on_disks = Prefix(BS, View(pool=10, by_node={}, disk_only=tuple(range(10))), load_weight=16, pull_value=0.9)
    in_dram = Prefix(BS, View(pool=10, by_node={}), load_weight=16, pull_value=0.9)
    d, m = on_disks.choose(ns, chain(12)), in_dram.choose(ns, chain(12))
    assert m.compute_tokens < d.compute_tokens < 197
    assert d.compute_tokens == round(197 - 0.9 * 160 + 10 * on_disks.disk_cost)
    off = Prefix(BS, View(pool=10, by_node={}, disk_only=tuple(range(10))), load_weight=16, pull_value=0.9,
                 disk_cost=0)
    assert off.choose(ns, chain(12)).compute_tokens == m.compute_tokens
    with pytest.raises(ValueError, match="disk_cost"):
        Prefix(BS, disk_cost=-1)
