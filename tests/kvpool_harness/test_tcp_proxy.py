"""`kvpool_harness.tcp_proxy`: real sockets on loopback, an upstream listener in the test.
Fast: each wait for bytes that must not come is a short socket timeout."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvpool_harness.tcp_proxy import BLACKHOLE, FORWARD, TcpProxy

QUIET_S = 0.3  # how long "nothing arrives" is watched


@pytest.fixture
def upstream() -> Iterator[socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(5)
    yield srv
    srv.close()


@pytest.fixture
def proxy(upstream: socket.socket) -> Iterator[TcpProxy]:
    with TcpProxy(f"127.0.0.1:{upstream.getsockname()[1]}") as p:
        yield p


def connect(proxy: TcpProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    s.settimeout(5)
    return s


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return out


def nothing_arrives(sock: socket.socket) -> bool:
    """No byte, no FIN and no RST within QUIET_S."""
    sock.settimeout(QUIET_S)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(5)
    return False


def no_connection(srv: socket.socket) -> bool:
    srv.settimeout(QUIET_S)
    try:
        srv.accept()[0].close()
    except TimeoutError:
        return True
    finally:
        srv.settimeout(5)
    return False


def test_forwards_both_ways_and_passes_the_end_on(proxy: TcpProxy, upstream: socket.socket) -> None:
    assert proxy.mode == FORWARD
    c = connect(proxy)
    u, _ = upstream.accept()
    c.sendall(b"ping" * 50_000)  # more than one read's worth
    assert recv_exactly(u, 200_000) == b"ping" * 50_000
    u.sendall(b"pong")
    assert recv_exactly(c, 4) == b"pong"
    c.shutdown(socket.SHUT_WR)  # half-close: the upstream sees the end, and can still answer
    assert u.recv(1) == b""
    u.sendall(b"bye")
    u.close()
    assert recv_exactly(c, 3) == b"bye" and c.recv(1) == b""
    c.close()


def test_blackhole_stops_bytes_both_ways_without_closing(proxy: TcpProxy, upstream: socket.socket) -> None:
    c = connect(proxy)
    u, _ = upstream.accept()
    proxy.blackhole()
    assert proxy.mode == BLACKHOLE
    c.sendall(b"to the server")
    u.sendall(b"to the client")
    assert nothing_arrives(u) and nothing_arrives(c)  # a timeout: no byte, no FIN, no RST
    # A new connection is accepted (the client cannot tell) but not connected upstream.
    late = connect(proxy)
    late.sendall(b"late")
    assert nothing_arrives(late) and no_connection(upstream)
    # Heal: the held bytes are delivered on the same connections, as TCP's retransmission would.
    proxy.heal()
    assert recv_exactly(u, 13) == b"to the server" and recv_exactly(c, 13) == b"to the client"
    u2, _ = upstream.accept()  # the connection made during the blackhole goes through now
    assert recv_exactly(u2, 4) == b"late"
    for s in (c, u, late, u2):
        s.close()


def test_an_end_during_the_blackhole_is_passed_on_at_the_heal(proxy: TcpProxy, upstream: socket.socket) -> None:
    c = connect(proxy)
    u, _ = upstream.accept()
    proxy.blackhole()
    c.sendall(b"last words")
    c.close()
    assert nothing_arrives(u)  # not even the FIN
    proxy.heal()
    assert recv_exactly(u, 10) == b"last words" and u.recv(1) == b""
    u.close()


def test_heal_restores_service_for_new_connections(proxy: TcpProxy, upstream: socket.socket) -> None:
    proxy.blackhole()
    proxy.heal()
    assert proxy.mode == FORWARD
    c = connect(proxy)
    u, _ = upstream.accept()
    c.sendall(b"hello")
    assert recv_exactly(u, 5) == b"hello"
    u.sendall(b"world")
    assert recv_exactly(c, 5) == b"world"
    c.close()
    u.close()


def test_an_upstream_that_is_down_closes_the_client_connection(upstream: socket.socket) -> None:
    port = upstream.getsockname()[1]
    upstream.close()  # nothing listens there now: the connect is refused
    with TcpProxy(f"127.0.0.1:{port}") as p:
        try:  # the refusal comes back as an end or a reset, possibly before connect() returns
            with connect(p) as c:
                got = c.recv(1)
        except ConnectionResetError:
            got = b""
        assert got == b""


def test_close_stops_its_thread_and_its_connections(upstream: socket.socket) -> None:
    p = TcpProxy(f"127.0.0.1:{upstream.getsockname()[1]}").start()
    c = connect(p)
    u, _ = upstream.accept()
    p.blackhole()
    p.close()
    assert not p.alive
    assert c.recv(1) == b"" and u.recv(1) == b""  # the proxy's ends are gone
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", p.port), timeout=2)
    p.close()  # idempotent
    c.close()
    u.close()
