"""vLLM prefill/decode disaggregation through the pool, on vLLM's own `kv_transfer_params`
protocol (issue 40): a proxy written as vLLM's disaggregated-serving examples are (send the
prefill leg with `do_remote_decode`, `max_tokens` 1, not streamed; copy the dict it answers
onto the decode leg, verbatim) between two `vllm serve` processes with the `KVPoolConnector`
plug-in.

Real processes: etcd, a metaserver, vLLM servers P (prefill) and D (decode) with the plug-in,
and C without any connector (the reference output). P saves with the `selective` policy, so
a prompt it computes once is never published for prefix sharing: what D loads, it loads
through the hand-off (P's send), not through a lookup of a shared prefix.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from connector import handoff
from kvpool_harness.engine_node import http_json
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.router_node import RouterProcess
from kvpool_harness.vllm_node import VllmProcess, export_model
from metaserver.client import MetaClient
from tests.conftest import running, tokens, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # three vLLM servers start in the first test

BS = 128                 # vLLM's default block size on CPU
HITS = "vllm:external_prefix_cache_hits_total"
LOADED = "kvpool:connector_loaded_blocks_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, vllm_alone: VllmProcess) -> Iterator[dict]:
    run = tmp_path_factory.mktemp("vllm-pd")
    model = export_model()
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        procs = {"P": VllmProcess(run / "P.log", model, "vllm-p", ms.address, cpus="0",
                                  extra_config={"save_policy": "selective"}),
                 # D waits for P's blocks to reach the index up to handoff_wait_s (5 s by default,
                 # then it computes the prompt itself): a bound a loaded machine must not decide.
                 "D": VllmProcess(run / "D.log", model, "vllm-d", ms.address, cpus="1",
                                  extra_config={"handoff_wait_s": 30}),
                 "C": vllm_alone}
        client = MetaClient(ms.address)
        try:
            with running(procs, 400, shared=("C",)):
                yield {**procs, "client": client}
        finally:
            client.close()


def completion(node: VllmProcess, body: dict) -> dict:
    status, answer = http_json(f"{node.url}/v1/completions", {"model": node.served_name, **body})
    assert status == 200, answer
    return answer


def proxy(prefill: VllmProcess, decode: VllmProcess, prompt: list[int], max_tokens: int) -> tuple[dict, dict]:
    """vLLM's toy proxy, in short: the prefill leg, then the decode leg with the dict copied."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    first = completion(prefill, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    return first, completion(decode, {**body, "kv_transfer_params": first.get("kv_transfer_params")})


@pytest.mark.parametrize("n", [16, 300, 1024, 2000])
def test_decode_loads_the_prefill_nodes_blocks_and_answers_like_vllm_alone(cluster: dict, n: int) -> None:
    """Prompts that are and are not multiples of the block size: the decode node loads the KV
    of every prompt token but the last (vLLM computes that one for its logits) from the
    prefill node's pool (its full blocks, then the partial last one, the tail), and answers
    token for token as vLLM alone."""
    p, d, c = cluster["P"], cluster["D"], cluster["C"]
    prompt = tokens(n, n)
    hits, loaded = d.metric(HITS), d.metric(LOADED)
    first, ours = proxy(p, d, prompt, 12)
    full, tail = n // BS, handoff.producer_tail(n, BS)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "vllm-p"
    assert params["kvpool_num_blocks"] == full and params.get("kvpool_tail_tokens", 0) == tail
    assert len(params["remote_block_ids"]) >= full + bool(tail)
    ref = completion(c, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    assert ours["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert d.metric(HITS) - hits == n - 1                           # vLLM's own counter: it computed one token
    assert d.metric(LOADED) - loaded == -(-(n - 1) // BS)           # blocks loaded (the worker's counter)


def test_the_prefill_nodes_blocks_are_freed_once_in_its_pool(cluster: dict) -> None:
    """P holds a finished prefill's blocks only until they are in its pool (the pool's copy
    is the hand-off): then vLLM frees them, and its KV cache usage falls back to 0 with no
    decode node ever reading them. A request that asks for no remote decode holds nothing."""
    p = cluster["P"]
    sent = p.metric("kvpool:connector_sent_blocks_total")
    first = completion(p, {"prompt": tokens(77, 5 * BS + 3), "max_tokens": 1, "temperature": 0, "stream": False,
                           "kv_transfer_params": {"do_remote_decode": True}})
    assert first["kv_transfer_params"]["kvpool_num_blocks"] == 5
    assert first["kv_transfer_params"]["kvpool_tail_tokens"] == 3
    plain = completion(p, {"prompt": tokens(78, 2 * BS + 9), "max_tokens": 1, "temperature": 0})
    assert not plain.get("kv_transfer_params")
    wait_for(lambda: p.metric("kvpool:connector_sent_blocks_total") >= sent + 6, timeout_s=30)  # and the tail
    wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0, timeout_s=30)


def test_through_kvpool_router_pd(cluster: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`kvpool router --pd` in front of the vLLM servers: the same protocol, the same answer."""
    p, d, c = cluster["P"], cluster["D"], cluster["C"]
    prompt = tokens(55, 4 * BS + 70)
    body = {"model": d.served_name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    loaded = d.metric(LOADED)
    with RouterProcess(tmp_path_factory.mktemp("router") / "router.log", [], policy="least-loaded",
                       prefill=[p.url], decode=[d.url]) as router:
        status, ours = http_json(f"{router.url}/v1/completions", body)
    assert status == 200, ours
    assert ours["choices"][0]["token_ids"] == completion(c, body)["choices"][0]["token_ids"]
    assert d.metric(LOADED) - loaded == 5   # 4 full blocks and the tail


def test_prefill_node_killed_before_the_decode_read_recomputes_identically(cluster: dict) -> None:
    """P answers, then dies (SIGKILL) before D reads: D's read of P's slots fails, D computes
    the prompt itself, answers like vLLM alone and reports the failed blocks; no request is
    left in WAITING_FOR_REMOTE_KVS. (Last in this module: P stays dead.)"""
    p, d, c = cluster["P"], cluster["D"], cluster["C"]
    prompt = tokens(99, 6 * BS + 40)
    held = lambda: sum(n for rec, n in cluster["client"].list_nodes() if rec.node_id == "vllm-p")  # noqa: E731
    before = held()
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    first = completion(p, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}})
    assert first["kv_transfer_params"]["kvpool_num_blocks"] == 6
    # P's send is in its pool and the index (else D finds nothing to read and computes anyway).
    wait_for(lambda: held() >= before + 7, timeout_s=30)  # 6 full blocks and the tail
    p.kill()
    failed = d.metric("kvpool:connector_failed_blocks_total")
    ours = completion(d, {**body, "kv_transfer_params": first["kv_transfer_params"]})
    assert ours["choices"][0]["token_ids"] == completion(c, body)["choices"][0]["token_ids"]
    wait_for(lambda: d.metric("kvpool:connector_failed_blocks_total") >= failed + 7, timeout_s=30)
