"""Prefill/decode disaggregation end to end: etcd, a metaserver, a producer node (`--kv-role
producer`), a consumer node (`--kv-role consumer`), `kvpool router --pd` in front of them,
and a reference node with no connector at all. Every output through P/D is compared token
for token (greedy) with the reference's; the consumer's counters show what it loaded and
what it computed. The last test kills the producer between its hand-off and the consumer's
read (the consumer waits `debug_load_delay_s` before reading, to make that window)."""
from __future__ import annotations

import json
import signal
import threading
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool_harness.engine_node import EngineProcess, http_json
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.router_node import RouterProcess
from tests.conftest import wait_for

pytestmark = pytest.mark.slow
ENGINE_ARGS = ("--kv-cache-bytes", "256MiB", "--threads", "1")
BS = 16


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    run = tmp_path_factory.mktemp("pd")
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        producer = EngineProcess(run / "prefill.log", "prefill-0", ms.address, pool_size="512MiB",
                                 extra_args=(*ENGINE_ARGS, "--kv-role", "producer"))
        consumer = EngineProcess(run / "decode.log", "decode-0", ms.address, pool_size="256MiB",
                                 extra_args=(*ENGINE_ARGS, "--kv-role", "consumer"),
                                 kv_transfer_config={"kv_connector": "mooncake",
                                                     "kv_connector_extra_config": {"debug_load_delay_s": 2.0}})
        reference = EngineProcess(run / "reference.log", "reference", extra_args=ENGINE_ARGS)
        nodes = [producer, consumer, reference]
        router = None
        try:
            for n in nodes:
                n.start()
            for n in nodes:
                n.wait_ready(300)
            router = RouterProcess(run / "router.log", [], "prefix", ms.address, prefill=[producer.url],
                                   decode=[consumer.url]).start()
            yield {"producer": producer, "consumer": consumer, "reference": reference, "router": router}
        finally:
            if router is not None:
                router.stop()
            for n in nodes:
                n.stop()


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids no other prompt here shares a block with."""
    return np.random.default_rng(seed).integers(200, 40000, n).tolist()


def complete(url: str, ids: list[int], max_tokens: int = 12) -> dict:
    status, body = http_json(f"{url}/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                                       "return_token_ids": True})
    assert status == 200, body
    return body


def router_counter(router: RouterProcess, name: str) -> float:
    text = urllib.request.urlopen(f"{router.url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"kvpool_router:{name} "))


@pytest.mark.parametrize("n", [16, 17, 33, 100, 255, 1000, 2000])
def test_pd_output_equals_a_colocated_nodes_and_the_decode_node_loads_the_prompt(pd: dict, n: int) -> None:
    """Through P/D the tokens equal the reference's; the consumer loaded the KV of every
    prompt token but the last (the full blocks, then the producer's tail: the last block's
    tokens before that one) and computed only the last token (its logits start the output)."""
    ids = prompt(n, seed=n)
    before = pd["consumer"].stats()
    via_pd = complete(pd["router"].url, ids)
    after = pd["consumer"].stats()
    assert via_pd["choices"][0]["token_ids"] == complete(pd["reference"].url, ids)["choices"][0]["token_ids"]
    loaded = after["remote_hit_tokens"] - before["remote_hit_tokens"]
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    assert loaded == n - 1 and computed == 1
    assert via_pd["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == loaded
    assert after["pool_puts"] == 0   # a consumer does not save what it computes


def test_pd_streams_chat_as_the_reference_answers(pd: dict) -> None:
    body = {"messages": [{"role": "system", "content": "You are terse. " * 30},
                         {"role": "user", "content": "Name three rivers in Europe."}],
            "max_tokens": 24, "temperature": 0}
    req = urllib.request.Request(f"{pd['router'].url}/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["x-kvpool-node"] == pd["consumer"].url
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: {")]
    streamed = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events if json.loads(e)["choices"])
    _, ref = http_json(f"{pd['reference'].url}/v1/chat/completions", body)
    assert len(events) > 3 and streamed == ref["choices"][0]["message"]["content"]


def test_a_producer_killed_before_the_read_means_a_recompute_with_the_same_output(pd: dict) -> None:
    """Runs last. The producer dies after handing the prompt over and before the consumer
    reads it: the reads fail, the consumer computes the prompt itself, the tokens are the
    reference's. A request after that finds no prefill node and is decoded from scratch."""
    router, consumer = pd["router"], pd["consumer"]
    ids = prompt(700, seed=99)
    handoffs = router_counter(router, "pd_handoffs_total")
    before = consumer.stats()
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(complete(router.url, ids)))
    sender.start()
    wait_for(lambda: router_counter(router, "pd_handoffs_total") > handoffs, timeout_s=120, interval_s=0.02)
    pd["producer"].proc.send_signal(signal.SIGKILL)   # within the consumer's 2 s before its read
    sender.join(300)
    after = consumer.stats()
    assert result["choices"][0]["token_ids"] == complete(pd["reference"].url, ids)["choices"][0]["token_ids"]
    assert after["failed_load_blocks"] > before["failed_load_blocks"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == 700    # every prompt token computed there
    fallbacks = router_counter(router, "pd_fallbacks_total")
    ids = prompt(40, seed=7)
    assert complete(router.url, ids)["choices"][0]["token_ids"] == \
        complete(pd["reference"].url, ids)["choices"][0]["token_ids"]
    assert router_counter(router, "pd_fallbacks_total") == fallbacks + 1
