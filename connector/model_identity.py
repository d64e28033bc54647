"""What a node's KV blocks are: a model's identity by its weights, and layout namespaces
compared across the nodes of a pool.

Two nodes can share KV blocks only if the bytes of a block would be equal: the same weights,
dtype, block size and cache layout. A path or a served-model alias says nothing about that:
the same weights copied to another folder, or served under another name, must share, and
two fine-tunes served as "llama" must not. So a host's namespace names the model by
`weights_digest` (a digest of its weight files), not by its path or name; and a node that
joins a pool where another node serves the same weights in an incompatible layout (another
dtype or block size) says so at start (`namespace_conflicts`), instead of silently sharing
nothing.

Host-independent and free of vLLM: the vLLM plug-in (`connector.vllm_plugin`) uses it.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import xxhash

from connector.settings import PoolConnectorSettings
from metaserver.errors import MetaError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HEAD_BYTES = 1 << 20      # each weight file's first MiB (a safetensors header lists every tensor)
SAMPLE_BYTES = 64 << 10   # then this much at each of SAMPLES evenly spaced offsets, and the tail
SAMPLES = 32
# config.json fields that name or date the export, not the model
CONFIG_NOISE = ("_name_or_path", "_model_name_or_path", "transformers_version", "_commit_hash")


def weights_digest(model_dir: Path) -> str:
    """A 32-hex-digit digest of the model in `model_dir`: config.json (less the fields that name
    or date the export) and, for every weight file by its name relative to the folder, its
    size, its first MiB and SAMPLES evenly spaced 64 KiB samples and its last 64 KiB.

    Any two fine-tunes differ in every tensor, so samples tell them apart; reading samples,
    not the whole files, keeps start-up fast for models of hundreds of GB. Equal for copies
    of a folder, wherever they are. ValueError if the folder holds no weight file."""
    model_dir = Path(model_dir)
    h = xxhash.xxh3_128()
    config = model_dir / "config.json"
    if config.exists():
        fields = {k: v for k, v in json.loads(config.read_text()).items() if k not in CONFIG_NOISE}
        h.update(json.dumps(fields, sort_keys=True).encode())
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ValueError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(model_dir).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(HEAD_BYTES))
            for k in range(SAMPLES + 1):  # k = SAMPLES: the tail
                f.seek(max(0, size - SAMPLE_BYTES) * k // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def namespace_conflicts(own: str, others: Iterable[str]) -> list[str]:
    """Namespaces of `others` that name the same model as `own` in another layout, as one
    message each ("|"-separated namespaces whose first two fields are the host and the model
    identity, e.g. `vllm|<digest>|float32|bs128|...`). Empty when nothing conflicts."""
    mine = own.split("|")
    out = []
    for ns in sorted(set(others)):
        theirs = ns.split("|")
        if ns == own or theirs[:2] != mine[:2]:
            continue
        diff = [f"{a} here, {b} there" for a, b in zip(mine[2:], theirs[2:]) if a != b]
        if len(mine) != len(theirs):
            diff.append(f"layout {own!r} vs {ns!r}")
        out.append(f"another node serves the same weights in namespace {ns} ({'; '.join(diff)}): "
                   "its KV blocks are not shared with this node")
    return out


def warn_namespace_conflicts(settings: PoolConnectorSettings, namespace: str, log: logging.Logger) -> list[str]:
    """Log (warning) and return `namespace_conflicts` of this node's namespace with those of
    the nodes registered in the pool now: said at start, since otherwise two such nodes share
    nothing without a word. A metaserver that does not answer is logged, not raised."""
    try:
        with settings.meta_client() as client:
            others = [node.namespace for node, _ in client.list_nodes()]
    except MetaError as err:
        log.warning("kvpool: could not list the pool's nodes to compare namespaces: %s", err)
        return []
    messages = namespace_conflicts(namespace, others)
    for message in messages:
        log.warning("kvpool: %s", message)
    return messages
