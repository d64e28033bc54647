"""The model's identity by its weights, and namespace conflicts between nodes (the last test
with a real etcd and metaserver)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from connector.model_identity import namespace_conflicts, warn_namespace_conflicts, weights_digest
from connector.settings import PoolConnectorSettings
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient


def _model(root: Path, seed: int = 0, layers: int = 30, name: str = "exported") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "_name_or_path": name,
                                                  "transformers_version": "5.2"}))
    weights = np.random.default_rng(seed).standard_normal(3 << 20, dtype=np.float32)  # 12 MiB
    weights.tofile(root / "model.safetensors")
    return root


def test_the_same_weights_anywhere_have_one_digest_and_names_do_not_matter(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    b.mkdir(parents=True)
    os.link(a / "model.safetensors", b / "model.safetensors")    # a copy at another path
    config = json.loads((a / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**config, "_name_or_path": "another name"}))
    assert weights_digest(a) == weights_digest(b)


def test_other_weights_or_another_architecture_differ(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    tuned = _model(tmp_path / "tuned")
    w = np.fromfile(tuned / "model.safetensors", dtype=np.float32)
    w[::1024] += 1e-3                                              # a fine-tune: small changes throughout
    w.tofile(tuned / "model.safetensors")
    assert weights_digest(a) != weights_digest(tuned)
    assert weights_digest(a) != weights_digest(_model(tmp_path / "deeper", layers=31))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no weight files"):
        weights_digest(empty)

def test_namespace_conflicts_name_the_same_weights_in_another_layout_only() -> None:
    own = "vllm|abc|float32|bs128|L30|kv3|hd64|LBHNC"
    others = [own, "vllm|abc|bfloat16|bs128|L30|kv3|hd64|LBHNC", "vllm|other|bfloat16|bs128|L30|kv3|hd64|LBHNC",
              "smollm2|float32|bs16"]
    (msg,) = namespace_conflicts(own, others)
    assert "vllm|abc|bfloat16" in msg and "float32 here, bfloat16 there" in msg
    assert namespace_conflicts(own, [own]) == []


def test_a_node_says_at_start_which_registered_node_serves_its_weights_in_another_layout(
        metaserver: MetaserverProcess, caplog: pytest.LogCaptureFixture) -> None:
    """Real etcd and metaserver: a node registered with the same weights in bfloat16 is named
    in a warning by a float32 node; a node of another model is not."""
    own = "vllm|abc|float32|bs128|L30|kv3|hd64|LBHNC"
    with MetaClient(metaserver.address) as client:
        client.register_node("bf16-node", "127.0.0.1:1", 4096, 1 << 20, "vllm|abc|bfloat16|bs128|L30|kv3|hd64|LBHNC",
                             lease_ttl_s=3600)
        client.register_node("other-model", "127.0.0.1:2", 4096, 1 << 20, "vllm|xyz|bfloat16|bs128|L30|kv3|hd64|LBHNC",
                             lease_ttl_s=3600)
    settings = PoolConnectorSettings.from_extra({"metaserver": metaserver.address}.get, 30.0)
    log = logging.getLogger("test.kvpool")
    with caplog.at_level(logging.WARNING, logger="test.kvpool"):
        (msg,) = warn_namespace_conflicts(settings, own, log)
    assert "vllm|abc|bfloat16" in msg and "float32 here, bfloat16 there" in msg
    assert [r.getMessage() for r in caplog.records] == [f"kvpool: {msg}"]
