"""Tokens, roles and session proofs without the network; config and credential validation."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaserver import cli
from metaserver.auth import (METHOD_ACCESS, SESSION_KEY, Access, Authenticator, Role, new_session_token,
                             session_digest, session_matches)
from metaserver.client import Registration
from metaserver.config import MetaServerConfig
from metaserver.credentials import ClientSecurity, read_secret_file
from metaserver.errors import PermissionDenied, Unauthenticated
from metaserver.server import MetaServer
from metaserver.servicer import node_info
from metaserver.types import Namespace, NodeId, NodeRecord

ADMIN = "admin-token-0123456789abcdef"
NODE = "node-token-0123456789abcdef"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_every_rpc_has_an_access_rule() -> None:
    from kvpool_proto.kvpool.v1 import meta_pb2

    methods = {m.name for m in meta_pb2.DESCRIPTOR.services_by_name["MetaService"].methods}
    assert methods == set(METHOD_ACCESS)
    assert {m for m, a in METHOD_ACCESS.items() if a is Access.ADMIN} == {"Invalidate", "Drain", "Undrain"}
    assert {m for m, a in METHOD_ACCESS.items() if a is Access.QUERY} == {
        "QueryPrefix", "QueryPrefixBatch", "ReportFailedRead", "WatchIndex", "Stats", "ListNodes"}


def test_no_tokens_means_open() -> None:
    auth = Authenticator()
    assert not auth.enabled
    caller = auth.authorize((), "Invalidate")
    assert caller.role is None and caller.node_session is None  # nothing is checked later either


@pytest.mark.parametrize("metadata,match", [
    ((), "missing credentials"),
    ((("authorization", "Basic Zm9vOmJhcg=="),), "malformed"),
    ((("authorization", "Bearer"),), "malformed"),
    (bearer("not-a-known-token-at-all"), "invalid token"),
    (bearer(ADMIN[:-1]), "invalid token"),
    ((("authorization", b"Bearer \xff\xfe"),), "invalid token"),
])
def test_missing_malformed_or_unknown_token_is_unauthenticated(metadata, match: str) -> None:
    auth = Authenticator(ADMIN, NODE)
    for method in METHOD_ACCESS:
        with pytest.raises(Unauthenticated, match=match) as info:
            auth.authorize(metadata, method)
        assert method in str(info.value) and ADMIN not in str(info.value) and NODE not in str(info.value)


def test_roles() -> None:
    auth = Authenticator(ADMIN, NODE)
    for method in METHOD_ACCESS:
        admin = auth.authorize(bearer(ADMIN), method)
        assert admin.role is Role.ADMIN and admin.node_session is None  # may act for any node
    for method in ("Invalidate", "Drain", "Undrain"):
        with pytest.raises(PermissionDenied, match=f"{method} needs the admin token"):
            auth.authorize(bearer(NODE), method)
    node = auth.authorize((*bearer(NODE), (SESSION_KEY, "s3cret")), "Publish")
    assert node.role is Role.NODE and node.node_session == "s3cret"
    assert auth.authorize(bearer(NODE), "Publish").node_session == ""  # checked later: no proof
    assert auth.authorize((("authorization", f"bearer  {NODE} "),), "Stats").role is Role.NODE


def test_only_a_node_token_leaves_admin_calls_refused() -> None:
    auth = Authenticator(node_token=NODE)
    with pytest.raises(PermissionDenied):
        auth.authorize(bearer(NODE), "Drain")
    with pytest.raises(Unauthenticated):
        auth.authorize(bearer(""), "Drain")


def test_session_tokens() -> None:
    token = new_session_token()
    assert len(token) >= 40 and token != new_session_token()
    digest = session_digest(token)
    assert session_matches(digest, token)
    assert not session_matches(digest, token + "x") and not session_matches(digest, "")
    assert not session_matches(b"", token)  # a registration without a session has no proof


def test_node_records_leave_the_servicer_without_their_session_digest() -> None:
    node = NodeRecord(NodeId("n"), "h:1", 0, 64, Namespace("ns"), 7, 10, session_digest=session_digest("t"))
    assert node_info(node, 3).session_digest == b""
    assert "session_digest" not in repr(node)


@pytest.mark.parametrize("kwargs,match", [
    (dict(admin_token="short"), "at least 16"),
    (dict(node_token="has a space in it, and long"), "without spaces"),
    (dict(admin_token=ADMIN, node_token=ADMIN), "must differ"),
    (dict(tls_cert_file="server.crt"), "both a certificate and its key"),
    (dict(tls_client_ca_file="ca.crt"), "needs TLS"),
])
def test_config_validation_never_shows_a_token(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        MetaServerConfig(**kwargs)
    for key, value in kwargs.items():
        if key.endswith("_token"):
            assert value not in str(info.value)


def test_secrets_stay_out_of_reprs() -> None:
    config = MetaServerConfig(admin_token=ADMIN, node_token=NODE)
    assert config.auth and ADMIN not in repr(config) and NODE not in repr(config)
    assert NODE not in repr(ClientSecurity(token=NODE))
    assert "s3cret" not in repr(Registration(1, 10, "s3cret"))


def test_client_security_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs its key"):
        ClientSecurity("ca.crt", "client.crt")
    with pytest.raises(ValueError, match="--tls-ca"):
        ClientSecurity(tls_cert_file="c", tls_key_file="k")
    with pytest.raises(ValueError, match="cannot read the TLS CA file"):
        ClientSecurity(str(tmp_path / "missing.crt")).channel_credentials()
    (tmp_path / "token").write_text(f"  {NODE}\n")
    assert ClientSecurity.from_files(token_file=str(tmp_path / "token")).call_metadata() == bearer(NODE)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_secret_file(str(tmp_path / "empty"), "token")


def _metaserver_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["metaserver", *argv])


def test_metaserver_cli_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(_metaserver_args("--admin-token-file", str(tmp_path / "nope"))) == 2
    err = capsys.readouterr().err
    assert "cannot read the admin token file" in err and "Traceback" not in err
    monkeypatch.setenv(cli.NODE_TOKEN_ENV, "short")
    assert cli.main(_metaserver_args()) == 2
    assert "node token must be at least 16" in capsys.readouterr().err
    monkeypatch.setenv(cli.NODE_TOKEN_ENV, NODE)
    args = _metaserver_args()
    assert cli._token(args.node_token_file, cli.NODE_TOKEN_ENV, "node token") == NODE
    (tmp_path / "admin").write_text(ADMIN + "\n")
    assert cli._token(str(tmp_path / "admin"), cli.ADMIN_TOKEN_ENV, "admin token") == ADMIN


@pytest.mark.parametrize("content", [None, "not a certificate\n"], ids=["missing", "garbage"])
def test_unusable_tls_files_fail_at_start(tmp_path: Path, content: str | None) -> None:
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    if content is not None:
        cert.write_text(content)
        key.write_text(content)
    server = MetaServer(MetaServerConfig(listen="127.0.0.1:0", tls_cert_file=str(cert), tls_key_file=str(key)))
    try:
        with pytest.raises(OSError):  # the CLI prints it on one line and exits 1
            server.start()
    finally:
        server.loop.close()


_HEADER = st.one_of(st.text(max_size=60), st.binary(max_size=60),
                    st.sampled_from([f"Bearer {ADMIN}", f"bearer {NODE}", "Bearer ", "Bearer  x"]))


@settings(max_examples=200, deadline=None, database=None)
@given(metadata=st.lists(st.tuples(st.sampled_from(["authorization", SESSION_KEY, "x-other"]), _HEADER), max_size=4),
       method=st.sampled_from(sorted(METHOD_ACCESS)))
def test_any_metadata_gives_a_caller_or_a_clear_refusal(metadata: list, method: str) -> None:
    auth = Authenticator(ADMIN, NODE)
    try:
        caller = auth.authorize(metadata, method)
    except (Unauthenticated, PermissionDenied) as err:
        assert str(err) and ADMIN not in str(err) and NODE not in str(err)
        return
    assert caller.role in (Role.ADMIN, Role.NODE)
    if caller.role is Role.NODE:
        assert METHOD_ACCESS[method] is not Access.ADMIN and isinstance(caller.node_session, str)
