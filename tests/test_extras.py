"""The core distribution runs without its extras (pyproject.toml): the pool, the connector
halves, the metaserver (client, server, `kvpool metaserver` and `kvpool admin`) import with
none of the engine's, router's or benchmarks' packages, as in `pip install kvpool[cpu]` into a
vLLM environment or onto a metaserver host; a command that needs an extra says which.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def extras_only_modules() -> list[str]:
    """The import names of the packages that only the engine, router and bench extras bring."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~\[; ]", r)[0].lower() for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    names = {re.split(r"[<>=!~\[; ]", r)[0].lower() for e in ("engine", "router", "bench") for r in extras[e]}
    return sorted(n.replace("-", "_") for n in names - core - {"kvpool"})


def run_without_extras(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter where importing any extra's package fails, as if absent."""
    prelude = f"import sys\nfor m in {extras_only_modules()!r}:\n    sys.modules[m] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_extras_hold_the_heavy_packages() -> None:
    blocked = extras_only_modules()
    for name in ("torch", "triton", "gguf", "tokenizers", "matplotlib", "tqdm"):
        assert name in blocked


def test_core_imports_without_extras() -> None:
    proc = run_without_extras(
        "import connector.pool_scheduler, connector.pool_worker, connector.handoff, connector.settings\n"
        "import kvpool.pool, kvpool.reader, kvpool.transfer, kvpool.publisher\n"
        "import metaserver.client, metaserver.server, metaserver.cli, metaserver.admin\n"
        "import kvpool_proto.kvpool.v1.meta_pb2_grpc\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cli_without_extras_runs_the_metaserver_and_names_the_extra() -> None:
    proc = run_without_extras("from kvpool_cli.main import main\n"
                              "try:\n    main(['metaserver', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
                              "print('serve rc', main(['serve', '--model', 'x']))\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: kvpool metaserver" in proc.stdout
    assert "serve rc 2" in proc.stdout
    assert "kvpool serve needs kvpool[engine]" in proc.stderr


def test_a_router_hashes_prompts_without_torch() -> None:
    """`kvpool router` loads the model's config and tokenizer only: with torch absent it still
    hashes a prompt into the chain the nodes make (tests/router/test_chain.py compares them)."""
    proc = subprocess.run([sys.executable, "-c",
                           "import sys\nsys.modules['torch'] = None\n"
                           "from router.chain import PromptHasher\n"
                           "h = PromptHasher('smollm2-135m', 'smollm2-135m')\n"
                           "print(h.expect('float32', 16))\n"
                           "c = h.chain(b'{\"model\": \"smollm2-135m\", \"prompt\": \"' + b'the rivers of Europe ' * 9 + b'\"}', False)\n"
                           "print(len(c.hashes), c.num_tokens)\n"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fingerprint, counts = proc.stdout.split("\n")[:2]
    blocks, tokens = map(int, counts.split())
    assert "|float32|" in fingerprint and "bs16" in fingerprint, fingerprint
    assert tokens >= 32 and blocks == tokens // 16
