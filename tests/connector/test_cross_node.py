"""Cross-node prefix hits with real processes: etcd, a metaserver, engine nodes running
`kvpool serve --kv-connector mooncake` with the real model, and a node with the connector
off as the reference. Every output compared here is greedy and token for token.

Nodes: A and B (the pair), A2 (a pool of exactly 65 slots, killed at the end) and B2 (role
kv_consumer, given as --kv-transfer-config JSON; waits `debug_load_delay_s` between its
query and its read, so a test can overwrite or kill the source in between), C (connector
off: what B computes on its own).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpool.layout import slot_bytes_for
from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from tests.conftest import out_ids, running, tokens, wait_for

pytestmark = pytest.mark.slow

BS = 16
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2-135M fp32: layers * (K, V) * tokens * kv heads * head dim * 4
ENGINE_ARGS = ("--kv-cache-bytes", "256MiB", "--max-num-batched-tokens", "512", "--threads", "1")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    run = tmp_path_factory.mktemp("cross-node")
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        procs = {
            "A": EngineProcess(run / "A.log", "node-a", ms.address, pool_size="256MiB", extra_args=ENGINE_ARGS),
            "B": EngineProcess(run / "B.log", "node-b", ms.address, pool_size="256MiB", extra_args=ENGINE_ARGS),
            "A2": EngineProcess(run / "A2.log", "node-a2", ms.address, pool_size=str(65 * slot_bytes_for(BLOCK_BYTES)),
                                extra_args=ENGINE_ARGS),
            "B2": EngineProcess(run / "B2.log", "node-b2", ms.address, pool_size="256MiB", extra_args=ENGINE_ARGS,
                                kv_transfer_config={"kv_connector": "mooncake", "kv_role": "kv_consumer",
                                                    "kv_connector_extra_config": {"debug_load_delay_s": 3}}),
            "C": EngineProcess(run / "C.log", "node-c", extra_args=ENGINE_ARGS),
        }
        with running(procs, 300):
            yield procs


def wait_published(node: EngineProcess, at_least: int) -> None:
    wait_for(lambda: node.stats().get("pool_published", 0) >= at_least, timeout_s=20, interval_s=0.05)


def test_b_pulls_a_prefix_from_a_and_matches_local_compute(nodes: dict[str, EngineProcess]) -> None:
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    prompt, suffix = tokens(1, 1040), tokens(2, 60)
    copies = b.stats()["lookup_view_copies"]
    a.complete(prompt, 8)
    wait_published(a, 1040 // BS)
    # B looks up in its index view, fed by a stream: wait until the view holds A's blocks too
    # (published means the metaserver has them; the view may be a message behind).
    wait_for(lambda: b.stats()["lookup_view_copies"] >= copies + 1040 // BS, timeout_s=20, interval_s=0.05)
    before = b.stats()
    got = b.complete(prompt + suffix, 24)
    after = b.stats()
    want = c.complete(prompt + suffix, 24)
    details = got["usage"]["prompt_tokens_details"]
    assert details["remote_cached_tokens"] == 1040 and details["local_cached_tokens"] == 0
    assert after["remote_hit_tokens"] - before["remote_hit_tokens"] == 1040
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    assert 0 < prefilled < len(suffix) + BS
    assert after["pool_remote_hit_blocks"] - before["pool_remote_hit_blocks"] == 1040 // BS
    assert out_ids(got) == out_ids(want)


def test_a_follow_up_pulls_the_decoded_answer_and_matches_local_compute(nodes: dict[str, EngineProcess]) -> None:
    """Multi-turn through the pool: A answers a prompt (the answer's blocks computed by decode
    steps, saved as they fill); B's follow-up (the prompt, A's answer, a new question) pulls
    them from A, and its logprobs equal C's, which prefills the whole follow-up itself, to the
    bit (the decode kernel computes a row as the prefill kernel does)."""
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    prompt = tokens(7, 100)
    published, copies = a.stats().get("pool_published", 0), b.stats()["lookup_view_copies"]
    answer = out_ids(a.complete(prompt, 60, ignore_eos=True))
    full = (len(prompt) + len(answer) - 1) // BS  # the answer's last token has no K/V yet
    wait_published(a, published + full)
    wait_for(lambda: b.stats()["lookup_view_copies"] >= copies + full, timeout_s=20, interval_s=0.05)
    follow_up = prompt + answer + tokens(8, 20)
    got = b.complete(follow_up, 8, logprobs=1)
    want = c.complete(follow_up, 8, logprobs=1)
    assert got["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == full * BS > len(prompt)
    assert out_ids(got) == out_ids(want)
    assert got["choices"][0]["logprobs"]["token_logprobs"] == want["choices"][0]["logprobs"]["token_logprobs"]


def test_cache_salt_isolates_tenants_locally_and_across_nodes(nodes: dict[str, EngineProcess]) -> None:
    """A tenant's blocks (vLLM's per-request `cache_salt`) are matched only by requests with
    the same salt: on the node that computed them and on every node that reads the pool."""
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    prompt = tokens(11, 320)
    published = a.stats().get("pool_published", 0)
    a.complete(prompt, 4, cache_salt="tenant-a")
    wait_published(a, published + 320 // BS)

    def details(node: EngineProcess, suffix_seed: int, **salt: str) -> tuple[dict, dict]:
        body = node.complete(prompt + tokens(suffix_seed, 20), 8, **salt)
        return body["usage"]["prompt_tokens_details"], body

    # each of these computes (and publishes) the prompt under its own salt, so every salt is tried once
    for node, seed, salt in ((b, 12, {"cache_salt": "tenant-b"}), (a, 13, {}), (b, 14, {"cache_salt": "tenant-c"})):
        d, _ = details(node, seed, **salt)
        assert d["local_cached_tokens"] == 0 and d["remote_cached_tokens"] == 0, (node.node_id, salt, d)
    d, got = details(b, 16, cache_salt="tenant-a")
    assert d["remote_cached_tokens"] == 320 and d["local_cached_tokens"] == 0
    assert out_ids(got) == out_ids(c.complete(prompt + tokens(16, 20), 8, cache_salt="tenant-a"))
    d, _ = details(a, 17, cache_salt="tenant-a")
    assert d["local_cached_tokens"] == 320


def _parked_then(b: EngineProcess, prompt: list[int], action) -> dict:  # noqa: ANN001
    """Send `prompt` to b; once it waits for its load, run `action`; return b's answer."""
    result: dict = {}
    before = b.stats()["num_requests_loading"]
    t = threading.Thread(target=lambda: result.update(b.complete(prompt, 16)))
    t.start()
    wait_for(lambda: b.stats()["num_requests_loading"] > before, timeout_s=30, interval_s=0.02)
    action()
    t.join(120)
    assert not t.is_alive()
    return result


def test_stale_index_entry_is_detected_and_recomputed(nodes: dict[str, EngineProcess]) -> None:
    a2, b2, c = nodes["A2"], nodes["B2"], nodes["C"]
    prompt = tokens(3, 1040) + tokens(4, 40)
    a2.complete(prompt[:1040], 4)  # fills A2's 65 slots exactly
    wait_published(a2, 65)
    failed0 = b2.stats()["failed_load_blocks"]
    # B2 queries (A2 holds the prefix), then A2 evicts its 16 LRU slots (the chain's first 16
    # blocks) and reuses two of them for new blocks before B2 reads: B2 must see the overwrite.
    # Evicted slots not yet reused still hold intact, valid blocks; from the first overwritten
    # one on, the chain is recomputed.
    got = _parked_then(b2, prompt, lambda: a2.complete(tokens(5, 40), 1))
    failed = b2.stats()["failed_load_blocks"] - failed0
    assert a2.stats()["pool_evictions"] >= 16
    assert 1040 // BS - 16 < failed < 1040 // BS
    assert got["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == 1040 - failed * BS
    assert out_ids(got) == out_ids(c.complete(prompt, 16))


def test_source_killed_while_b_loads(nodes: dict[str, EngineProcess]) -> None:
    a2, b2, c = nodes["A2"], nodes["B2"], nodes["C"]
    prompt = tokens(6, 960) + tokens(7, 50)
    published0 = a2.stats()["pool_published"]
    a2.complete(prompt[:960], 4)  # 60 blocks: fits without evicting its own
    wait_published(a2, published0 + 60)
    failed0 = b2.stats()["failed_load_blocks"]
    got = _parked_then(b2, prompt, a2.kill)
    assert not a2.alive()
    assert b2.stats()["failed_load_blocks"] - failed0 == 60
    assert b2.stats()["pool_puts"] == 0  # a consumer loads but never saves
    assert out_ids(got) == out_ids(c.complete(prompt, 16))


def test_concurrent_overlapping_requests_on_both_nodes(nodes: dict[str, EngineProcess]) -> None:
    a, b, c = nodes["A"], nodes["B"], nodes["C"]
    prefixes = [tokens(10 + i, 320) for i in range(2)]
    waves = [[(a if k == 0 else b, prefixes[k] + tokens(100 + 10 * k + j, 40)) for k in range(2) for j in range(3)],
             [(b if k == 0 else a, prefixes[k] + tokens(200 + 10 * k + j, 40)) for k in range(2) for j in range(3)]]
    remote0 = a.stats()["remote_hit_tokens"] + b.stats()["remote_hit_tokens"]
    got: list[dict] = []
    with ThreadPoolExecutor(6) as ex:
        for i, wave in enumerate(waves):
            got += list(ex.map(lambda job: job[0].complete(job[1], 12), wave))
            if i == 0:  # what wave 1 computed is published before wave 2 swaps the nodes
                for node in (a, b):
                    wait_published(node, node.stats()["pool_puts"])
                prefill1 = a.stats()["prefill_tokens"] + b.stats()["prefill_tokens"]
        want = list(ex.map(lambda job: c.complete(job[1], 12), [job for wave in waves for job in wave]))
    assert len(got) == 12 and all(g["choices"][0]["finish_reason"] == "length" for g in got)
    assert [out_ids(g) for g in got] == [out_ids(w) for w in want]
    remote = a.stats()["remote_hit_tokens"] + b.stats()["remote_hit_tokens"] - remote0
    # Wave 2 pulls the other node's prefixes: each node at least once (a request that comes
    # after a pull finished hits the pulled blocks in its own cache), and no wave-2 request
    # recomputes its prefix: each computes its 40 new tokens and at most one block more.
    assert remote >= 2 * (320 - BS)
    computed2 = a.stats()["prefill_tokens"] + b.stats()["prefill_tokens"] - prefill1
    assert computed2 <= 6 * (40 + BS), computed2
