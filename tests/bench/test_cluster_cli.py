"""`kvpool cluster up / status / restart / down` as a user runs them, across separate invocations."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.request
import sys
from pathlib import Path

import pytest

from kvpool_harness.engine_node import http_json

pytestmark = pytest.mark.slow


def kvpool(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cluster_up_status_down(tmp_path: Path) -> None:
    run = tmp_path / "cluster"
    up = kvpool("cluster", "up", "--nodes", "2", "--run-dir", str(run), "--pool-size", "128MiB",
                "--engine-arg=--kv-cache-bytes=128MiB", "--router")
    state = run / "cluster.json"
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        info = json.loads(state.read_text())
        names = [p["name"] for p in info["processes"]]
        assert names == ["etcd", "metaserver", "node-0", "node-1", "router"]
        router = info["processes"][4]["address"]
        health = http_json(router + "/health", timeout_s=5)
        assert health[0] == 200 and health[1]["nodes_up"] == 2
        status, body = http_json(router + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"]
        for p in info["processes"][2:4]:
            assert http_json(p["address"] + "/health", timeout_s=5)[0] == 200
            assert http_json(p["address"] + "/stats", timeout_s=5)[1]["pool_puts"] == 0  # connector on
        again = kvpool("cluster", "up", "--run-dir", str(run))
        assert again.returncode == 1 and "already runs" in again.stderr
        st = kvpool("cluster", "status", "--run-dir", str(run))
        assert st.returncode == 0 and st.stdout.count("running") == 5 and st.stdout.count(" ready") == 3
        # the cross-node benchmark against these running nodes (as against a Helm release)
        urls = ",".join(p["address"] for p in info["processes"][2:4])
        out = tmp_path / "bench.json"
        bench = kvpool("bench", "cross-node", "--urls", urls, "--users", "3", "--rounds", "2", "--groups", "1",
                       "--system-tokens", "64", "--user-tokens", "16", "--reply-tokens", "16", "--output-tokens", "2",
                       "--no-progress", "--run-dir", str(tmp_path / "bench"), "--out", str(out))
        assert bench.returncode == 0, bench.stderr[-3000:]
        report = json.loads(out.read_text())
        assert list(report["configs"]) == ["pool-on"]
        on = report["configs"]["pool-on"]
        assert on["errors"] == 0 and on["requests"] == 6 and on["remote_hit_tokens"] > 0 and on["bytes_transferred"] > 0
        # one node restarted: same address, a new PID, ready again (and stopped by `down` below)
        r = kvpool("cluster", "restart", "node-1", "--run-dir", str(run))
        assert r.returncode == 0 and "restarted node-1" in r.stdout, r.stderr[-3000:]
        old, info = info, json.loads(state.read_text())
        assert info["processes"][3]["pid"] != old["processes"][3]["pid"]
        assert info["processes"][3]["address"] == old["processes"][3]["address"]
        assert http_json(info["processes"][3]["address"] + "/health", timeout_s=5)[0] == 200
        assert kvpool("cluster", "status", "--run-dir", str(run)).stdout.count("running") == 5
    finally:
        down = kvpool("cluster", "down", "--run-dir", str(run), timeout=120)
    assert down.returncode == 0 and down.stdout.count("stopped") == 5
    assert not state.exists()
    for p in info["processes"]:
        assert not Path(f"/proc/{p['pid']}").exists() or b"kvpool" not in Path(f"/proc/{p['pid']}/cmdline").read_bytes()
    missing = kvpool("cluster", "status", "--run-dir", str(run))
    assert missing.returncode == 1 and missing.stderr.startswith("kvpool cluster: error: no cluster")
    assert os.path.exists(run / "node-0.log")


def test_cluster_up_pd(tmp_path: Path) -> None:
    """`--pd 1:1`: a producer and a consumer behind `kvpool router --pd`; a prompt sent to the
    router is prefilled on the one and decoded on the other, with the prompt's KV loaded."""
    run = tmp_path / "pd"
    bad = kvpool("cluster", "up", "--pd", "0:1", "--run-dir", str(run))
    assert bad.returncode == 1 and "--pd takes P:D" in bad.stderr and not (run / "cluster.json").exists()
    up = kvpool("cluster", "up", "--pd", "1:1", "--run-dir", str(run), "--pool-size", "128MiB",
                "--engine-arg=--kv-cache-bytes=128MiB")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        info = json.loads((run / "cluster.json").read_text())
        assert [p["name"] for p in info["processes"]] == ["etcd", "metaserver", "prefill-0", "decode-0", "router"]
        prefill, decode, router = (p["address"] for p in info["processes"][2:])
        assert http_json(router + "/health", timeout_s=5)[1]["prefill_nodes_up"] == 1
        status, body = http_json(router + "/v1/completions", {"prompt": "The rivers of Europe are many. " * 8,
                                                              "max_tokens": 4, "temperature": 0})
        n = body["usage"]["prompt_tokens"]
        assert status == 200 and body["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == n - 1 > 0  # all but the last
        assert http_json(prefill + "/stats", timeout_s=5)[1]["connector_handoff_sends"] == 1
        assert http_json(decode + "/stats", timeout_s=5)[1]["connector_handoff_loads"] == 1
    finally:
        down = kvpool("cluster", "down", "--run-dir", str(run), timeout=120)
    assert down.returncode == 0 and down.stdout.count("stopped") == 5


@pytest.mark.timeout(900)
def test_cluster_up_vllm_pd(tmp_path: Path) -> None:
    """`--engine vllm --pd 1:1`: two vLLM servers with the plug-in behind `kvpool router --pd`
    (least-loaded: vLLM servers do not say their layout); a prompt through the router is
    handed from one to the other on vLLM's own protocol. The prefix policy is refused."""
    run = tmp_path / "vllm-pd"
    bad = kvpool("cluster", "up", "--engine", "vllm", "--pd", "1:1", "--router", "prefix", "--run-dir", str(run))
    assert bad.returncode == 1 and "least-loaded" in bad.stderr and not (run / "cluster.json").exists()
    up = kvpool("cluster", "up", "--engine", "vllm", "--pd", "1:1", "--run-dir", str(run), timeout=600)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "P/D, prefill policy least-loaded" in up.stdout
        info = json.loads((run / "cluster.json").read_text())
        prefill, decode, router = (p["address"] for p in info["processes"][2:])
        prompt = list(range(1000, 1000 + 3 * 128 + 5))
        status, body = http_json(router + "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0})
        assert status == 200, body
        metric = "kvpool:connector_loaded_blocks_total"
        with urllib.request.urlopen(decode + "/metrics", timeout=10) as resp:
            loaded = sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                         if line.startswith(metric))
        assert loaded == 4  # 3 full blocks and the partial last one (the tail)
    finally:
        down = kvpool("cluster", "down", "--run-dir", str(run), timeout=120)
    assert down.returncode == 0


def test_cluster_nodes_get_a_disk_tier_each(tmp_path: Path) -> None:
    """`kvpool cluster up --pool-disk-size`: each node serves with its own directory under
    the run dir (kept across restarts); none without the size or without the pool."""
    from kvpool_harness.cluster import ClusterSpec, LocalCluster

    node = LocalCluster(tmp_path, ClusterSpec(pool_disk_size="1GiB"))._node(1, "127.0.0.1:1")
    cmd = node.command()
    assert cmd[cmd.index("--pool-disk") + 1] == str(tmp_path / "node-1-disk")
    assert cmd[cmd.index("--pool-disk-size") + 1] == "1GiB"
    assert "--pool-disk" not in LocalCluster(tmp_path, ClusterSpec())._node(0, "127.0.0.1:1").command()
    assert "--pool-disk" not in LocalCluster(tmp_path, ClusterSpec(pool_disk_size="1GiB", connector=False)) \
        ._node(0, "").command()
