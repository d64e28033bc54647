"""A TCP proxy on 127.0.0.1 that can cut its link as a network partition would (`kvpool
bench chaos`: between a node and a metaserver replica), without root tools (no iptables, tc
or network namespaces).

    proxy = TcpProxy("127.0.0.1:2379").start()   # clients connect to proxy.address
    proxy.blackhole()                             # the partition starts
    proxy.heal()                                  # and ends

Modes:
  forward    bytes go both ways; an end closed or reset on one side is passed on (FIN as
             FIN, an error as RST), an upstream that refuses the connection resets the client.
  blackhole  nothing goes through and nothing is closed: the proxy stops reading and writing
             every connection, so bytes wait in the sockets' buffers (then in the sender's,
             once those are full) and both peers see only timeouts, never an RST or a FIN.
             New connections are accepted (the kernel completes the handshake of a listening
             socket anyway) but not connected upstream.

Why hold, not drop, and what `heal()` does: a partition drops packets, and TCP retransmits
them; a partition shorter than TCP's retransmission budget (minutes) ends with every held
byte delivered, in order, on the same connections. So at the heal the connections pick up
where they stopped: bytes held during the blackhole are delivered (a request the client
already gave up on reaches the server late, as it would), ends closed meanwhile are passed
on, and connections accepted during the blackhole are connected upstream then, as a SYN
retransmitted after the heal would be. Dropping bytes on a live connection would make a
stream with a hole in it, which TCP never delivers. (A partition longer than the peers'
timeouts ends in resets; not modelled: the chaos nemesis's partitions last seconds.)

Threading: one selector thread per proxy does all the I/O; `blackhole`, `heal` and `close`
may be called from any thread and return once the I/O thread applied them, so no byte passes
after `blackhole()` returns.
"""
from __future__ import annotations

import errno
import selectors
import socket
import struct
import threading

from kvpool_harness.processes import free_port

FORWARD, BLACKHOLE = "forward", "blackhole"
_BUF_MAX = 1 << 20   # bytes read ahead per direction before the proxy stops reading that side
_CHUNK = 1 << 16


class _Pair:
    """One client connection and its upstream one, with the bytes read but not yet written."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None   # None until connected (held during a blackhole)
        self.connecting = False
        self.to_up = bytearray()
        self.to_client = bytearray()
        self.eof = {"client": False, "upstream": False}      # that side sent FIN
        self.shut = {"client": False, "upstream": False}     # FIN passed on to that side


class TcpProxy:
    """Listens on 127.0.0.1 (`port`, default a free one) and forwards each connection to
    `upstream` (HOST:PORT). See the module doc for the modes."""

    def __init__(self, upstream: str, port: int | None = None) -> None:
        host, _, up_port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(up_port))
        self.port = port or free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port), backlog=128)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._pairs: list[_Pair] = []
        self._masks: dict[socket.socket, int] = {}
        self._cond = threading.Condition()
        self._mode = FORWARD
        self._wanted = self._applied = 0   # mode changes asked for / applied by the I/O thread
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy-{self.port}", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def blackhole(self) -> None:
        """Stop every byte, open no connection upstream; returns once in effect."""
        self._set(BLACKHOLE)

    def heal(self) -> None:
        """Back to forward: held bytes go on, held connections are connected upstream."""
        self._set(FORWARD)

    def close(self) -> None:
        """Stop the I/O thread and close every socket (idempotent)."""
        with self._cond:
            self._closing = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(10)
        else:  # never started: nothing but the listener and the wake-up pair to close
            self._close_all()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the I/O thread ------------------------------------------------------------

    def _set(self, mode: str, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._mode = mode
            self._wanted += 1
            want = self._wanted
        self._wake()
        with self._cond:
            if not self._cond.wait_for(lambda: self._applied >= want or not self._thread.is_alive(), timeout_s):
                raise TimeoutError(f"tcp proxy {self.address}: mode {mode} not applied within {timeout_s:g}s")

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed, or its buffer full of wake-ups already: the thread wakes anyway
            pass

    def _run(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    mode, seq = self._mode, self._wanted
                if mode == FORWARD:
                    for p in list(self._pairs):
                        if p.upstream is None:
                            self._connect(p)
                self._refresh(mode)
                with self._cond:  # from here on, only what `mode` allows happens
                    self._applied = seq
                    self._cond.notify_all()
                for key, events in self._sel.select():
                    self._handle(key.fileobj, events, mode)  # type: ignore[arg-type]
        finally:
            self._close_all()
            with self._cond:
                self._cond.notify_all()

    def _handle(self, sock: socket.socket, events: int, mode: str) -> None:
        if sock is self._wake_r:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
            return
        if sock is self._listener:
            self._accept(mode)
            return
        pair = next((p for p in self._pairs if sock is p.client or sock is p.upstream), None)
        if pair is None:  # closed by an earlier event of this round
            return
        try:
            if sock is pair.upstream and pair.connecting:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, "upstream connect failed")
                pair.connecting = False
                self._pass_eof(pair)
                return
            side = "client" if sock is pair.client else "upstream"
            if events & selectors.EVENT_READ:
                data = sock.recv(_CHUNK)
                if data:
                    (pair.to_up if side == "client" else pair.to_client).extend(data)
                else:
                    pair.eof[side] = True
            if events & selectors.EVENT_WRITE:
                buf = pair.to_client if side == "client" else pair.to_up
                del buf[:sock.send(buf)]
            self._pass_eof(pair)
        except OSError:
            self._drop(pair, reset=True)

    def _accept(self, mode: str) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of descriptors: the connection waits in the backlog
                return
            client.setblocking(False)
            pair = _Pair(client)
            self._pairs.append(pair)
            if mode == FORWARD:
                self._connect(pair)

    def _connect(self, pair: _Pair) -> None:
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        pair.upstream = up
        err = up.connect_ex(self.upstream)
        if err in (0, errno.EINPROGRESS):
            pair.connecting = err != 0
        else:
            self._drop(pair, reset=True)

    def _pass_eof(self, pair: _Pair) -> None:
        """A side that sent FIN, once its bytes are written on: FIN to the other side; both
        done: the pair is closed."""
        for side, other, buf in (("client", "upstream", pair.to_up), ("upstream", "client", pair.to_client)):
            dest = pair.upstream if other == "upstream" else pair.client
            if pair.eof[side] and not buf and not pair.shut[other] and dest is not None and not pair.connecting:
                dest.shutdown(socket.SHUT_WR)
                pair.shut[other] = True
        if pair.shut["client"] and pair.shut["upstream"]:
            self._drop(pair, reset=False)

    def _refresh(self, mode: str) -> None:
        """Each socket's interest for the next select: none in a blackhole."""
        for p in self._pairs:
            for sock, mask in self._interest(p, mode):
                if self._masks.get(sock, 0) == mask:
                    continue
                if not mask:
                    self._sel.unregister(sock)
                    del self._masks[sock]
                elif sock in self._masks:
                    self._sel.modify(sock, mask)
                    self._masks[sock] = mask
                else:
                    self._sel.register(sock, mask)
                    self._masks[sock] = mask

    @staticmethod
    def _interest(p: _Pair, mode: str) -> list[tuple[socket.socket, int]]:
        R, W = selectors.EVENT_READ, selectors.EVENT_WRITE
        if mode == BLACKHOLE:
            return [(s, 0) for s in (p.client, p.upstream) if s is not None]
        client = (R if not p.eof["client"] and len(p.to_up) < _BUF_MAX else 0) | (W if p.to_client else 0)
        out = [(p.client, client)]
        if p.upstream is not None:
            up = W if p.connecting else \
                (R if not p.eof["upstream"] and len(p.to_client) < _BUF_MAX else 0) | (W if p.to_up else 0)
            out.append((p.upstream, up))
        return out

    def _drop(self, pair: _Pair, reset: bool) -> None:
        """Close both sockets of `pair`; `reset`: with RST (an error passed on), not FIN."""
        if pair in self._pairs:
            self._pairs.remove(pair)
        for sock in (pair.client, pair.upstream):
            if sock is None:
                continue
            if sock in self._masks:
                self._sel.unregister(sock)
                del self._masks[sock]
            if reset:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            sock.close()

    def _close_all(self) -> None:
        if self._sel.get_map() is None:  # closed already
            return
        for p in list(self._pairs):
            self._drop(p, reset=False)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()
