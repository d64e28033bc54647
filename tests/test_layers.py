"""The import layering (pyproject's import-linter contracts) holds, and would catch a breach.

The contracts: packages are layered (CLI > bench > harness > connector > engine | kvpool >
metaserver > generated protos), the engine imports no pool, metaserver or connector
implementation, and no package has import circles between its modules.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvpool_cli", "kvpool_plan", "kvpool_bench", "kvpool_harness", "connector", "engine", "kvpool", "metaserver",
            "kvpool_proto")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(cwd)})


def test_the_layering_contracts_are_kept() -> None:
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 3 kept, 0 broken." in r.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("engine/kv_cache.py", "import kvpool.layout", "The engine imports no pool, metaserver or connector"),
    ("kvpool/pool.py", "import engine.request", "Packages are layered"),
    ("kvpool/stats.py", "import kvpool.pool", "No import circles"),
])
def test_an_import_against_the_layers_fails(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """The same check on a copy of the tree with one import added breaks the named contract."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    broken = r.stdout[r.stdout.index("Broken contracts"):]
    assert contract in broken and line.split()[-1].rsplit(".", 1)[-1] in broken  # names the new import
