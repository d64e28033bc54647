"""The pool's disk tier with real processes: etcd, a metaserver, engine nodes running
`kvpool serve --kv-connector mooncake` with the real model, and a node with the connector
off as the reference. Every output compared here is greedy and token for token.

Nodes: A (a DRAM pool of 48 slots over a disk tier, and a KV cache of 45 blocks, so its
blocks leave both for the disk), B (a DRAM pool only), C (connector off).
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.layout import slot_bytes_for
from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from tests.conftest import out_ids, running, tokens, wait_for

pytestmark = pytest.mark.slow

BS = 16
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2-135M fp32: layers * (K, V) * tokens * kv heads * head dim * 4
PROMPT_BLOCKS = 32
ARGS = ("--max-num-batched-tokens", "512", "--threads", "1")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    run = tmp_path_factory.mktemp("disk-tier")
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        procs = {
            "A": EngineProcess(run / "A.log", "node-a", ms.address, pool_size=str(48 * slot_bytes_for(BLOCK_BYTES)),
                               extra_args=(*ARGS, "--kv-cache-bytes", "32MiB", "--pool-disk", str(run / "disk-a"),
                                           "--pool-disk-size", "160MiB")),
            "B": EngineProcess(run / "B.log", "node-b", ms.address, pool_size="256MiB",
                               extra_args=(*ARGS, "--kv-cache-bytes", "256MiB")),
            "C": EngineProcess(run / "C.log", "node-c", extra_args=(*ARGS, "--kv-cache-bytes", "256MiB")),
        }
        with running(procs, 300):
            yield procs


def test_blocks_evicted_to_disk_are_hit_locally_and_from_another_node(nodes: dict[str, EngineProcess]) -> None:
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    n = PROMPT_BLOCKS * BS
    local, remote = tokens(1, n), tokens(2, n)
    for seed_prompt in (local, remote, tokens(3, n), tokens(4, n), tokens(5, n)):  # the last three push
        a.complete(seed_prompt, 2)                                                    # the first two to disk
        # every block saved before the next request may reuse its cache block (A's cache is small)
        wait_for(lambda: a.stats()["connector_saves_pending"] == 0, timeout_s=30, interval_s=0.05)
    assert a.stats()["connector_saves_dropped_reused"] == 0
    wait_for(lambda: a.stats().get("pool_disk_writes", 0) >= 2 * PROMPT_BLOCKS and not a.stats()["pool_publishing"],
             timeout_s=60, interval_s=0.1)
    assert a.stats()["pool_disk_enabled"] == 1

    # A's own disk: its KV cache and DRAM pool no longer hold the prompt.
    before = a.stats()
    suffix = tokens(6, 20)
    got = a.complete(local + suffix, 16)
    after = a.stats()
    details = got["usage"]["prompt_tokens_details"]
    assert details["local_cached_tokens"] == 0 and details["remote_cached_tokens"] == n, details
    assert after["pool_disk_hits"] - before["pool_disk_hits"] == PROMPT_BLOCKS
    assert out_ids(got) == out_ids(c.complete(local + suffix, 16))

    # Another node's disk: A stages the blocks into its DRAM, B reads them from there.
    before_a, before_b = a.stats(), b.stats()
    got = b.complete(remote + suffix, 16)
    after_a, after_b = a.stats(), b.stats()
    details = got["usage"]["prompt_tokens_details"]
    assert details["remote_cached_tokens"] == n, details
    assert after_a["pool_disk_staged"] - before_a["pool_disk_staged"] == PROMPT_BLOCKS
    assert after_b["pool_remote_hit_blocks"] - before_b["pool_remote_hit_blocks"] == PROMPT_BLOCKS
    # B asked A to stage them when its lookup offered them (prefetch on lookup), before its load.
    assert after_b["connector_prefetch_blocks"] - before_b["connector_prefetch_blocks"] == PROMPT_BLOCKS
    assert after_b["connector_prefetch_dropped"] == 0
    assert out_ids(got) == out_ids(c.complete(remote + suffix, 16))


def test_a_restarted_node_serves_hits_from_its_disk(nodes: dict[str, EngineProcess]) -> None:
    """A clean restart (SIGTERM, then the same node id and directory): the node's blocks, in
    DRAM or on disk before, are found on disk and re-published; it hits them itself, and
    another node has them staged."""
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    n = PROMPT_BLOCKS * BS
    own, theirs = tokens(7, n), tokens(8, n)
    for seed_prompt in (own, theirs):
        a.complete(seed_prompt, 2)
        wait_for(lambda: a.stats()["connector_saves_pending"] == 0, timeout_s=30, interval_s=0.05)
    wait_for(lambda: not a.stats()["pool_publishing"], timeout_s=30, interval_s=0.05)
    a.stop()
    a.start()
    a.wait_ready(timeout_s=300)
    assert a.stats()["pool_disk_blocks"] >= 2 * PROMPT_BLOCKS

    suffix = tokens(9, 20)
    got = a.complete(own + suffix, 16)
    details = got["usage"]["prompt_tokens_details"]
    assert details["local_cached_tokens"] == 0 and details["remote_cached_tokens"] == n, details
    assert a.stats()["pool_disk_hits"] == PROMPT_BLOCKS
    assert out_ids(got) == out_ids(c.complete(own + suffix, 16))

    got = b.complete(theirs + suffix, 16)
    assert got["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == n
    assert a.stats()["pool_disk_staged"] == PROMPT_BLOCKS
    assert out_ids(got) == out_ids(c.complete(theirs + suffix, 16))
