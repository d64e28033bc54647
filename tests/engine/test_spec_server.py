"""`kvpool serve --speculative-config`: greedy answers equal plain decoding's, the acceptance
statistics in /metrics, and a bad configuration is a one-line error before anything starts."""
from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from engine.request import SamplingParams
from kvpool_harness.engine_node import EngineProcess
from tests.engine.conftest import make_engine, run_all
from tests.engine.test_spec_decode import copy_prompts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_speculating_server_answers_like_plain_decoding_and_reports_acceptance(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    prompts = copy_prompts(loaded.tokenizer)
    expected = [o.token_ids for o in run_all(make_engine(loaded), prompts, SamplingParams(max_tokens=40))]
    node = EngineProcess(tmp_path / "spec.log", "spec", extra_args=(
        "--kv-cache-bytes", "128MiB", "--threads", "2",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'))
    node.start()
    try:
        node.wait_ready(120)
        for prompt, want in zip(prompts, expected):
            body = node.complete(prompt, 40)
            assert body["choices"][0]["token_ids"] == want
        metrics = urllib.request.urlopen(node.url + "/metrics", timeout=10).read().decode()
    finally:
        node.stop()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("kvpool:engine_spec_")}
    assert values["kvpool:engine_spec_accepted_tokens_total"] > 0
    assert 0 < values["kvpool:engine_spec_acceptance_rate"] <= 1
    assert values["kvpool:engine_spec_mean_accepted_length"] > 1


@pytest.mark.parametrize("config,needle", [("{", "not valid JSON"), ('{"method": "eagle"}', "method"),
                                           ('{"k": 4}', "unknown keys")])
def test_bad_speculative_config_is_a_one_line_error(config: str, needle: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "serve", "--port", "1", "--speculative-config", config],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvpool serve: error:") and needle in err[0], r.stderr


def test_speculating_node_with_a_remote_pool_hit_and_its_saves(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    """Node S speculates (ngram) with the pool on: its prompt's prefix comes from node A's pool
    (a remote hit), its greedy answer equals plain local decoding; the blocks S saves while it
    speculates (its answer's too) hold committed tokens only: A, given S's prompt + answer as a
    new prompt, loads them from S and still answers as plain local decoding does."""
    from kvpool_harness.processes import EtcdProcess, MetaserverProcess
    from tests.conftest import wait_for

    prompt = copy_prompts(loaded.tokenizer)[0]
    plain = make_engine(loaded)
    want = run_all(plain, [prompt], SamplingParams(max_tokens=48))[0].token_ids
    args = ("--kv-cache-bytes", "128MiB", "--threads", "1")
    spec = ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    with EtcdProcess(tmp_path / "etcd") as etcd, MetaserverProcess(etcd.endpoint, tmp_path / "ms.log") as ms:
        a = EngineProcess(tmp_path / "a.log", "spec-a", ms.address, pool_size="128MiB", extra_args=args)
        s = EngineProcess(tmp_path / "s.log", "spec-s", ms.address, pool_size="128MiB", extra_args=args + spec)
        a.start()
        s.start()
        try:
            a.wait_ready(300)
            s.wait_ready(300)
            a.complete(prompt, 1)
            wait_for(lambda: a.stats().get("pool_published", 0) >= len(prompt) // 16, timeout_s=20, interval_s=0.05)
            got = s.complete(prompt, 48)
            assert got["usage"]["prompt_tokens_details"]["remote_cached_tokens"] >= len(prompt) // 16 * 16 - 16
            assert got["choices"][0]["token_ids"] == want
            st = s.stats()
            assert st["spec_accepted_tokens"] > 0
            full = prompt + want
            # S computed the prompt's partial last block and the answer: its full blocks are saved
            saved = (len(full) - 1) // 16 - len(prompt) // 16
            wait_for(lambda: s.stats().get("pool_published", 0) >= saved, timeout_s=20, interval_s=0.05)
            again = a.complete(full, 16)
            want2 = run_all(plain, [full], SamplingParams(max_tokens=16))[0].token_ids
            assert again["usage"]["prompt_tokens_details"]["remote_cached_tokens"] >= 16
            assert again["choices"][0]["token_ids"] == want2
        finally:
            a.stop()
            s.stop()
