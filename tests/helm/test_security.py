"""The chart's security settings: metaserver TLS (optionally mutual) and bearer tokens, the
engines' API key.

Secrets are chart-generated or referenced by name, mounted read-only (mode 0400) as files,
and every flag that names a credential — parsed by the real `kvpool` parsers — points at a
file the pod really has, and the pod has no credential file nothing reads. No secret value
reaches args, env, a ConfigMap or NOTES. Generated Secrets survive upgrades (`lookup`, tried
against a fake API server). With the chart's own certificates and tokens, a real metaserver
runs from the rendered command line, and its TLS probe, the engines' connector credentials,
the preStop drain and the `helm test` command all work against it.
"""
from __future__ import annotations

import ast
import base64
import dataclasses
import json
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpool_cli import serve as engine_cli
from kvpool_cli.main import build_parser
from kvpool_harness.engine_node import read_api_key
from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from metaserver.auth import check_token
from metaserver.client import MetaClient
from metaserver.credentials import ClientSecurity
from metaserver.errors import PermissionDenied
from tests.helm.chart import (
    CI_VALUES,
    FAKE_POD_IP,
    KUBE_VERSION,
    NAMESPACE,
    Manifest,
    Rendered,
    container,
    expand,
    flag,
    mounted_secret_files,
    name,
    pod_spec,
    render,
    render_error,
    render_text,
    run_helm,
    service_host,
    template_args,
)

ENGINE_POD = f"{name('engine')}-0"
METASERVER_POD = f"{name('metaserver')}-7d9c-x2x"
SEC = ("security-values.yaml",)
# The same features with the user's own Secrets (and their own key names).
EXISTING = ("security.tls.enabled=true", "security.tls.existingSecret=ms-cert", "security.tls.mutual=true",
            "security.tls.clientExistingSecret=client-cert", "security.tokens.enabled=true",
            "security.tokens.existingSecret=pool-tokens", "security.tokens.adminTokenKey=admin",
            "security.tokens.nodeTokenKey=node", "engine.apiKey.enabled=true",
            "engine.apiKey.existingSecret=openai-key", "engine.apiKey.key=key.txt")
MODES = {"generated": (SEC, ()), "existing": ((), EXISTING)}
# What each credential file must be: (Secret, key).
EXPECTED = {
    "generated": {"server_cert": (name("metaserver-tls"), "tls.crt"), "server_key": (name("metaserver-tls"), "tls.key"),
                  "ca": (name("metaserver-tls"), "ca.crt"), "client_cert": (name("client-tls"), "tls.crt"),
                  "client_key": (name("client-tls"), "tls.key"), "client_ca": (name("client-tls"), "ca.crt"),
                  "admin_token": (name("tokens"), "admin-token"), "node_token": (name("tokens"), "node-token"),
                  "api_key": (name("api-key"), "api-key")},
    "existing": {"server_cert": ("ms-cert", "tls.crt"), "server_key": ("ms-cert", "tls.key"), "ca": ("ms-cert", "ca.crt"),
                 "client_cert": ("client-cert", "tls.crt"), "client_key": ("client-cert", "tls.key"),
                 "client_ca": ("client-cert", "ca.crt"), "admin_token": ("pool-tokens", "admin"),
                 "node_token": ("pool-tokens", "node"), "api_key": ("openai-key", "key.txt")},
}
FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--tls-ca", "--admin-token-file", "--node-token-file",
              "--token-file", "--api-key-file")
CONNECTOR_FILE_KEYS = ("metaserver_tls_ca", "metaserver_tls_cert", "metaserver_tls_key", "metaserver_token_file")


def _render(mode: str) -> Rendered:
    files, sets = MODES[mode]
    return render(files, sets)


def _metaserver(r: Rendered) -> Manifest:
    return r.find("Deployment", name("metaserver"))


def _engine(r: Rendered) -> Manifest:
    return r.find("StatefulSet", name("engine"))


def _admin_test_pod(r: Rendered) -> Manifest:
    return r.find("Pod", name("test-metaserver"))


def _prestop_words(r: Rendered) -> list[str]:
    """The engine's preStop command as the shell splits it ($POD_NAME expanded)."""
    shell, dash_c, script = container(_engine(r), "engine")["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, dash_c) == ("/bin/sh", "-c")
    words = [w.replace("$POD_NAME", ENGINE_POD) for w in shlex.split(script)]
    assert words[0] == "kvpool"
    return words[1:]


def _probe_security(probe: Manifest) -> tuple[dict[str, str], str, float]:
    """The exec probe's script: ClientSecurity's keyword arguments, the target and the
    deadline (read from the source, which must compile)."""
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "-c"] and len(command) == 3, command
    tree = ast.parse(command[2])
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr: n
             for n in ast.walk(tree) if isinstance(n, ast.Call)}
    kwargs = {k.arg: ast.literal_eval(k.value) for k in calls["ClientSecurity"].keywords}
    (target,) = [ast.literal_eval(a) for a in calls["channel"].args]
    (deadline,) = [ast.literal_eval(k.value) for k in calls["Check"].keywords if k.arg == "timeout"]
    return kwargs, target, deadline


def _metaserver_port(r: Rendered) -> int:
    (port,) = [p["containerPort"] for p in container(_metaserver(r), "metaserver")["ports"] if p["name"] == "grpc"]
    return port


# --- security off: nothing changes ------------------------------------------------------------

@pytest.mark.parametrize("files", [(), ("external-etcd-values.yaml",), ("gpu-rdma-values.yaml",),
                                   ("monitoring-values.yaml",), ("etcd-3-values.yaml",)],
                         ids=["default", "external-etcd", "gpu-rdma", "monitoring", "etcd-3"])
def test_security_off_adds_no_secret_mount_or_flag(files: tuple[str, ...]) -> None:
    r = render(files)
    assert not r.all("Secret")
    assert "/etc/kvpool" not in render_text(files)
    for workload in (_metaserver(r), _engine(r), _admin_test_pod(r)):
        assert not [v for v in pod_spec(workload).get("volumes", []) if "secret" in v]
    for args in (container(_metaserver(r), "metaserver")["args"], container(_engine(r), "engine")["args"],
                 container(_admin_test_pod(r), "admin-stats")["args"], _prestop_words(r)):
        assert not set(args) & set(FILE_FLAGS), args
    extra = json.loads(flag(container(_engine(r), "engine")["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert not set(extra) & set(CONNECTOR_FILE_KEYS)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" in container(_metaserver(r), "metaserver")[probe]


def test_security_settings_without_the_switches_change_nothing() -> None:
    inert = ("security.tls.generated.validityDays=30", "security.tokens.adminTokenKey=a",
             "security.tokens.nodeTokenKey=n", "engine.apiKey.key=k")
    assert render_text((), inert) == render_text()


# --- Secrets ----------------------------------------------------------------------------------

def test_generated_secrets() -> None:
    r = render(SEC)
    secrets = {s["metadata"]["name"]: s for s in r.all("Secret")}
    assert sorted(secrets) == sorted([name("metaserver-tls"), name("client-tls"), name("tokens"), name("api-key")])
    values = {n: {k: base64.b64decode(v).decode() for k, v in s["data"].items()} for n, s in secrets.items()}
    for tls in (name("metaserver-tls"), name("client-tls")):
        assert secrets[tls]["type"] == "kubernetes.io/tls"
        assert set(values[tls]) == {"tls.crt", "tls.key", "ca.crt"}
        assert values[tls]["tls.crt"].startswith("-----BEGIN CERTIFICATE-----")
        assert values[tls]["ca.crt"].startswith("-----BEGIN CERTIFICATE-----")
        assert "PRIVATE KEY-----" in values[tls]["tls.key"]
    # The server certificate is issued for the names clients dial (the e2e test below proves it).
    dns = secrets[name("metaserver-tls")]["metadata"]["annotations"]["kvpool.io/dns-names"].split(",")
    assert service_host(r.find("Service", name("metaserver"))) in dns
    tokens = values[name("tokens")]
    assert set(tokens) == {"admin-token", "node-token"}
    for token in tokens.values():
        check_token(token, "token")   # what the metaserver accepts
        assert len(token) >= 32
    assert tokens["admin-token"] != tokens["node-token"]
    assert len(values[name("api-key")]["api-key"]) >= 32
    assert secrets[name("api-key")]["type"] == secrets[name("tokens")]["type"] == "Opaque"
    # Each render generates afresh (lookup finds nothing offline): nothing is a fixed default.
    again = {s["metadata"]["name"]: s["data"] for s in render(SEC, ("logLevel=DEBUG",)).all("Secret")}
    assert again[name("tokens")] != secrets[name("tokens")]["data"]


def test_existing_secrets_are_referenced_not_generated() -> None:
    r = _render("existing")
    assert not r.all("Secret")
    referenced = {v["secret"]["secretName"] for w in (_metaserver(r), _engine(r), _admin_test_pod(r))
                  for v in pod_spec(w).get("volumes", []) if "secret" in v}
    assert referenced == {"ms-cert", "client-cert", "pool-tokens", "openai-key"}


@pytest.mark.parametrize("mode", MODES)
def test_secured_manifests_validate_strict(mode: str) -> None:
    for doc in _render(mode).docs:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({mode}): {err.message} at {list(err.path)}")


# --- every credential flag points at a mounted file ------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_metaserver_command_line_reads_its_credentials_from_mounted_files(mode: str) -> None:
    r, want = _render(mode), EXPECTED[mode]
    files = mounted_secret_files(_metaserver(r), "metaserver")
    args = build_parser().parse_args(expand(container(_metaserver(r), "metaserver"), METASERVER_POD))
    assert args.cmd == "metaserver"
    read = {"server_cert": args.tls_cert, "server_key": args.tls_key, "client_ca": args.tls_client_ca,
            "admin_token": args.admin_token_file, "node_token": args.node_token_file}
    for what, path in read.items():
        assert files.get(path) == want[what], (what, path, files)
    # The probes read the CA and the client certificate (mutual TLS); nothing else is mounted.
    probe_files = {"ca": want["ca"], "client_cert": want["client_cert"], "client_key": want["client_key"]}
    kwargs, _, _ = _probe_security(container(_metaserver(r), "metaserver")["readinessProbe"])
    for what, key in (("ca", "tls_ca_file"), ("client_cert", "tls_cert_file"), ("client_key", "tls_key_file")):
        assert files.get(kwargs[key]) == probe_files[what], (what, kwargs)
    assert set(files) == set(read.values()) | {kwargs["tls_ca_file"], kwargs["tls_cert_file"], kwargs["tls_key_file"]}


@pytest.mark.parametrize("mode", MODES)
def test_engine_command_line_reads_its_credentials_from_mounted_files(mode: str) -> None:
    r, want = _render(mode), EXPECTED[mode]
    files = mounted_secret_files(_engine(r), "engine")
    args = build_parser().parse_args(expand(container(_engine(r), "engine"), ENGINE_POD))
    extra = engine_cli.kv_transfer_config(args).kv_connector_extra_config   # what `kvpool serve` builds
    read = {"ca": extra["metaserver_tls_ca"], "client_cert": extra["metaserver_tls_cert"],
            "client_key": extra["metaserver_tls_key"], "node_token": extra["metaserver_token_file"],
            "api_key": args.api_key_file}
    for what, path in read.items():
        assert files.get(path) == want[what], (what, path, files)
    # The preStop drain: the same CA and client certificate, but the admin token (Drain needs it).
    drain = build_parser().parse_args(_prestop_words(r))
    assert (drain.cmd, drain.admin_cmd, drain.node) == ("admin", "drain", ENGINE_POD)
    assert drain.metaserver == args.metaserver
    assert files.get(drain.tls_ca) == want["ca"]
    assert (files.get(drain.tls_cert), files.get(drain.tls_key)) == (want["client_cert"], want["client_key"])
    assert files.get(drain.token_file) == want["admin_token"]
    # The engine never gets the metaserver's own key, nor a file nobody reads.
    assert set(files) == set(read.values()) | {drain.token_file}


@pytest.mark.parametrize("mode", MODES)
def test_helm_test_pod_reads_its_credentials_from_mounted_files(mode: str) -> None:
    r, want = _render(mode), EXPECTED[mode]
    pod = _admin_test_pod(r)
    files = mounted_secret_files(pod, "admin-stats")
    args = build_parser().parse_args(container(pod, "admin-stats")["args"])
    assert (args.cmd, args.admin_cmd) == ("admin", "stats")
    read = {"ca": args.tls_ca, "client_cert": args.tls_cert, "client_key": args.tls_key,
            "admin_token": args.token_file}
    for what, path in read.items():
        assert files.get(path) == want[what], (what, path, files)
    assert set(files) == set(read.values())


def test_tls_without_mutual_or_tokens_mounts_only_the_ca_on_clients() -> None:
    r = render((), ("security.tls.enabled=true",))
    ca = (name("metaserver-tls"), "ca.crt")
    assert sorted(mounted_secret_files(_engine(r), "engine").values()) == [ca]
    assert sorted(mounted_secret_files(_admin_test_pod(r), "admin-stats").values()) == [ca]
    ms = mounted_secret_files(_metaserver(r), "metaserver")
    assert sorted(ms.values()) == sorted([ca, (name("metaserver-tls"), "tls.crt"), (name("metaserver-tls"), "tls.key")])
    args = build_parser().parse_args(expand(container(_metaserver(r), "metaserver"), METASERVER_POD))
    assert args.tls_client_ca == "" and args.admin_token_file == "" and args.tls_cert in ms
    kwargs, _, _ = _probe_security(container(_metaserver(r), "metaserver")["livenessProbe"])
    assert kwargs["tls_cert_file"] == kwargs["tls_key_file"] == ""
    extra = json.loads(flag(container(_engine(r), "engine")["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert set(extra) & set(CONNECTOR_FILE_KEYS) == {"metaserver_tls_ca"}
    assert [s["metadata"]["name"] for s in r.all("Secret")] == [name("metaserver-tls")]


def test_tokens_without_tls_keep_the_grpc_probes() -> None:
    r = render((), ("security.tokens.enabled=true",))
    c = container(_metaserver(r), "metaserver")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == _metaserver_port(r)   # health needs no token
    args = build_parser().parse_args(expand(c, METASERVER_POD))
    assert args.tls_cert == "" and args.admin_token_file and args.node_token_file
    assert build_parser().parse_args(_prestop_words(r)).tls_ca == ""


def test_drain_on_stop_off_keeps_the_admin_token_out_of_engines() -> None:
    r = render(SEC, ("engine.drainOnStop=false",))
    c = container(_engine(r), "engine")
    assert "lifecycle" not in c
    files = mounted_secret_files(_engine(r), "engine")
    assert (name("tokens"), "admin-token") not in files.values()
    assert (name("tokens"), "node-token") in files.values()
    assert "lifecycle" not in container(_engine(render((), ("engine.drainOnStop=false",))), "engine")


# --- probes -----------------------------------------------------------------------------------

def test_tls_probes_are_exec_health_checks_against_the_pods_own_port() -> None:
    r = render(SEC)
    c = container(_metaserver(r), "metaserver")
    svc = r.find("Service", name("metaserver"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe], probe   # the kubelet's grpc probe cannot do TLS
        kwargs, target, deadline = _probe_security(c[probe])
        assert target == f"127.0.0.1:{_metaserver_port(r)}"
        # The certificate is verified against the name clients dial, not the loopback address.
        assert kwargs["tls_server_name"] == service_host(svc)
        assert 0 < deadline < c[probe]["timeoutSeconds"], probe   # python's start-up fits too
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300


# --- no secret value outside its Secret -------------------------------------------------------

def _secret_strings(r: Rendered) -> list[str]:
    """Every generated secret, decoded and as stored (base64), plus each line of the private keys."""
    out = []
    for s in r.all("Secret"):
        for key, encoded in s["data"].items():
            if key in ("tls.crt", "ca.crt"):
                continue   # certificates are public
            value = base64.b64decode(encoded).decode()
            out += [encoded, value, *[line for line in value.splitlines() if len(line) >= 32]]
    assert len(out) > 6
    return out


def _render_with_notes(chart: Path, files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> tuple[Rendered, str]:
    proc = run_helm(*template_args(files, sets, chart=chart))
    assert proc.returncode == 0, proc.stderr
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    rendered = Rendered(tuple(d for d in docs if d["metadata"]["name"] != "notes"))
    (notes,) = [d["data"]["NOTES.txt"] for d in docs if d["metadata"]["name"] == "notes"]
    return rendered, notes


def test_no_secret_value_in_args_env_configmaps_or_notes(notes_chart: Path) -> None:
    r, notes = _render_with_notes(notes_chart, SEC)
    secrets = _secret_strings(r)
    for doc in r.docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{doc['kind']}/{doc['metadata']['name']} carries a secret value"
    leaked = [s for s in secrets if s in notes]
    assert not leaked, "NOTES.txt shows a secret value"
    # Files only: no container takes a secret through its environment.
    for doc in r.docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Pod"):
            for c in pod_spec(doc)["containers"]:
                assert all("secretKeyRef" not in e.get("valueFrom", {}) for e in c.get("env", [])), c["name"]
                assert all("secretRef" not in e for e in c.get("envFrom", [])), c["name"]
    assert set(r.find("ConfigMap", name("config"))["data"]) == {"KVPOOL_LOG_LEVEL", "MC_LOG_LEVEL"}


# --- NOTES ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_notes_tell_how_to_fetch_the_credentials(notes_chart: Path, mode: str) -> None:
    r, notes = _render_with_notes(notes_chart, *MODES[mode])
    want = EXPECTED[mode]
    tokens_secret, admin_key = want["admin_token"]
    assert (f"kubectl -n {NAMESPACE} get secret {tokens_secret} -o jsonpath='{{.data.{admin_key}}}' "
            "| base64 -d > admin.token") in notes
    assert f"get secret {want['ca'][0]} -o jsonpath='{{.data.ca\\.crt}}' | base64 -d > ca.crt" in notes
    assert f"get secret {want['client_key'][0]} -o jsonpath='{{.data.tls\\.key}}' | base64 -d > client.key" in notes
    api_secret, api_key = want["api_key"]
    escaped = api_key.replace(".", "\\.")
    assert f"get secret {api_secret} -o jsonpath='{{.data.{escaped}}}' | base64 -d > api.key" in notes
    assert 'curl -s http://127.0.0.1:8000/v1/models -H "Authorization: Bearer $(cat api.key)"' in notes
    # The admin command to run from the operator's machine parses and uses the fetched files.
    (line,) = [ln for ln in notes.splitlines() if ln.strip().startswith("kvpool admin --metaserver 127.0.0.1:")]
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert (args.tls_ca, args.tls_cert, args.tls_key, args.token_file) == ("ca.crt", "client.crt", "client.key",
                                                                           "admin.token")
    assert args.tls_server_name == service_host(r.find("Service", name("metaserver")))
    # The in-cluster checks run in an engine pod with the files mounted there.
    engine_files = mounted_secret_files(_engine(r), "engine")
    execs = [ln for ln in notes.splitlines() if f"exec {ENGINE_POD} -- kvpool admin" in ln]
    assert len(execs) == 2
    for ln in execs:
        words = shlex.split(ln)
        args = build_parser().parse_args(words[words.index("kvpool") + 1:])
        assert all(getattr(args, a) in engine_files for a in ("tls_ca", "tls_cert", "tls_key", "token_file")), ln
        assert engine_files[args.token_file] == want["node_token"]   # queries need no admin token


def test_notes_without_security_have_no_security_section(notes_chart: Path) -> None:
    _, notes = _render_with_notes(notes_chart)
    assert "\nSecurity\n" not in notes and "api.key" not in notes and "--tls-ca" not in notes


# --- values that cannot work fail clearly -----------------------------------------------------

@pytest.mark.parametrize(("sets", "message"), [
    (("security.tls.existingSecret=cert",), "security.tls.existingSecret is set but security.tls.enabled=false"),
    (("security.tls.mutual=true",), "security.tls.mutual=true needs security.tls.enabled=true"),
    (("security.tls.enabled=true", "security.tls.clientExistingSecret=c"),
     "security.tls.clientExistingSecret is set but mutual TLS is off"),
    (("security.tokens.existingSecret=t",), "security.tokens.existingSecret is set but security.tokens.enabled=false"),
    (("security.tokens.enabled=true", "security.tokens.nodeTokenKey=admin-token"),
     "security.tokens.adminTokenKey and security.tokens.nodeTokenKey must differ"),
    (("engine.apiKey.existingSecret=k",), "engine.apiKey.existingSecret is set but engine.apiKey.enabled=false"),
])
def test_contradictory_security_values_fail_clearly(sets: tuple[str, ...], message: str) -> None:
    assert message in render_error(*sets)


# --- generated Secrets survive upgrades (lookup) ----------------------------------------------

class _FakeAPIServer:
    """Just enough of the Kubernetes API for Helm's `lookup` of Secrets (`helm template
    --dry-run=server`): discovery of v1 and GET of a Secret (404 when absent)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.secrets: dict[tuple[str, str], Manifest] = {}
        self.gets: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, obj: object) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?")[0].strip("/").split("/")
                if path == ["api", "v1"]:
                    self._send(200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                         "verbs": ["get"]}]})
                    return
                if len(path) == 6 and path[:3] == ["api", "v1", "namespaces"] and path[4] == "secrets":
                    outer.gets.append(path[5])
                    if (path[3], path[5]) in outer.secrets:
                        self._send(200, outer.secrets[(path[3], path[5])])
                        return
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                 "code": 404, "message": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.kubeconfig = kubeconfig
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.server.server_address[1]}"}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))

    def store(self, r: Rendered) -> None:
        for s in r.all("Secret"):
            self.secrets[(s["metadata"]["namespace"], s["metadata"]["name"])] = s

    def render(self, *sets: str) -> Rendered:
        args = template_args(SEC, sets)
        proc = run_helm(*args, "--dry-run=server", "--kubeconfig", str(self.kubeconfig))
        assert proc.returncode == 0, proc.stderr
        return Rendered(tuple(d for d in yaml.safe_load_all(proc.stdout) if d))


@pytest.fixture
def fake_api(tmp_path: Path) -> Iterator[_FakeAPIServer]:
    api = _FakeAPIServer(tmp_path / "kubeconfig")
    api.thread.start()
    yield api
    api.server.shutdown()
    api.server.server_close()


def _data(r: Rendered) -> dict[str, dict[str, str]]:
    return {s["metadata"]["name"]: s["data"] for s in r.all("Secret")}


def test_generated_secrets_are_kept_across_upgrades(fake_api: _FakeAPIServer) -> None:
    first = fake_api.render()   # a first install: nothing to find
    assert sorted(fake_api.gets) == sorted(_data(first))
    fake_api.store(first)
    upgrade = fake_api.render("engine.replicas=3")
    assert _data(upgrade) == _data(first)
    # A certificate no longer valid for the Service's names is replaced; the rest is kept.
    moved = fake_api.render("clusterDomain=example.org")
    server, data = name("metaserver-tls"), _data(moved)
    assert data[server] != _data(first)[server]
    assert f"{name('metaserver')}.{NAMESPACE}.svc.example.org" in \
        moved.find("Secret", server)["metadata"]["annotations"]["kvpool.io/dns-names"].split(",")
    assert {k: v for k, v in data.items() if k != server} == {k: v for k, v in _data(first).items() if k != server}
    # A Secret that lost a key gets that key again, and keeps the others.
    tokens = dict(fake_api.secrets[(NAMESPACE, name("tokens"))])
    tokens["data"] = {"admin-token": tokens["data"]["admin-token"]}
    fake_api.secrets[(NAMESPACE, name("tokens"))] = tokens
    repaired = _data(fake_api.render())[name("tokens")]
    assert repaired["admin-token"] == _data(first)[name("tokens")]["admin-token"]
    assert repaired["node-token"] and repaired["node-token"] != _data(first)[name("tokens")]["node-token"]


# --- the chart's credentials against a real metaserver ----------------------------------------

def _materialize(r: Rendered, workload: Manifest, container_name: str, root: Path) -> Callable[[str], str]:
    """Writes the container's secret files (from the rendered Secrets) under `root`; returns
    the map from a path in the pod to the local file (a path the pod does not have stays as
    it is, and the program that opens it fails)."""
    secrets = {s["metadata"]["name"]: s["data"] for s in r.all("Secret")}
    files = mounted_secret_files(workload, container_name)
    for path, (secret, key) in files.items():
        local = root / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(base64.b64decode(secrets[secret][key]))
    return lambda path: str(root / path.lstrip("/")) if path in files else path


def _kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_chart_credentials_work_with_a_real_metaserver(etcd: EtcdProcess, tmp_path: Path) -> None:
    r = render(SEC)
    svc_host = service_host(r.find("Service", name("metaserver")))
    ms_c = container(_metaserver(r), "metaserver")
    in_ms = _materialize(r, _metaserver(r), "metaserver", tmp_path / "metaserver")
    # The metaserver from its rendered command line (own listen address and etcd; its files).
    args = expand(ms_c, METASERVER_POD)[1:]
    for opt in ("--listen", "--etcd"):
        i = args.index(opt)
        del args[i:i + 2]
    probe_kwargs, _, _ = _probe_security(ms_c["readinessProbe"])
    ready = ClientSecurity(in_ms(probe_kwargs["tls_ca_file"]), in_ms(probe_kwargs["tls_cert_file"]),
                           in_ms(probe_kwargs["tls_key_file"]), svc_host)
    proc = MetaserverProcess(etcd.endpoint, tmp_path / "metaserver.log", extra_args=tuple(in_ms(a) for a in args),
                             security=ready).start()
    try:
        # Its TLS probe, as the kubelet runs it in the pod.
        script = ms_c["readinessProbe"]["exec"]["command"][2]
        target = f'"127.0.0.1:{_metaserver_port(r)}"'
        assert target in script
        local_script = script.replace(target, f'"{proc.address}"')
        for path in mounted_secret_files(_metaserver(r), "metaserver"):
            local_script = local_script.replace(f'"{path}"', f'"{in_ms(path)}"')
        run = subprocess.run([sys.executable, "-c", local_script], capture_output=True, text=True, timeout=60,
                             check=False)
        assert run.returncode == 0, run.stderr
        # Control: without the client certificate the server refuses the probe (mutual TLS).
        no_cert = local_script.replace(f'"{in_ms(probe_kwargs["tls_cert_file"])}"', '""').replace(
            f'"{in_ms(probe_kwargs["tls_key_file"])}"', '""')
        assert subprocess.run([sys.executable, "-c", no_cert], capture_output=True, timeout=60,
                              check=False).returncode != 0

        # An engine node: its connector's credentials from --kv-transfer-config (as the connector
        # builds them), dialling the Service name.
        in_engine = _materialize(r, _engine(r), "engine", tmp_path / "engine")
        eng_args = build_parser().parse_args(expand(container(_engine(r), "engine"), ENGINE_POD))
        extra = engine_cli.kv_transfer_config(eng_args).kv_connector_extra_config
        node = ClientSecurity.from_files(tls_ca_file=in_engine(extra["metaserver_tls_ca"]),
                                         tls_cert_file=in_engine(extra["metaserver_tls_cert"]),
                                         tls_key_file=in_engine(extra["metaserver_tls_key"]),
                                         token_file=in_engine(extra["metaserver_token_file"]))
        with MetaClient(proc.address, security=dataclasses.replace(node, tls_server_name=svc_host)) as client:
            client.register_node(ENGINE_POD, f"{FAKE_POD_IP}:7001", 0, 1 << 20, "ns-helm", 30)
            assert ENGINE_POD in {n.node_id for n, _ in client.list_nodes()}
            with pytest.raises(PermissionDenied):   # the node token is not the admin token
                client.drain(ENGINE_POD)
        assert read_api_key(in_engine(eng_args.api_key_file))

        # The preStop hook drains that node (admin token, same TLS files), reaching this server.
        words = _prestop_words(r)
        at = words.index("--metaserver") + 1
        words[at:at + 1] = [proc.address, "--tls-server-name", svc_host]
        drain = _kvpool(*[in_engine(w) for w in words])
        assert drain.returncode == 0, drain.stderr
        assert f"node {ENGINE_POD} draining" in drain.stdout

        # `helm test`: the admin command of the test pod.
        pod = _admin_test_pod(r)
        in_pod = _materialize(r, pod, "admin-stats", tmp_path / "test-pod")
        test_args = list(container(pod, "admin-stats")["args"])
        at = test_args.index("--metaserver") + 1
        test_args[at:at + 1] = [proc.address, "--tls-server-name", svc_host]
        stats = _kvpool(*[in_pod(a) for a in test_args])
        assert stats.returncode == 0, stats.stderr
        assert f"replica            {METASERVER_POD}" in stats.stdout
    finally:
        proc.stop()
    log = (tmp_path / "metaserver.log").read_text()
    assert "TLS, client certificates required, tokens required (admin, node)" in log
    assert not [s for s in _secret_strings(r) if s in log]


def test_ci_security_values_turn_everything_on() -> None:
    values = yaml.safe_load((CI_VALUES / "security-values.yaml").read_text())
    assert values["security"]["tls"] == {"enabled": True, "mutual": True}
    assert values["security"]["tokens"]["enabled"] and values["engine"]["apiKey"]["enabled"]
