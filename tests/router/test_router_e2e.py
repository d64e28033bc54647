"""`kvpool router` in front of a real cluster: etcd, a metaserver, two engine nodes with the
pool on (the real model), the router as its own process with policy prefix and the index.
Every output here is greedy and compared token for token where it says so."""
from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.block_pool import chain_seed, hash_blocks
from kvpool_harness.engine_node import EngineProcess, http_json
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_harness.router_node import RouterProcess
from metaserver.client import MetaClient
from router.chain import PromptHasher
from tests.conftest import wait_for

pytestmark = pytest.mark.slow
ENGINE_ARGS = ("--kv-cache-bytes", "128MiB", "--threads", "1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    run = tmp_path_factory.mktemp("router")
    with EtcdProcess(run / "etcd") as etcd, MetaserverProcess(etcd.endpoint, run / "metaserver.log") as ms:
        nodes = [EngineProcess(run / f"n{i}.log", f"node-{i}", ms.address, pool_size="256MiB", extra_args=ENGINE_ARGS)
                 for i in range(2)]
        routers: list[RouterProcess] = []
        try:
            for n in nodes:
                n.start()
            for n in nodes:
                n.wait_ready(300)
            routers.append(RouterProcess(run / "router.log", [n.url for n in nodes], "prefix", ms.address).start())
            # No --nodes: it finds them in the metaserver's node registry (--discover).
            routers.append(RouterProcess(run / "discover.log", [], "prefix", ms.address,
                                         extra_args=("--discover-interval", "0.5")).start())
            yield {"nodes": nodes, "router": routers[0], "discovering": routers[1], "metaserver": ms}
        finally:
            for r in routers:
                r.stop()
            for n in nodes:
                n.stop()


def post(url: str, path: str, body: dict) -> tuple[int, dict, str]:
    """POST JSON; (status, body, the x-kvpool-node header)."""
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.loads(r.read()), r.headers.get("x-kvpool-node", "")


def words(seed: int, n: int) -> str:
    vocab = ["river", "stone", "maple", "copper", "lantern", "orbit", "velvet", "harbor", "quartz", "meadow"]
    return " ".join(vocab[(seed * 7 + i * (seed + 3)) % len(vocab)] for i in range(n))


def test_the_router_hashes_prompts_as_the_nodes_do(cluster: dict) -> None:
    """The router's chain for a completion and a chat body, with and without a cache salt, is
    the chain the node computed and published: the index holds every full prompt block under
    the router's hashes, on the node that served it."""
    a = cluster["nodes"][0]
    layout = http_json(f"{a.url}/kv_layout")[1]
    hasher = PromptHasher("smollm2-135m", served_name=layout["model"])
    assert hasher.expect(layout["dtype"], layout["block_size"], layout["fingerprint"]) == layout["fingerprint"]
    bodies = [({"prompt": words(1, 120), "max_tokens": 1}, False),
              ({"prompt": words(2, 120), "max_tokens": 1, "cache_salt": "tenant-7"}, False),
              ({"messages": [{"role": "system", "content": words(3, 60)},
                             {"role": "user", "content": words(4, 50)}], "max_tokens": 1}, True),
              ({"messages": [{"role": "user", "content": words(5, 90)}], "max_tokens": 1, "cache_salt": "t9"}, True)]
    with MetaClient(cluster["metaserver"].address) as client:
        for body, chat in bodies:
            got = http_json(f"{a.url}/v1/{'chat/completions' if chat else 'completions'}",
                            {**body, "return_token_ids": True})[1]
            prompt_ids = got["choices"][0]["prompt_token_ids"]
            chain = hasher.chain(json.dumps(body).encode(), chat)
            assert chain is not None and chain.num_tokens == len(prompt_ids)
            bs = layout["block_size"]
            assert list(chain.hashes) == hash_blocks(chain_seed(layout["fingerprint"], body.get("cache_salt")),
                                                     prompt_ids, bs)
            full = len(prompt_ids) // bs
            assert full >= 3
            wait_for(lambda: client.query_prefix(layout["fingerprint"], list(chain.hashes)).num_matched == full,
                     timeout_s=20, interval_s=0.05)
            res = client.query_prefix(layout["fingerprint"], list(chain.hashes))
            assert {loc.node_id for loc in res.locations} == {layout["node_id"]}


def test_a_conversation_follows_its_prefix(cluster: dict) -> None:
    """Three conversations, four rounds each, through the router: every round after the first
    lands on the node that served the conversation so far and hits its prefix there locally;
    both nodes serve; the outputs equal a node's own, token for token."""
    router, nodes = cluster["router"], cluster["nodes"]
    served: dict[int, list[str]] = {}
    history: dict[int, list[dict]] = {}
    for rnd in range(4):
        for conv in range(3):
            msgs = history.setdefault(conv, [{"role": "system", "content": words(10 + conv, 80)}])
            msgs.append({"role": "user", "content": words(20 + 4 * conv + rnd, 12)})
            status, body, node = post(router.url, "/v1/chat/completions",
                                      {"messages": msgs, "max_tokens": 8, "temperature": 0})
            assert status == 200
            served.setdefault(conv, []).append(node)
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            if rnd:
                details = body["usage"]["prompt_tokens_details"]
                assert details["local_cached_tokens"] >= 80, (conv, rnd, details)
    for conv, where in served.items():
        assert len(set(where)) == 1, (conv, where)
    assert {w[0] for w in served.values()} == {n.url for n in nodes}
    metrics = urllib.request.urlopen(f"{router.url}/metrics", timeout=10).read().decode()
    hits = sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("kvpool_router:node_predicted_hit_tokens_total{"))
    assert hits >= 9 * 80
    # The last round again, straight to the other node (a pull or a recompute there): same tokens.
    msgs = history[0][:-1]
    _, via_router, node = post(router.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8,
                                                                    "temperature": 0})
    other = next(n for n in nodes if n.url != node)
    status, direct = http_json(f"{other.url}/v1/chat/completions", {"messages": msgs, "max_tokens": 8,
                                                                    "temperature": 0})
    assert status == 200 and direct["choices"][0]["message"] == via_router["choices"][0]["message"]


def test_stream_chunks_arrive_while_the_node_still_generates(cluster: dict) -> None:
    router = cluster["router"]
    req = urllib.request.Request(f"{router.url}/v1/completions", data=json.dumps(
        {"prompt": words(40, 50), "max_tokens": 96, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        node = r.headers["x-kvpool-node"]
        first = r.readline()
        assert first.startswith(b"data: {")
        running = http_json(f"{node}/stats")[1]["http_in_flight"]
        assert running == 1  # the node has not finished the request whose first chunk we hold
        rest = r.read().decode()
    assert rest.rstrip().endswith("data: [DONE]") and rest.count("data: {") >= 10


def test_a_router_finds_the_nodes_in_the_registry(cluster: dict) -> None:
    """A router started with --discover and no --nodes routes to both nodes, at the URLs they
    announced when they registered (kvpool serve's default: http://HOST:PORT)."""
    router, nodes = cluster["discovering"], cluster["nodes"]
    with MetaClient(cluster["metaserver"].address) as client:
        assert sorted(n.api_url for n, _ in client.list_nodes()) == sorted(n.url for n in nodes)
    health = http_json(f"{router.url}/health")[1]
    assert health["nodes"] == health["nodes_up"] == 2
    # Its view of the nodes' queues is as of its last probe: wait until the last test's requests
    # have left it (a node still counted busy would rightly get none of these).
    wait_for(lambda: all(line.endswith(" 0") for line in urllib.request.urlopen(f"{router.url}/metrics").read()
                         .decode().splitlines() if line.startswith("kvpool_router:node_queued{")),
             timeout_s=30, interval_s=0.2)
    # Prompts no node holds a block of (words() repeats itself every ten seeds): ties go in turn.
    served = {post(router.url, "/v1/completions", {"prompt": f"registry probe {i}: {words(i, 30)}",
                                                   "max_tokens": 2})[2] for i in range(4)}
    assert served == {n.url for n in nodes}


def test_a_killed_nodes_share_goes_to_the_other(cluster: dict) -> None:
    """Runs last: SIGKILL one node; every request still succeeds, on the survivor. The
    discovering router drops the node once its lease has expired in the registry."""
    router, (a, b) = cluster["router"], cluster["nodes"]
    assert b.proc is not None
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    prompts = [{"prompt": words(60 + i, 40), "max_tokens": 4, "temperature": 0} for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda body: post(router.url, "/v1/completions", body), prompts))
    assert [s for s, _, _ in results] == [200] * 8
    assert {n for _, _, n in results} == {a.url}
    health = http_json(f"{router.url}/health")[1]
    assert health["nodes_up"] == 1 and health["nodes"] == 2
    discovering = cluster["discovering"]
    wait_for(lambda: http_json(f"{discovering.url}/health")[1]["nodes"] == 1, timeout_s=60, interval_s=0.5)
    assert post(discovering.url, "/v1/completions", prompts[0])[2] == a.url


def test_the_routers_ran_every_test_above_without_torch(cluster: dict) -> None:
    """The router loads the model's config and tokenizer only (engine/loader: torch comes with
    the weights): after every request of this module, neither router process has mapped
    torch's library, so a router host needs no torch (and starts without importing it)."""
    for router in (cluster["router"], cluster["discovering"]):
        assert router.alive()
        maps = open(f"/proc/{router.pid}/maps").read()
        assert "libtorch" not in maps and "libc10" not in maps, router.log_path
    node = cluster["nodes"][0]
    assert "libtorch" in open(f"/proc/{node.pid}/maps").read()  # the check can see it where it is
