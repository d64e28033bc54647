"""How the rendered objects connect: workers -> metaserver Service -> metaserver pods ->
etcd; the command lines parse with the real `kvpool` CLI and build the real configs; probes,
placement, resources, volumes, the config checksum, the ServiceMonitor and `helm test` pods."""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess

import pytest
import yaml

from engine.kv_connector.config import KVTransferConfig
from kvpool.layout import parse_size
from kvpool.transfer import TransferConfig
from kvpool_cli import serve as engine_cli
from kvpool_cli.main import build_parser
from metaserver.config import MetaServerConfig
from metaserver.etcd import grpc_target
from tests.helm.chart import (
    CI_VALUES,
    FAKE_POD_IP,
    MONITORING_API,
    ROOT,
    Manifest,
    Rendered,
    container,
    eq_flags,
    expand,
    mounted_secret_files,
    flag,
    name,
    pod_spec,
    render,
    render_error,
    render_text,
    selects,
    service_host,
)

ENGINE_POD = f"{name('engine')}-0"
METASERVER_POD = f"{name('metaserver')}-7d9c-x2x"
VALUE_SETS = [(), ("external-etcd-values.yaml",), ("gpu-rdma-values.yaml",), ("monitoring-values.yaml",),
              ("etcd-3-values.yaml",), ("security-values.yaml",)]
IDS = ["default", "external-etcd", "gpu-rdma", "monitoring", "etcd-3", "security"]


def _values(files: tuple[str, ...]) -> dict:
    """values.yaml with the value set files merged over it (as helm merges them)."""
    merged = yaml.safe_load((ROOT / "helm" / "kvpool" / "values.yaml").read_text())
    for f in files:
        _merge(merged, yaml.safe_load((CI_VALUES / f).read_text()))
    return merged


def _merge(base: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def _metaserver_args(r: Rendered) -> list[str]:
    c = container(r.find("Deployment", name("metaserver")), "metaserver")
    return expand(c, METASERVER_POD)


def _engine_args(r: Rendered) -> list[str]:
    return expand(container(r.find("StatefulSet", name("engine")), "engine"), ENGINE_POD)


def _named_port(c: Manifest, port_name: str) -> int:
    for p in c.get("ports", []):
        if p["name"] == port_name:
            return p["containerPort"]
    raise AssertionError(f"container {c['name']} has no port named {port_name}")


def _pod_labels(workload: Manifest) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


# --- engines -> metaserver --------------------------------------------------------------------

@pytest.mark.parametrize("files", VALUE_SETS, ids=IDS)
def test_workers_use_the_mooncake_connector_and_the_metaserver_service(files: tuple[str, ...]) -> None:
    r = render(files, api_versions=(MONITORING_API,))
    args = _engine_args(r)
    assert args[0] == "serve"
    assert flag(args, "--kv-connector") == "mooncake"
    svc = r.find("Service", name("metaserver"))
    (port,) = svc["spec"]["ports"]
    assert flag(args, "--metaserver") == f"{service_host(svc)}:{port['port']}"
    # The Service reaches the metaserver pods on the port they listen on.
    dep = r.find("Deployment", name("metaserver"))
    assert selects(svc["spec"]["selector"], _pod_labels(dep))
    c = container(dep, "metaserver")
    listen_port = int(flag(_metaserver_args(r), "--listen").rsplit(":", 1)[1])
    assert _named_port(c, port["targetPort"]) == listen_port == port["port"]
    assert flag(args, "--node-id") == ENGINE_POD
    assert r.find("StatefulSet", name("engine"))["spec"]["serviceName"] == f"{name('engine')}-headless"


@pytest.mark.parametrize("files", VALUE_SETS, ids=IDS)
def test_engine_command_line_parses_with_the_real_cli(files: tuple[str, ...]) -> None:
    """Every rendered flag exists, and the values reach the config objects the program builds."""
    values = _values(files)["engine"]
    args = build_parser().parse_args(_engine_args(render(files, api_versions=(MONITORING_API,))))
    assert args.cmd == "serve" and args.host == "0.0.0.0" and args.port == values["port"]
    assert (args.model, args.dtype, args.device) == (values["model"], values["dtype"], values["device"])
    assert args.block_size == values["blockSize"]
    assert args.max_num_seqs == values["maxNumSeqs"]
    assert args.max_num_batched_tokens == values["maxNumBatchedTokens"]
    assert parse_size(args.kv_cache_bytes) == parse_size(values["kvCacheBytes"])
    assert args.no_prefix_caching is values["noPrefixCaching"]
    ktc = engine_cli.kv_transfer_config(args)   # what `kvpool serve` builds (rejects unknown keys)
    assert isinstance(ktc, KVTransferConfig)
    assert ktc.kv_connector == "mooncake" and ktc.kv_role == values["kvTransferConfig"]["kv_role"]
    extra = ktc.kv_connector_extra_config
    assert extra["metaserver"] == args.metaserver
    assert extra["node_id"] == ENGINE_POD
    assert extra["api_url"] == f"http://{FAKE_POD_IP}:{values['port']}"  # announced for routers' --discover
    assert parse_size(extra["pool_size"]) == parse_size(values["poolSize"])
    assert extra["local_hostname"] == (values["kvTransferConfig"]["kv_connector_extra_config"]["local_hostname"]
                                       or FAKE_POD_IP)
    transfer = TransferConfig(protocol=extra["protocol"], metadata_server=extra["metadata_server"],
                              device_name=extra["device_name"], local_hostname=extra["local_hostname"],
                              transfer_timeout_s=int(extra["transfer_timeout_s"]),
                              progress_timeout_s=int(extra["progress_timeout_s"]))
    assert transfer.protocol == values["kvTransferConfig"]["kv_connector_extra_config"]["protocol"]


def _connector_extra_keys() -> set[str]:
    """kv_connector_extra_config keys the connector reads: every key `PoolConnectorSettings`
    asks for while it is built (recorded, with each key's default)."""
    from connector.settings import PoolConnectorSettings

    keys: set[str] = set()

    def extra(key: str, default: object = None) -> object:
        keys.add(key)
        return "127.0.0.1:1" if key == "metaserver" else default

    PoolConnectorSettings.from_extra(extra, 30.0)
    assert {"metaserver", "protocol", "local_hostname"} <= keys, f"connector settings changed shape: {keys}"
    return keys


def test_transfer_settings_are_keys_the_connector_reads() -> None:
    for files in VALUE_SETS:
        raw = flag(_engine_args(render(files, api_versions=(MONITORING_API,))), "--kv-transfer-config")
        extra = json.loads(raw)["kv_connector_extra_config"]
        unknown = set(extra) - _connector_extra_keys()
        assert not unknown, f"{files}: the connector does not read {unknown}"


def test_every_engine_value_reaches_a_flag() -> None:
    """Changing a program value changes the command line (no value configurable only in Helm)."""
    base = _engine_args(render())
    for setting, expected in [("engine.dtype=bfloat16", ["--dtype", "bfloat16"]),
                              ("engine.maxModelLen=4096", ["--max-model-len", "4096"]),
                              ("engine.threads=4", ["--threads", "4"]),
                              ("engine.maxRequestBytes=8MiB", ["--max-request-bytes", "8MiB"]),
                              ("engine.attentionBackend=torch", ["--attention-backend", "torch"]),
                              ("engine.servedModelName=smol", ["--served-model-name", "smol"]),
                              ("engine.noChunkedPrefill=true", ["--no-chunked-prefill"])]:
        args = _engine_args(render((), (setting,)))
        assert args != base, setting
        joined = " ".join(args)
        assert " ".join(expected) in joined, (setting, args)
    ktc = json.loads(flag(_engine_args(render((), ("engine.kvTransferConfig.kv_load_timeout_s=12",))),
                          "--kv-transfer-config"))
    assert ktc["kv_load_timeout_s"] == 12


def test_metaserver_command_line_parses_and_builds_its_config() -> None:
    values = _values(())["metaserver"]
    args = build_parser().parse_args(_metaserver_args(render()))
    assert args.cmd == "metaserver"
    config = MetaServerConfig(listen=args.listen, etcd_endpoints=tuple(args.etcd.split(",")),
                              key_prefix=args.key_prefix, replica_id=args.replica_id,
                              default_lease_ttl_s=args.lease_ttl, max_txn_ops=args.max_txn_ops,
                              hash_bytes=args.hash_bytes)
    assert config.listen == f"0.0.0.0:{values['port']}"
    assert config.replica_id == METASERVER_POD
    assert config.default_lease_ttl_s == values["leaseTtl"] and args.threads == values["threads"]
    assert args.switch_interval_ms == values["switchIntervalMs"]
    custom = build_parser().parse_args(_metaserver_args(render((), ("metaserver.leaseTtl=25",
                                                                     "metaserver.keyPrefix=/pool-a/"))))
    assert (custom.lease_ttl, custom.key_prefix) == (25, "/pool-a/")


# --- metaserver -> etcd -----------------------------------------------------------------------

@pytest.mark.parametrize("files", [(), ("etcd-3-values.yaml",)], ids=["1-member", "3-members"])
def test_metaserver_reaches_the_in_chart_etcd(files: tuple[str, ...]) -> None:
    r = render(files)
    members = _values(files)["etcd"]["replicas"]
    endpoints = flag(_metaserver_args(r), "--etcd")
    svc = r.find("Service", name("etcd"))
    (port,) = svc["spec"]["ports"]
    assert endpoints == f"{service_host(svc)}:{port['port']}"
    grpc_target(endpoints.split(","))   # the metaserver's etcd client accepts it
    sts = r.find("StatefulSet", name("etcd"))
    assert sts["spec"]["replicas"] == members
    assert selects(svc["spec"]["selector"], _pod_labels(sts))
    c = container(sts, "etcd")
    flags = eq_flags(expand(c, f"{name('etcd')}-0"))
    assert flags["listen-client-urls"].endswith(f":{_named_port(c, port['targetPort'])}")
    assert _named_port(c, "client") == port["port"]
    # The initial cluster names every member by its pod's stable name in the headless Service.
    headless = r.find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    peers = dict(m.split("=", 1) for m in flags["initial-cluster"].split(","))
    assert sorted(peers) == [f"{name('etcd')}-{i}" for i in range(members)]
    for member, url in peers.items():
        assert url == f"http://{member}.{service_host(headless)}:{_named_port(c, 'peer')}"
    assert flags["name"] == f"{name('etcd')}-0"
    assert flags["initial-advertise-peer-urls"] == peers[f"{name('etcd')}-0"]
    assert int(flags["max-txn-ops"]) >= int(flag(_metaserver_args(r), "--max-txn-ops"))
    has_pvc = bool(sts["spec"].get("volumeClaimTemplates"))
    assert has_pvc is _values(files)["etcd"]["persistence"]["enabled"]
    assert any(v["name"] == "data" for v in pod_spec(sts).get("volumes", [])) is not has_pvc


def test_etcd_persistence() -> None:
    sts = render(("etcd-3-values.yaml",)).find("StatefulSet", name("etcd"))
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert {"name": "data", "mountPath": "/var/run/etcd"} in container(sts, "etcd")["volumeMounts"]
    assert "--data-dir=/var/run/etcd/data" in container(sts, "etcd")["args"]
    off = render((), ("etcd.persistence.enabled=false",)).find("StatefulSet", name("etcd"))
    assert "volumeClaimTemplates" not in off["spec"]
    assert {"name": "data", "emptyDir": {}} in pod_spec(off)["volumes"]


def test_etcd_3_members_start_together_with_a_disruption_budget() -> None:
    r = render(("etcd-3-values.yaml",))
    assert r.find("StatefulSet", name("etcd"))["spec"]["podManagementPolicy"] == "Parallel"
    assert r.find("PodDisruptionBudget", name("etcd"))["spec"]["maxUnavailable"] == 1
    assert not render().has("PodDisruptionBudget", name("etcd"))


def test_external_etcd_endpoints_are_passed_and_no_etcd_is_rendered() -> None:
    r = render(("external-etcd-values.yaml",))
    endpoints = _values(("external-etcd-values.yaml",))["externalEtcd"]["endpoints"]
    assert flag(_metaserver_args(r), "--etcd") == ",".join(endpoints)
    assert grpc_target(endpoints).startswith("ipv4:")
    assert not [d for d in r.docs if d["metadata"]["labels"]["app.kubernetes.io/component"] == "etcd"]


def test_etcd_gets_gomemlimit_only_when_set() -> None:
    def env(*settings: str) -> dict[str, str]:
        c = container(render((), settings).find("StatefulSet", name("etcd")), "etcd")
        return {e["name"]: e.get("value") for e in c["env"]}
    assert "GOMEMLIMIT" not in env()
    assert env("etcd.goMemLimit=400MiB")["GOMEMLIMIT"] == "400MiB"


def test_etcd_flags_exist_in_etcd() -> None:
    etcd = shutil.which("etcd")
    assert etcd, "etcd not on PATH (scripts/bootstrap.sh installs etcd-server)"
    help_text = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=30, check=False)
    known = help_text.stdout + help_text.stderr
    for files in [(), ("etcd-3-values.yaml",)]:
        c = container(render(files).find("StatefulSet", name("etcd")), "etcd")
        for key in eq_flags(c["args"]):
            assert f"--{key} " in known, f"etcd has no flag --{key}"


# --- probes, placement, resources, volumes ----------------------------------------------------

@pytest.mark.parametrize("files", VALUE_SETS, ids=IDS)
def test_probes(files: tuple[str, ...]) -> None:
    r = render(files, api_versions=(MONITORING_API,))
    ms = container(r.find("Deployment", name("metaserver")), "metaserver")
    grpc_port = _named_port(ms, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if _values(files)["security"]["tls"]["enabled"]:
            # The kubelet's grpc probe cannot do TLS: an exec health check (test_security.py).
            script = ms[probe]["exec"]["command"][-1]
            assert f'"127.0.0.1:{grpc_port}"' in script and 'HealthCheckRequest(service="")' in script, probe
            continue
        assert ms[probe]["grpc"]["port"] == grpc_port, probe
        assert ms[probe]["grpc"].get("service", "") == ""   # "" is SERVING once the index is loaded
    eng = container(r.find("StatefulSet", name("engine")), "engine")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert eng[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert _named_port(eng, "http") == int(flag(eng["args"], "--port"))
    if r.has("StatefulSet", name("etcd")):
        etcd = container(r.find("StatefulSet", name("etcd")), "etcd")
        assert etcd["readinessProbe"]["httpGet"]["path"] == "/health"
        assert "livenessProbe" in etcd


def test_engine_pods_one_per_node() -> None:
    r = render()
    sts = r.find("StatefulSet", name("engine"))
    (term,) = pod_spec(sts)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert selects(term["labelSelector"]["matchLabels"], _pod_labels(sts))
    # The metaserver only prefers spreading (2 replicas may share a small cluster's node).
    ms = pod_spec(r.find("Deployment", name("metaserver")))["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in ms


def test_host_network_sets_dns_policy() -> None:
    on = pod_spec(render(("gpu-rdma-values.yaml",)).find("StatefulSet", name("engine")))
    assert on["hostNetwork"] is True and on["dnsPolicy"] == "ClusterFirstWithHostNet"
    off = pod_spec(render().find("StatefulSet", name("engine")))
    assert "hostNetwork" not in off and "dnsPolicy" not in off
    only = pod_spec(render((), ("engine.hostNetwork=true",)).find("StatefulSet", name("engine")))
    assert only["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_gpu_and_rdma_resources_from_values() -> None:
    r = render(("gpu-rdma-values.yaml",))
    c = container(r.find("StatefulSet", name("engine")), "engine")
    assert c["resources"]["limits"] == {"memory": "120Gi", "nvidia.com/gpu": 1, "rdma/rdma_shared_device_a": 1}
    assert c["resources"]["requests"] == {"cpu": "8", "memory": "96Gi"}
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    custom = container(render((), ("engine.gpu.enabled=true", "engine.gpu.resourceName=amd.com/gpu",
                                   "engine.gpu.count=2", "engine.rdma.enabled=true",
                                   "engine.rdma.resourceName=rdma/hca")).find("StatefulSet", name("engine")), "engine")
    assert custom["resources"] == {"limits": {"amd.com/gpu": 2, "rdma/hca": 1}}
    plain = container(render().find("StatefulSet", name("engine")), "engine")
    assert "resources" not in plain and "securityContext" not in plain


def test_shm_and_model_volumes() -> None:
    default = pod_spec(render().find("StatefulSet", name("engine")))
    (shm,) = [v for v in default["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in default["containers"][0]["volumeMounts"]
    assert not [v for v in default["volumes"] if v["name"] == "model"]

    gpu = pod_spec(render(("gpu-rdma-values.yaml",)).find("StatefulSet", name("engine")))
    (model,) = [v for v in gpu["volumes"] if v["name"] == "model"]
    assert model["persistentVolumeClaim"] == {"claimName": "llm-models", "readOnly": True}
    (mount,) = [m for m in gpu["containers"][0]["volumeMounts"] if m["name"] == "model"]
    assert flag(gpu["containers"][0]["args"], "--model").startswith(mount["mountPath"] + "/")
    assert next(v for v in gpu["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "16Gi"

    host = pod_spec(render((), ("engine.modelVolume.type=hostPath", "engine.modelVolume.hostPath=/data/models"))
                    .find("StatefulSet", name("engine")))
    (model,) = [v for v in host["volumes"] if v["name"] == "model"]
    assert model["hostPath"] == {"path": "/data/models", "type": "Directory"}


def test_prestop_drains_this_node_with_the_real_admin_cli() -> None:
    r = render()
    c = container(r.find("StatefulSet", name("engine")), "engine")
    shell, dash_c, script = c["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, dash_c) == ("/bin/sh", "-c")
    words = [w.replace("$POD_NAME", ENGINE_POD) for w in shlex.split(script)]
    assert words[0] == "kvpool"
    assert "POD_NAME" in {e["name"] for e in c["env"]}
    args = build_parser().parse_args(words[1:])
    assert (args.cmd, args.admin_cmd) == ("admin", "drain")
    assert args.node == ENGINE_POD
    assert args.metaserver == flag(c["args"], "--metaserver")


# --- ConfigMap and its checksum ---------------------------------------------------------------

def _configmap_text(files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> str:
    """The ConfigMap as templates/configmap.yaml renders it (without helm's Source header)."""
    text = render_text(files, sets)
    (doc,) = [d for d in text.split("---\n") if d.startswith("# Source: kvpool/templates/configmap.yaml")]
    return doc.split("\n", 1)[1].rstrip("\n")


def _checksums(r: Rendered) -> set[str]:
    return {w["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for w in (r.find("Deployment", name("metaserver")), r.find("StatefulSet", name("engine")))}


def test_checksum_is_the_configmap_sha256() -> None:
    (checksum,) = _checksums(render())
    # helm prints a template's output with surrounding newlines trimmed; `include` keeps them.
    text = _configmap_text()
    assert checksum in {hashlib.sha256(f"{head}{text}{tail}".encode()).hexdigest()
                        for head in ("", "\n") for tail in ("", "\n")}


@pytest.mark.parametrize("setting", ["logLevel=DEBUG", "engine.transferEngineEnv.MC_GID_INDEX=3"])
def test_config_change_rolls_pods(setting: str) -> None:
    before, after = render(), render((), (setting,))
    assert _checksums(before) != _checksums(after)
    assert len(_checksums(after)) == 1


def test_checksum_stable_when_config_unchanged() -> None:
    assert _checksums(render()) == _checksums(render((), ("engine.replicas=5",)))


def test_configmap_feeds_the_processes_environment() -> None:
    r = render((), ("logLevel=WARNING",))
    cm = r.find("ConfigMap", name("config"))
    assert cm["data"] == {"KVPOOL_LOG_LEVEL": "WARNING", "MC_LOG_LEVEL": "ERROR"}
    for w in (r.find("Deployment", name("metaserver")), r.find("StatefulSet", name("engine"))):
        (env_from,) = pod_spec(w)["containers"][0]["envFrom"]
        assert env_from["configMapRef"]["name"] == cm["metadata"]["name"]


def test_kvpool_reads_its_log_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_LOG_LEVEL", "WARNING")
    assert build_parser().parse_args(["admin", "--metaserver", "h:1", "stats"]).log_level == "WARNING"


# --- ServiceMonitor and helm test ------------------------------------------------------------

def test_servicemonitor_needs_the_switch_and_the_api() -> None:
    sm_name = name("engine")
    assert not render(("monitoring-values.yaml",)).has("ServiceMonitor", sm_name)
    assert not render((), api_versions=(MONITORING_API,)).has("ServiceMonitor", sm_name)
    r = render(("monitoring-values.yaml",), api_versions=(MONITORING_API,))
    sm = r.find("ServiceMonitor", sm_name)
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    targets = [s for s in r.all("Service") if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in targets] == [name("engine")]   # not twice via the headless one
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert endpoint["port"] in {p["name"] for p in targets[0]["spec"]["ports"]}


def test_helm_test_pods_check_metaserver_and_engine() -> None:
    r = render()
    tests = [p for p in r.all("Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert len(tests) == 2
    ms_test = r.find("Pod", name("test-metaserver"))
    args = build_parser().parse_args(ms_test["spec"]["containers"][0]["args"])
    assert (args.cmd, args.admin_cmd) == ("admin", "stats")
    assert args.metaserver == flag(_engine_args(r), "--metaserver")
    eng_test = r.find("Pod", name("test-engine"))
    script = eng_test["spec"]["containers"][0]["command"][-1]
    svc = r.find("Service", name("engine"))
    assert f'"http://{service_host(svc)}:{svc["spec"]["ports"][0]["port"]}/health"' in script
    compile(script, "test-engine", "exec")
    for pod in tests:
        assert pod["spec"]["restartPolicy"] == "Never"


# --- router -> engine pods, metaserver ----------------------------------------------------------

@pytest.mark.parametrize("files", [("router-values.yaml",), ("router-values.yaml", "security-values.yaml")],
                         ids=["router", "router-security"])
def test_router_reaches_every_engine_pod_and_the_index(files: tuple[str, ...]) -> None:
    """The router's command line parses with the real CLI; --nodes names every engine pod by its
    stable DNS name on the engines' port; --metaserver is the metaserver Service; its Service
    selects its pods on the port it listens on; probes hit /health; with tokens on it mounts and
    passes the node token (index queries take either) and never the admin token."""
    r = render(files)
    values = _values(files)
    dep = r.find("Deployment", name("router"))
    assert dep["spec"]["replicas"] == values["router"]["replicas"]
    c = container(dep, "router")
    args = build_parser().parse_args(c["args"])
    assert args.cmd == "router" and args.policy == values["router"]["policy"]
    assert args.load_weight == values["router"]["loadWeight"] and args.model == values["engine"]["model"]
    sts = r.find("StatefulSet", name("engine"))
    headless = r.find("Service", f"{name('engine')}-headless")
    engine_port = values["engine"]["port"]
    want = [f"http://{name('engine')}-{i}.{service_host(headless)}:{engine_port}"
            for i in range(sts["spec"]["replicas"])]
    assert args.nodes.split(",") == want and len(want) == 3
    ms = r.find("Service", name("metaserver"))
    assert args.metaserver == f"{service_host(ms)}:{ms['spec']['ports'][0]['port']}"
    svc = r.find("Service", name("router"))
    assert selects(svc["spec"]["selector"], _pod_labels(dep))
    (port,) = svc["spec"]["ports"]
    assert _named_port(c, port["targetPort"]) == int(args.listen.rsplit(":", 1)[1]) == port["port"]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    test_pod = r.find("Pod", name("test-router"))
    assert f"{service_host(svc)}:{port['port']}/health" in container(test_pod, "router-health")["command"][-1]
    tokens = values["security"]["tokens"]["enabled"]
    assert bool(args.metaserver_token_file) == tokens
    if tokens:
        mounted = mounted_secret_files(dep, "router")
        assert args.metaserver_token_file in mounted
        assert not any("admin" in path for path in mounted)
    if values["security"]["tls"]["enabled"]:
        assert args.metaserver_tls_ca


def test_a_discovering_router_reads_the_registry_the_engines_announce_in() -> None:
    """router.discover: no --nodes; --discover with the metaserver Service (also for a policy
    that does not read the index), where each engine announces http://POD_IP:PORT."""
    for policy in ("prefix", "round-robin"):
        r = render(("router-values.yaml",), sets=("router.discover=true", f"router.policy={policy}"))
        args = build_parser().parse_args(container(r.find("Deployment", name("router")), "router")["args"])
        ms = r.find("Service", name("metaserver"))
        assert args.discover and args.nodes == "" and args.policy == policy
        assert args.metaserver == f"{service_host(ms)}:{ms['spec']['ports'][0]['port']}"
        engine = build_parser().parse_args(_engine_args(r))
        assert engine.advertise_url == f"http://{FAKE_POD_IP}:{engine.port}"


def test_pd_groups_run_their_roles_behind_a_pd_router() -> None:
    """pd.enabled: a prefill StatefulSet (producers) and a decode StatefulSet (consumers), each
    with its headless Service selecting only its pods; the router runs --pd with every pod of
    each group by its stable DNS name; without the router the chart refuses to render."""
    r = render(("router-values.yaml",), sets=("pd.enabled=true", "pd.prefill.replicas=2", "pd.decode.replicas=3"))
    assert not r.has("StatefulSet", name("engine"))
    urls = {}
    for group, role, replicas in (("prefill", "producer", 2), ("decode", "consumer", 3)):
        sts = r.find("StatefulSet", f"{name('engine')}-{group}")
        assert sts["spec"]["replicas"] == replicas
        args = build_parser().parse_args(expand(container(sts, "engine"), f"{name('engine')}-{group}-0"))
        assert args.kv_role == role
        assert engine_cli.kv_transfer_config(args).kv_role == f"kv_{role}"
        headless = r.find("Service", f"{name('engine')}-{group}-headless")
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        assert selects(headless["spec"]["selector"], _pod_labels(sts))
        assert selects(sts["spec"]["selector"]["matchLabels"], _pod_labels(sts))
        urls[group] = [f"http://{name('engine')}-{group}-{i}.{service_host(headless)}:{args.port}"
                       for i in range(replicas)]
    prefill, decode = (r.find("StatefulSet", f"{name('engine')}-{g}") for g in ("prefill", "decode"))
    assert not selects(prefill["spec"]["selector"]["matchLabels"], _pod_labels(decode))
    router = build_parser().parse_args(container(r.find("Deployment", name("router")), "router")["args"])
    assert router.pd and router.nodes == ""
    assert router.prefill.split(",") == urls["prefill"] and router.decode.split(",") == urls["decode"]
    assert "pd.enabled needs router.enabled" in render_error("pd.enabled=true")


def test_router_is_off_by_default() -> None:
    r = render()
    assert not r.has("Deployment", name("router")) and not r.has("Service", name("router"))


def test_pool_disk_volume_and_flags() -> None:
    """engine.poolDisk: no disk tier by default; with a size, `--pool-disk` names the mounted
    volume (emptyDir, or each pod's own sub-directory of a hostPath / claim, which outlives
    the pod) and `--pool-disk-size` parses as the engine parses it."""
    default = pod_spec(render().find("StatefulSet", name("engine")))
    assert "--pool-disk" not in default["containers"][0]["args"]
    assert not [v for v in default["volumes"] if v["name"] == "pool-disk"]

    for sets, source in ((("engine.poolDisk.size=64GiB",), {"emptyDir": {}}),
                         (("engine.poolDisk.size=64GiB", "engine.poolDisk.type=hostPath",
                           "engine.poolDisk.hostPath=/mnt/nvme/kvpool"),
                          {"hostPath": {"path": "/mnt/nvme/kvpool", "type": "DirectoryOrCreate"}}),
                         (("engine.poolDisk.size=64GiB", "engine.poolDisk.type=persistentVolumeClaim",
                           "engine.poolDisk.claimName=kv-disk"), {"persistentVolumeClaim": {"claimName": "kv-disk"}})):
        spec = pod_spec(render((), sets).find("StatefulSet", name("engine")))
        c = spec["containers"][0]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "pool-disk"]
        assert {k: v for k, v in vol.items() if k != "name"} == source
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "pool-disk"]
        assert flag(c["args"], "--pool-disk") == mount["mountPath"]
        assert parse_size(flag(c["args"], "--pool-disk-size")) == 64 << 30
        assert mount.get("subPathExpr") == (None if "emptyDir" in source else "$(POD_NAME)")
    assert "engine.poolDisk.hostPath is required" in render_error("engine.poolDisk.size=1GiB",
                                                                  "engine.poolDisk.type=hostPath")
    assert "engine.poolDisk.size: Does not match pattern" in render_error("engine.poolDisk.size=lots")
