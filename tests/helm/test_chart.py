"""The chart as a whole: lint, render with every value set, offline Kubernetes schema
validation, schema and `required` failures with clear messages, NOTES.txt."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
    MONITORING_API,
    NAMESPACE,
    RELEASE,
    helm_binary,
    name,
    render,
    render_error,
    render_text,
    run_helm,
    template_args,
)

VALUE_SETS = sorted(p.name for p in CI_VALUES.glob("*-values.yaml"))
# What the kubelet/API server knows without CRDs; everything else must be accounted for here.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def test_value_sets_present() -> None:
    assert set(VALUE_SETS) >= {"external-etcd-values.yaml", "gpu-rdma-values.yaml", "monitoring-values.yaml",
                               "etcd-3-values.yaml", "security-values.yaml"}


def test_helm_is_v3() -> None:
    out = subprocess.run([helm_binary(), "version", "--short"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("v3."), out


@pytest.mark.parametrize("values_file", [None, *VALUE_SETS])
def test_lint_strict(values_file: str | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(CI_VALUES / values_file)] if values_file else [])
    proc = run_helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values_file", [None, *VALUE_SETS])
def test_rendered_manifests_validate_strict(values_file: str | None) -> None:
    files = (values_file,) if values_file else ()
    rendered = render(files, api_versions=(MONITORING_API,))
    assert len(rendered.docs) >= 8
    for doc in rendered.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({values_file}): {err.message} at {list(err.path)}")


def test_kubernetes_validate_cli(tmp_path: Path) -> None:
    """The CI command as an operator runs it, and a control that strict mode rejects a typo."""
    cli = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert cli, "kubernetes-validate is not installed in this environment (the dev extra)"
    good = tmp_path / "rendered.yaml"
    good.write_text(render_text())
    proc = subprocess.run([cli, "--strict", "-k", KUBE_VERSION, "--quiet", str(good)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = [d for d in yaml.safe_load_all(good.read_text()) if d]
    sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == name("engine"))
    sts["spec"]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"   # not a Kubernetes field
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sts))
    proc = subprocess.run([cli, "--strict", "-k", KUBE_VERSION, "--quiet", str(bad)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "shmSize" in proc.stdout + proc.stderr


def test_every_object_has_the_standard_labels() -> None:
    for doc in render((), api_versions=(MONITORING_API,)).docs + render(("monitoring-values.yaml",),
                                                                          api_versions=(MONITORING_API,)).docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvpool"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/part-of"] == "kvpool"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["helm.sh/chart"] == "kvpool-0.1.0"
        assert labels["app.kubernetes.io/component"], doc["metadata"]["name"]
        assert doc["metadata"].get("namespace") == NAMESPACE


def test_default_render_objects() -> None:
    r = render()
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in r.docs)
    assert kinds == sorted([
        f"ConfigMap/{name('config')}",
        f"Deployment/{name('metaserver')}", f"Service/{name('metaserver')}",
        f"PodDisruptionBudget/{name('metaserver')}",
        f"StatefulSet/{name('etcd')}", f"Service/{name('etcd')}", f"Service/{name('etcd')}-headless",
        f"StatefulSet/{name('engine')}", f"Service/{name('engine')}", f"Service/{name('engine')}-headless",
        f"Pod/{name('test-metaserver')}", f"Pod/{name('test-engine')}",
    ])


# --- failures with clear messages -----------------------------------------------------------

def test_external_etcd_without_endpoints_fails_clearly() -> None:
    err = render_error("etcd.enabled=false")
    assert "externalEtcd.endpoints is required when etcd.enabled=false" in err


def test_external_etcd_needs_ip_endpoints_when_several() -> None:
    err = render_error("etcd.enabled=false", "externalEtcd.endpoints={etcd-a:2379,etcd-b:2379}")
    assert "each must be IP:PORT" in err and "etcd-a:2379" in err
    # One DNS name is fine (the metaserver's client dials it directly).
    assert render((), ("etcd.enabled=false", "externalEtcd.endpoints={etcd.infra:2379}")).all("Deployment")


def test_external_endpoints_while_in_chart_etcd_enabled_fails() -> None:
    err = render_error("externalEtcd.endpoints={10.0.0.1:2379}")
    assert "set etcd.enabled=false" in err


def test_metaserver_txn_ops_cannot_exceed_etcd_limit() -> None:
    err = render_error("metaserver.maxTxnOps=256")
    assert "metaserver.maxTxnOps (256) exceeds etcd.maxTxnOps (128)" in err
    assert render((), ("metaserver.maxTxnOps=256", "etcd.maxTxnOps=256")).all("Deployment")


def test_model_volume_source_required() -> None:
    assert "engine.modelVolume.claimName is required" in render_error("engine.modelVolume.type=persistentVolumeClaim")
    assert "engine.modelVolume.hostPath is required" in render_error("engine.modelVolume.type=hostPath")


@pytest.mark.parametrize(("setting", "message"), [
    ("engine.port=http", "engine.port: Invalid type. Expected: integer, given: string"),
    ("metaserver.replicas=two", "metaserver.replicas: Invalid type. Expected: integer, given: string"),
    ("engine.hostNetwork=maybe", "engine.hostNetwork: Invalid type. Expected: boolean, given: string"),
    ("etcd.replicas=2", "etcd.replicas must be one of the following: 1, 3"),
    ("metaserver.leaseTtl=0", "metaserver.leaseTtl: Must be greater than or equal to 1"),
    ("engine.kvTransferConfig.kv_role=kv_everything", "kv_role must be one of the following"),
    ("engine.kvTransferConfig.kv_connector_extra_config.protocol=udp", "protocol must be one of the following"),
    ("engine.kvTransferConfig.kv_connector_extra_config.debug_load_delay_s=1",
     "Additional property debug_load_delay_s is not allowed"),
    ("engine.poolSize=lots", "engine.poolSize: Does not match pattern"),
    ("etcd.goMemLimit=80M", "etcd.goMemLimit: Does not match pattern"),
    ("engine.transferEngineEnv.MC_TRANSFER_TIMEOUT=9", "MC_TRANSFER_TIMEOUT"),
    ("metaserver.leaseTTL=5", "Additional property leaseTTL is not allowed"),
    ("security.tls.enabled=yes", "security.tls.enabled: Invalid type. Expected: boolean, given: string"),
    ("security.tls.mutual=1", "security.tls.mutual: Invalid type. Expected: boolean, given: integer"),
    ("security.tls.existingSecret=My_Cert", "security.tls.existingSecret: Does not match pattern"),
    ("security.tls.generated.validityDays=0", "validityDays: Must be greater than or equal to 1"),
    ("security.tls.mutualTLS=true", "Additional property mutualTLS is not allowed"),
    ("security.tokens.adminTokenKey=a/b", "security.tokens.adminTokenKey: Does not match pattern"),
    ("security.tokens.adminToken=hunter2", "Additional property adminToken is not allowed"),
    ("engine.apiKey.enabled=on", "engine.apiKey.enabled: Invalid type. Expected: boolean, given: string"),
    ("engine.apiKey.key=", "engine.apiKey.key: String length must be greater than or equal to 1"),
    ("engine.drainOnStop=no", "engine.drainOnStop: Invalid type. Expected: boolean, given: string"),
])
def test_schema_rejects_bad_values(setting: str, message: str) -> None:
    err = render_error(setting)
    assert "values don't meet the specifications of the schema" in err, err
    assert message in err, err


def test_schema_accepts_the_value_sets() -> None:
    for values_file in VALUE_SETS:
        proc = run_helm(*template_args((values_file,)))
        assert proc.returncode == 0, f"{values_file}: {proc.stderr}"


# --- NOTES.txt ------------------------------------------------------------------------------

def _notes(chart: Path, *sets: str, api_versions: tuple[str, ...] = ()) -> str:
    """NOTES.txt as `helm install` would print it."""
    proc = run_helm(*template_args((), sets, api_versions, chart=chart), "--show-only", "templates/zz-notes.yaml")
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["data"]["NOTES.txt"]


def test_notes_show_endpoints_and_benchmark(notes_chart: Path) -> None:
    notes = _notes(notes_chart)
    assert f"http://{name('engine')}.{NAMESPACE}.svc.cluster.local:8000" in notes
    assert f"{name('metaserver')}.{NAMESPACE}.svc.cluster.local:50051" in notes
    assert f"{name('etcd')}.{NAMESPACE}.svc.cluster.local:2379" in notes
    assert f"helm test {RELEASE} -n {NAMESPACE}" in notes
    engine = name("engine")
    pods = [f"http://{engine}-{i}.{engine}-headless.{NAMESPACE}.svc.cluster.local:8000" for i in range(2)]
    assert f"bench cross-node --urls {','.join(pods)} " in notes  # against this release's nodes
    assert "WARNING" not in notes
    external = _notes(notes_chart, "etcd.enabled=false", "externalEtcd.endpoints={10.0.0.9:2379}")
    assert "the external etcd 10.0.0.9:2379" in external


def test_notes_warn_when_servicemonitor_cannot_be_created(notes_chart: Path) -> None:
    assert "no ServiceMonitor was created" in _notes(notes_chart, "serviceMonitor.enabled=true")
    assert "WARNING" not in _notes(notes_chart, "serviceMonitor.enabled=true", api_versions=(MONITORING_API,))
