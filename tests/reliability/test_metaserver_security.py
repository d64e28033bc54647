"""Metaserver security with real processes: TLS, mutual TLS, bearer tokens, node identity.

One etcd for the module; three metaserver replicas under separate key prefixes:
- `tls`:  TLS, no tokens;
- `auth`: plaintext, admin token from a file, node token from the environment;
- `mtls`: TLS with client certificates required, and both tokens.
Certificates are made per module by the `openssl` CLI (a throwaway CA, a server certificate
for IP 127.0.0.1, a client certificate, and a second CA that nobody trusts).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvpool_harness.processes import EtcdProcess, MetaserverProcess
from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from metaserver.auth import SESSION_KEY
from metaserver.client import MetaClient, NodeSession
from metaserver.credentials import ClientSecurity
from metaserver.errors import MetaError, PermissionDenied, Unauthenticated, Unavailable
from metaserver.types import BlockHash, BlockRecord

NS = "ns-security"
CAP = 1 << 20
ADMIN_TOKEN = "adm-6f1c0e8d2b7a4c5e9d3f1a2b"
NODE_TOKEN = "nod-0a9b8c7d6e5f4a3b2c1d0e9f"


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def recs(ids: range | list[int], size: int = 4096) -> list[BlockRecord]:
    return [BlockRecord(h(i), i * size, size, 1) for i in ids]


# ---- certificates ----------------------------------------------------------------------

@dataclass(frozen=True)
class Certs:
    dir: Path

    def __call__(self, name: str) -> str:
        return str(self.dir / name)


def _openssl(cwd: Path, *args: str) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _ca(d: Path, name: str) -> None:
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _leaf(d: Path, name: str, ca: str, extensions: str) -> None:
    (d / f"{name}.ext").write_text(extensions)
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "rogue-client", "other-ca", "extendedKeyUsage=clientAuth\n")
    (d / "admin.token").write_text(ADMIN_TOKEN + "\n")
    (d / "node.token").write_text(NODE_TOKEN + "\n")
    return Certs(d)


# ---- servers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path_factory.mktemp("etcd") / "etcd").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def start(etcd: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., MetaserverProcess]]:
    started: list[MetaserverProcess] = []
    logs = tmp_path_factory.mktemp("logs")

    def make(name: str, *args: str, security: ClientSecurity | None = None,
             env: dict[str, str] | None = None) -> MetaserverProcess:
        proc = MetaserverProcess(etcd.endpoint, logs / f"{name}.log", extra_args=("--key-prefix", f"/{name}/", *args),
                                 security=security, env=env).start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture(scope="module")
def tls_server(start, certs: Certs) -> MetaserverProcess:
    return start("tls", "--tls-cert", certs("server.crt"), "--tls-key", certs("server.key"),
                 security=ClientSecurity(certs("ca.crt")))


@pytest.fixture(scope="module")
def auth_server(start, certs: Certs) -> MetaserverProcess:
    return start("auth", "--admin-token-file", certs("admin.token"), env={"KVPOOL_NODE_TOKEN": NODE_TOKEN})


@pytest.fixture(scope="module")
def mtls_server(start, certs: Certs) -> MetaserverProcess:
    return start("mtls", "--tls-cert", certs("server.crt"), "--tls-key", certs("server.key"),
                 "--tls-client-ca", certs("ca.crt"), "--admin-token-file", certs("admin.token"),
                 "--node-token-file", certs("node.token"),
                 security=ClientSecurity(certs("ca.crt"), certs("client.crt"), certs("client.key")))


def refused(client: MetaClient) -> MetaError:
    with pytest.raises(MetaError) as info:
        client.stats()
    return info.value


# ---- TLS ---------------------------------------------------------------------------------

def test_tls_client_works(tls_server: MetaserverProcess, certs: Certs) -> None:
    with MetaClient(tls_server.address, security=ClientSecurity(certs("ca.crt"))) as c:
        c.register_node("tls-a", "127.0.0.1:7001", 0, CAP, NS, 30)
        assert c.publish("tls-a", recs(range(3))) == 3
        assert c.query_prefix(NS, [h(i) for i in range(4)]).num_matched == 3
        assert c.stats().etcd_healthy


def test_tls_refuses_plaintext_and_untrusting_clients(tls_server: MetaserverProcess, certs: Certs) -> None:
    for security in (None,                                                        # plaintext
                     ClientSecurity(certs("other-ca.crt")),                      # trusts another CA
                     ClientSecurity(certs("ca.crt"), tls_server_name="metaserver.example")):  # name mismatch
        with MetaClient(tls_server.address, timeout_s=0.5, security=security) as c:
            assert isinstance(refused(c), Unavailable), security
    # The system's trust store does not know the throwaway CA either.
    with grpc.secure_channel(tls_server.address, grpc.ssl_channel_credentials()) as ch:
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary("/kvpool.v1.MetaService/Stats")(b"", timeout=0.5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(mtls_server: MetaserverProcess, certs: Certs) -> None:
    good = ClientSecurity(certs("ca.crt"), certs("client.crt"), certs("client.key"), token=ADMIN_TOKEN)
    with MetaClient(mtls_server.address, security=good) as c:
        assert c.stats().etcd_healthy
    for security in (ClientSecurity(certs("ca.crt"), token=ADMIN_TOKEN),   # no certificate
                     ClientSecurity(certs("ca.crt"), certs("rogue-client.crt"), certs("rogue-client.key"),
                                    token=ADMIN_TOKEN)):                     # signed by another CA
        with MetaClient(mtls_server.address, timeout_s=0.5, security=security) as c:
            assert isinstance(refused(c), Unavailable)


def test_node_session_over_mutual_tls_with_the_node_token(mtls_server: MetaserverProcess, certs: Certs) -> None:
    node = ClientSecurity(certs("ca.crt"), certs("client.crt"), certs("client.key"), token=NODE_TOKEN)
    with MetaClient(mtls_server.address, security=node) as c:
        session = NodeSession(c, "mtls-node", "127.0.0.1:7009", 0, CAP, NS, lambda: recs(range(5)), lease_ttl_s=30)
        session.start()
        try:
            assert c.query_prefix(NS, [h(i) for i in range(5)]).num_matched == 5
            c.keepalive("mtls-node", session.registration.lease_id)  # what the session's thread does
        finally:
            session.stop()
        assert "mtls-node" not in {n.node_id for n, _ in c.list_nodes()}


# ---- tokens ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def admin(auth_server: MetaserverProcess) -> Iterator[MetaClient]:
    with MetaClient(auth_server.address, security=ClientSecurity(token=ADMIN_TOKEN)) as c:
        yield c


_node_ids = itertools.count()


@pytest.fixture
def nodes(auth_server: MetaserverProcess, admin: MetaClient) -> Iterator[tuple[MetaClient, MetaClient]]:
    """Two node clients with the shared node token; each registered its own node and
    published blocks 0..3 (node a) and 10..13 (node b)."""
    suffix = next(_node_ids)
    a_id, b_id = f"a-{suffix}", f"b-{suffix}"
    a = MetaClient(auth_server.address, security=ClientSecurity(token=NODE_TOKEN))
    b = MetaClient(auth_server.address, security=ClientSecurity(token=NODE_TOKEN))
    a.register_node(a_id, "127.0.0.1:7101", 0, CAP, NS, 60)
    b.register_node(b_id, "127.0.0.1:7102", 0, CAP, NS, 60)
    a.publish(a_id, recs(range(4)))
    b.publish(b_id, recs(range(10, 14)))
    a.node_id, b.node_id = a_id, b_id  # type: ignore[attr-defined]
    yield a, b
    for node, _ in admin.list_nodes():
        if node.node_id in (a_id, b_id):
            admin.unregister_node(node.node_id, node.lease_id)  # the admin token may, for any node
    a.close()
    b.close()


def snapshot(admin: MetaClient) -> tuple:
    s = admin.stats()
    nodes = tuple(sorted((n.node_id, n.lease_id, k, n.draining) for n, k in admin.list_nodes()))
    return s.index, s.published_blocks, nodes


def raw(address: str, method: str, request: object,
        metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(f"/kvpool.v1.MetaService/{method}", request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=lambda b: b)
        try:
            call(request, timeout=5, metadata=metadata)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details() or ""


def requests_for(node_id: str, lease_id: int) -> dict[str, object]:
    """A request per RPC that the admin token would be allowed to make."""
    return {
        "RegisterNode": pb.RegisterNodeRequest(node_id=node_id, session_address="127.0.0.1:1", capacity_bytes=CAP,
                                               layout_fingerprint=NS, lease_ttl_s=60),
        "KeepAlive": pb.KeepAliveRequest(node_id=node_id, lease_id=lease_id),
        "UnregisterNode": pb.UnregisterNodeRequest(node_id=node_id, lease_id=lease_id),
        "Publish": pb.PublishRequest(node_id=node_id, blocks=[pb.BlockRecord(block_hash=h(5), offset=0,
                                                                             size_bytes=64)]),
        "Unpublish": pb.UnpublishRequest(node_id=node_id, block_hashes=[h(0), h(10)]),
        "QueryPrefix": pb.QueryPrefixRequest(namespace=NS, block_hashes=[h(0)]),
        "Invalidate": pb.InvalidateRequest(all=True),
        "Drain": pb.DrainRequest(node_id=node_id),
        "Stats": pb.StatsRequest(),
        "ListNodes": pb.ListNodesRequest(),
    }


@pytest.mark.parametrize("metadata", [
    (),
    (("authorization", "Bearer wrong-token-but-long-enough"),),
    (("authorization", f"Basic {ADMIN_TOKEN}"),),
    (("authorization", f"Bearer {ADMIN_TOKEN}x"),),
    ((SESSION_KEY, "a-session-alone-is-no-credential"),),
], ids=["none", "unknown", "not-bearer", "near-miss", "session-only"])
def test_every_rpc_needs_a_known_token(auth_server: MetaserverProcess, admin: MetaClient, nodes, metadata) -> None:
    a, _ = nodes
    lease = next(n.lease_id for n, _ in admin.list_nodes() if n.node_id == a.node_id)
    before = snapshot(admin)
    for method, request in requests_for(a.node_id, lease).items():
        code, details = raw(auth_server.address, method, request, metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code, details)
        assert method in details and ADMIN_TOKEN not in details
        assert snapshot(admin) == before, method


def test_node_token_may_query_but_not_administer(auth_server: MetaserverProcess, admin: MetaClient, nodes) -> None:
    a, _ = nodes
    assert a.query_prefix(NS, [h(i) for i in range(5)]).num_matched == 4
    assert a.stats().index.num_copies >= 8
    assert {a.node_id} <= {n.node_id for n, _ in a.list_nodes()}
    before = snapshot(admin)
    for call in (lambda: a.invalidate(all=True), lambda: a.invalidate(node_id=a.node_id),
                 lambda: a.invalidate(namespace=NS, hashes=[h(0)]), lambda: a.drain(a.node_id)):
        with pytest.raises(PermissionDenied, match="needs the admin token"):
            call()
        assert snapshot(admin) == before


def test_a_node_acts_only_for_itself(auth_server: MetaserverProcess, admin: MetaClient, nodes) -> None:
    a, b = nodes
    lease_a = next(n.lease_id for n, _ in b.list_nodes() if n.node_id == a.node_id)  # lease ids are public
    before = snapshot(admin)
    # b holds the node token but not a's session: every call for a is refused, index unchanged.
    attempts = {
        "publish": lambda: b.publish(a.node_id, recs([7])),
        "unpublish": lambda: b.unpublish(a.node_id, [h(0)]),
        "keepalive": lambda: b.keepalive(a.node_id, lease_a),
        "unregister": lambda: b.unregister_node(a.node_id, lease_a),
        "re-register (hijack)": lambda: b.register_node(a.node_id, "127.0.0.1:6666", 0, CAP, NS, 60),
    }
    for what, call in attempts.items():
        with pytest.raises(PermissionDenied, match="only act for itself") as info:
            call()
        assert a.node_id in str(info.value), what
        assert snapshot(admin) == before, what
    # Nor does b's own session prove anything for a.
    b_session = b._sessions[b.node_id]
    code, _ = raw(auth_server.address, "Publish", requests_for(a.node_id, lease_a)["Publish"],
                  (("authorization", f"Bearer {NODE_TOKEN}"), (SESSION_KEY, b_session)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert snapshot(admin) == before
    # a itself may do all of it.
    assert a.publish(a.node_id, recs([7])) == 1
    assert a.unpublish(a.node_id, [h(7)]) == 1
    assert a.keepalive(a.node_id, lease_a) > 0


def test_re_registration_rotates_the_session(auth_server: MetaserverProcess, admin: MetaClient, nodes) -> None:
    a, _ = nodes
    old = a._sessions[a.node_id]
    reg = a.register_node(a.node_id, "127.0.0.1:7101", 0, CAP, NS, 60)  # the owner may replace it
    assert reg.session_token and reg.session_token != old
    stale = (("authorization", f"Bearer {NODE_TOKEN}"), (SESSION_KEY, old))
    code, details = raw(auth_server.address, "KeepAlive", pb.KeepAliveRequest(node_id=a.node_id, lease_id=reg.lease_id),
                        stale)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "different session token" in details
    assert a.keepalive(a.node_id, reg.lease_id) > 0
    assert a.unregister_node(a.node_id, reg.lease_id) == 0  # re-registration dropped its blocks


def test_admin_acts_for_any_node(admin: MetaClient, nodes) -> None:
    a, b = nodes
    assert admin.publish(a.node_id, recs([20, 21])) == 2  # as `kvpool admin publish --node` does
    assert admin.unpublish(b.node_id, [h(10)]) == 1
    assert admin.invalidate(namespace=NS, hashes=[h(20)]) == 1
    assert admin.drain(b.node_id) == 3
    assert [n.draining for n, _ in admin.list_nodes() if n.node_id == b.node_id] == [True]


def test_answers_never_carry_session_digests(auth_server: MetaserverProcess, nodes) -> None:
    with grpc.insecure_channel(auth_server.address) as ch:
        resp = pb.ListNodesResponse.FromString(ch.unary_unary("/kvpool.v1.MetaService/ListNodes")(
            b"", timeout=5, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),)))
    assert len(resp.nodes) >= 2 and not any(n.session_digest for n in resp.nodes)


# ---- the admin CLI, and secrets in logs and output --------------------------------------

def kvpool_admin(address: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_ADMIN_TOKEN", "KVPOOL_NODE_TOKEN")}
    return subprocess.run([sys.executable, "-m", "metaserver", "--log-level", "DEBUG", "admin", "--metaserver",
                           address, *args], capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


@pytest.mark.slow
def test_admin_cli_with_tls_and_tokens_and_no_secret_in_any_output(
        mtls_server: MetaserverProcess, auth_server: MetaserverProcess, certs: Certs, nodes) -> None:
    a, _ = nodes
    tls = ["--tls-ca", certs("ca.crt"), "--tls-cert", certs("client.crt"), "--tls-key", certs("client.key")]
    runs = [
        kvpool_admin(mtls_server.address, *tls, "--token-file", certs("admin.token"), "--json", "stats"),
        kvpool_admin(auth_server.address, "nodes", env={"KVPOOL_ADMIN_TOKEN": ADMIN_TOKEN}),
        kvpool_admin(auth_server.address, "--token-file", certs("admin.token"), "publish", "--node", a.node_id,
                     "--hash", h(30).hex(), "--offset", "0", "--size", "64"),
        kvpool_admin(auth_server.address, "stats"),                                           # no token
        kvpool_admin(auth_server.address, "--token-file", certs("node.token"), "drain", a.node_id),  # node token
        kvpool_admin(mtls_server.address, "--tls-ca", certs("ca.crt"), "--timeout", "1", "--token-file",
                     certs("admin.token"), "stats"),                                           # no client cert
        kvpool_admin(auth_server.address, "--token-file", certs("missing.token"), "stats"),
    ]
    ok_tls, ok_env, ok_publish, no_token, node_token, no_cert, missing = runs
    assert ok_tls.returncode == 0 and '"etcd_healthy": true' in ok_tls.stdout, ok_tls.stderr
    assert ok_env.returncode == 0 and a.node_id in ok_env.stdout, ok_env.stderr
    assert ok_publish.returncode == 0 and "published 1 blocks" in ok_publish.stdout, ok_publish.stderr
    assert no_token.returncode == 1 and no_token.stderr.startswith("kvpool admin: error: UNAUTHENTICATED: Stats")
    assert node_token.returncode == 1 and "PERMISSION_DENIED: Drain needs the admin token" in node_token.stderr
    assert no_cert.returncode == 3 and "unreachable" in no_cert.stderr
    assert missing.returncode == 2 and "cannot read the token file" in missing.stderr
    for r in runs:
        assert "Traceback" not in r.stderr
        for secret in (ADMIN_TOKEN, NODE_TOKEN):
            assert secret not in r.stdout and secret not in r.stderr


def test_no_secret_in_metaserver_logs(start, tls_server: MetaserverProcess, auth_server: MetaserverProcess,
                                      mtls_server: MetaserverProcess, admin: MetaClient, nodes) -> None:
    a, b = nodes
    sessions = [a._sessions[a.node_id], b._sessions[b.node_id]]
    with pytest.raises(Unauthenticated):
        with MetaClient(auth_server.address, security=ClientSecurity(token="x" * 20 + NODE_TOKEN)) as c:
            c.stats()
    admin.invalidate(node_id=a.node_id)
    for proc in (tls_server, auth_server, mtls_server):
        text = proc.log_path.read_text()
        assert "listening on" in text  # the log is the one the process writes
        for secret in (ADMIN_TOKEN, NODE_TOKEN, *sessions):
            assert secret not in text, (proc.log_path, secret[:4])
    text = auth_server.log_path.read_text()
    assert f"node {a.node_id} registered" in text and "tokens required (admin, node)" in text


@pytest.mark.slow
def test_engine_node_joins_a_mutual_tls_pool_with_its_token(mtls_server: MetaserverProcess, certs: Certs,
                                                            tmp_path: Path) -> None:
    """A real `kvpool serve --kv-connector mooncake` node, given the CA, its client
    certificate and the node token as files in --kv-transfer-config, registers and
    publishes what it computes; its log never shows the token."""
    from kvpool_harness.engine_node import EngineProcess

    extra = {"metaserver_tls_ca": certs("ca.crt"), "metaserver_tls_cert": certs("client.crt"),
             "metaserver_tls_key": certs("client.key"), "metaserver_token_file": certs("node.token")}
    log = tmp_path / "engine.log"
    node = EngineProcess(log, "tls-engine", mtls_server.address, pool_size="64MiB",
                         extra_args=("--kv-cache-bytes", "64MiB", "--threads", "1"),
                         kv_transfer_config={"kv_connector": "mooncake", "kv_connector_extra_config": extra})
    admin_security = ClientSecurity(certs("ca.crt"), certs("client.crt"), certs("client.key"), token=ADMIN_TOKEN)
    with node, MetaClient(mtls_server.address, security=admin_security) as c:
        node.wait_ready(timeout_s=300)
        node.complete(list(range(1000, 1000 + 70)), 2)  # 4 full blocks of 16 tokens
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            counts = {n.node_id: k for n, k in c.list_nodes()}
            if counts.get("tls-engine", 0) >= 4:
                break
            time.sleep(0.1)
        assert counts.get("tls-engine", 0) >= 4, counts
    text = log.read_text()
    assert "registered" in text and NODE_TOKEN not in text and ADMIN_TOKEN not in text
