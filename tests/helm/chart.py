"""Rendering helm/kvpool offline: `helm template` runs, rendered objects, container lookups.

No cluster can run here, so the chart is tested as rendered text: `helm lint`, `helm
template` with value sets, offline schema validation, and assertions over the objects.
Helm comes from scripts/install_helm.sh (run by scripts/bootstrap.sh) at .venv/bin/helm.
"""
from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvpool"
CI_VALUES = CHART / "ci"
RELEASE = "pool"
NAMESPACE = "kv"
KUBE_VERSION = "1.30.0"
MONITORING_API = "monitoring.coreos.com/v1"
# Stand-ins for what the kubelet fills in from the downward API.
FAKE_POD_IP = "10.244.3.7"

Manifest = dict[str, Any]


def helm_binary() -> str:
    """The helm that scripts/install_helm.sh installs; a missing one fails the test (not a skip)."""
    for candidate in (ROOT / ".venv" / "bin" / "helm", Path(sys.prefix) / "bin" / "helm"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("helm")
    if found:
        return found
    pytest.fail("helm not found at .venv/bin/helm or on PATH: run scripts/install_helm.sh (or make setup)")


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60, check=False)


def template_args(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (),
                  api_versions: tuple[str, ...] = (), chart: Path = CHART) -> list[str]:
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for f in values_files:
        args += ["-f", str(CI_VALUES / f)]
    for s in sets:
        args += ["--set", s]
    for a in api_versions:
        args += ["--api-versions", a]
    return args


@functools.cache
def render_text(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (),
                api_versions: tuple[str, ...] = ()) -> str:
    """`helm template` output; fails the test with helm's message when rendering fails."""
    proc = run_helm(*template_args(values_files, sets, api_versions))
    if proc.returncode != 0:
        pytest.fail(f"helm template failed:\n{proc.stderr}")
    return proc.stdout


def render_error(*sets: str, values_files: tuple[str, ...] = ()) -> str:
    """stderr of a `helm template` that must fail (fails the test if it rendered)."""
    proc = run_helm(*template_args(values_files, sets))
    assert proc.returncode != 0, f"helm template should have failed with {sets}, rendered:\n{proc.stdout[:500]}"
    return proc.stderr


@dataclass(frozen=True)
class Rendered:
    """The objects of one `helm template` run."""

    docs: tuple[Manifest, ...]

    def all(self, kind: str) -> list[Manifest]:
        return [d for d in self.docs if d["kind"] == kind]

    def find(self, kind: str, name: str) -> Manifest:
        for d in self.docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
        names = [f"{d['kind']}/{d['metadata']['name']}" for d in self.docs]
        raise AssertionError(f"no {kind}/{name} among {names}")

    def has(self, kind: str, name: str) -> bool:
        return any(d["kind"] == kind and d["metadata"]["name"] == name for d in self.docs)


@functools.cache
def render(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (),
           api_versions: tuple[str, ...] = ()) -> Rendered:
    docs = tuple(d for d in yaml.safe_load_all(render_text(values_files, sets, api_versions)) if d)
    return Rendered(docs)


def name(component: str) -> str:
    """Object name of a component in the test release."""
    return f"{RELEASE}-kvpool-{component}"


def service_host(service: Manifest) -> str:
    return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"


def pod_spec(workload: Manifest) -> Manifest:
    return workload["spec"]["template"]["spec"] if "template" in workload["spec"] else workload["spec"]


def container(workload: Manifest, container_name: str) -> Manifest:
    for c in pod_spec(workload)["containers"]:
        if c["name"] == container_name:
            return c
    raise AssertionError(f"no container {container_name} in {workload['metadata']['name']}")


def expand(c: Manifest, pod_name: str, args: list[str] | None = None) -> list[str]:
    """The container's args as the kubelet passes them: $(VAR) expanded from its env
    (downward-API fields filled with stand-ins). An undefined variable fails the test."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        field = e["valueFrom"]["fieldRef"]["fieldPath"]
        env[e["name"]] = {"metadata.name": pod_name, "status.podIP": FAKE_POD_IP}[field]

    def sub(m: re.Match[str]) -> str:
        var = m.group(1)
        assert var in env, f"$({var}) in {c['name']}'s args is not defined in its env {sorted(env)}"
        return env[var]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in (c["args"] if args is None else args)]


def flag(args: list[str], name: str) -> str:
    """The value after `--name` (exactly once)."""
    idx = [i for i, a in enumerate(args) if a == name]
    assert len(idx) == 1, f"{name} appears {len(idx)} times in {args}"
    return args[idx[0] + 1]


def eq_flags(args: list[str]) -> dict[str, str]:
    """`--key=value` arguments (etcd's style) as a dict."""
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- Secrets and the files they are mounted as ------------------------------------------------

def secret_values(r: Rendered) -> dict[str, dict[str, str]]:
    """The rendered (chart-generated) Secrets' data, decoded: {name: {key: value}}."""
    return {s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
            for s in r.all("Secret")}


def mounted_secret_files(workload: Manifest, container_name: str) -> dict[str, tuple[str, str]]:
    """Files a container sees from secret volumes: {path: (secret name, key)}. Every such
    mount must be read-only, every such volume mode 0400 and list its items (no whole Secret)."""
    spec = pod_spec(workload)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files: dict[str, tuple[str, str]] = {}
    for m in container(workload, container_name).get("volumeMounts", []):
        secret = volumes[m["name"]].get("secret")
        if secret is None:
            continue
        where = f"{workload['metadata']['name']}/{container_name}: {m['name']}"
        assert m.get("readOnly") is True, f"{where} is not mounted read-only"
        assert secret.get("defaultMode") == 0o400, f"{where}: mode {secret.get('defaultMode')!r}, not 0400"
        assert secret.get("items"), f"{where} mounts every key of {secret['secretName']}"
        for item in secret["items"]:
            assert "mode" not in item, f"{where}: {item['key']} overrides the mode"
            files[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = (secret["secretName"], item["key"])
    mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    unmounted = [n for n, v in volumes.items() if "secret" in v and n not in mounted]
    assert not unmounted, f"{workload['metadata']['name']} has secret volumes no container mounts: {unmounted}"
    return files
