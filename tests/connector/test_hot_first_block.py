"""A full pool keeps serving what it holds behind a hot first block (issue 38).

Nearly every conversation starts with the same block (a shared system prompt). Each engine
keeps it in its own KV cache, so it is a local hit every time: never computed, saved or read
again, and the pools' LRU drops it. The blocks behind it are still in a pool, and a request
whose own cache stops after block 0 must still pull them: a lookup answers the run the index
holds from where the engine's cache stops, whatever it holds before.

Real processes: etcd, a metaserver, engine nodes A and B running `kvpool serve
--kv-connector mooncake` with the real model, pools of POOL_SLOTS slots and KV caches that
keep every block of the test (block 0 stays hot), and C (connector off), the reference every
output is compared with, token for token (greedy).
"""
from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from engine.block_pool import chain_seed, hash_blocks
from kvpool.layout import slot_bytes_for
from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from metaserver.client import MetaClient
from tests.conftest import wait_for

pytestmark = pytest.mark.slow

BS = 16
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2-135M fp32: layers * (K, V) * tokens * kv heads * head dim * 4
POOL_SLOTS = 32                          # a pool evicts 16 LRU slots at a time (kvpool's evict_batch)
USER_BLOCKS = 8                          # each conversation: block 0 (the system prompt), then 8 blocks of its own
CONVERSATIONS = 5                        # per node: 1 + 5 * 8 saves > 32 slots, so block 0 is evicted
ENGINE_ARGS = ("--kv-cache-bytes", "256MiB", "--max-num-batched-tokens", "512", "--threads", "1")
SYSTEM = 1                               # the seed of the system prompt's tokens


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def conversation(seed: int) -> list[int]:
    """The shared system prompt (block 0), then USER_BLOCKS full blocks of one user's own."""
    return tokens(SYSTEM, BS) + tokens(seed, USER_BLOCKS * BS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, EngineProcess], str]]:
    run = tmp_path_factory.mktemp("hot-first-block")
    pool = str(POOL_SLOTS * slot_bytes_for(BLOCK_BYTES))
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        procs = {"A": EngineProcess(run / "A.log", "node-a", ms.address, pool_size=pool, extra_args=ENGINE_ARGS),
                 "B": EngineProcess(run / "B.log", "node-b", ms.address, pool_size=pool, extra_args=ENGINE_ARGS),
                 "C": EngineProcess(run / "C.log", "node-c", extra_args=ENGINE_ARGS)}
        try:
            for p in procs.values():
                p.start()
            for p in procs.values():
                p.wait_ready(timeout_s=300)
            yield procs, ms.address
        finally:
            for p in procs.values():
                p.stop()


def out_ids(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def test_a_hot_first_block_stays_and_the_blocks_behind_a_lost_one_are_still_pulled(
        cluster: tuple[dict[str, EngineProcess], str]) -> None:
    nodes, metaserver = cluster
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    # Both nodes serve conversations that share block 0 until their pools are full: block 0 is
    # a local hit on each (never saved or read again). Without recency the pools' LRU evicts it
    # first; with it, each local hit touches the pool's copy and it stays.
    for j in range(CONVERSATIONS):
        for node, seed in ((a, 100 + j), (b, 200 + j)):
            node.complete(conversation(seed), 2)

    with MetaClient(metaserver) as client:
        namespace = client.list_nodes()[0][0].namespace
        a_last, b_last = (hash_blocks(chain_seed(namespace, None), conversation(seed), BS)
                          for seed in (100 + CONVERSATIONS - 1, 200 + CONVERSATIONS - 1))

        def held_by(chain: list, holder: str) -> bool:
            """The index holds the conversation's own blocks (1 on), on `holder` alone."""
            r = client.query_prefix(namespace, chain[1:])
            return r.num_matched == USER_BLOCKS and set(r.nodes) == {holder}

        # Saves (copies, publishes, evictions) run off the engines' steps: wait until both
        # pools evicted and the index holds the last conversations' own blocks on the nodes
        # that computed them; block 0 is still held.
        wait_for(lambda: a.stats()["pool_evictions"] >= 16 and b.stats()["pool_evictions"] >= 16
                 and held_by(a_last, "node-a") and held_by(b_last, "node-b"), timeout_s=30, interval_s=0.05)
        (first,) = client.query_prefix(namespace, a_last[:1]).locations
        assert a.stats()["connector_touched_blocks"] >= CONVERSATIONS - 1

        # Now the index loses block 0 (as when its owner drops it): lookups that walked from
        # block 0 would find nothing behind it.
        client.unpublish(first.node_id, [first.block_hash])
        assert client.query_prefix(namespace, a_last[:1]).num_matched == 0

    # Each node asks for the other's last conversation, with a new turn: block 0 from its own
    # cache, the conversation's blocks from the other node's pool, the new turn computed.
    for node, other, seed in ((b, a, 100 + CONVERSATIONS - 1), (a, b, 200 + CONVERSATIONS - 1)):
        prompt = conversation(seed) + tokens(seed + 1000, 20)
        before = node.stats()
        got = node.complete(prompt, 12)
        after = node.stats()
        details = got["usage"]["prompt_tokens_details"]
        assert details["local_cached_tokens"] == BS, (node.node_id, details)
        assert details["remote_cached_tokens"] == USER_BLOCKS * BS, (node.node_id, details)
        assert after["remote_hit_tokens"] - before["remote_hit_tokens"] == USER_BLOCKS * BS
        assert after["pool_remote_hit_blocks"] - before["pool_remote_hit_blocks"] == USER_BLOCKS
        assert out_ids(got) == out_ids(c.complete(prompt, 12)), other.node_id

    # A request that uses block 0 as a local hit while the index holds it nowhere saves it
    # again from its node's cache (re-offered: the first node to see it missing); the index
    # holds it once more. (A node's view of the index follows the unpublish a moment later.)
    seeds = iter(range(300, 10_000))
    wait_for(lambda: a.stats()["connector_reoffered_blocks"] + b.stats()["connector_reoffered_blocks"] >= 1
             or not b.complete(conversation(next(seeds)), 1), timeout_s=60, interval_s=0.2)
    with MetaClient(metaserver) as client:
        wait_for(lambda: client.query_prefix(namespace, a_last[:1]).num_matched == 1, timeout_s=30, interval_s=0.05)
