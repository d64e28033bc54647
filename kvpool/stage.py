"""Staging: another node's disk block promoted into its DRAM pool on a reader's request.

Where it sits: a pool with a disk tier serves a `StageServer` (its address is announced in
its registration as `stage_address`). The index offers a node's DISK copy to other readers
only when no DRAM copy exists and that node stages. Such a reader's `NodePool.get` sends the
hashes to the holder (`stage`), which promotes each block (disk read, validated, put into a
DRAM slot, published as DRAM) and answers where it now sits in DRAM; the reader then reads it
as any DRAM block (one-sidedly, validated against that answer). A block the holder could not
stage, or an answer that does not come within the reader's bound, is reported failed and
recomputed.

The server listens on the address peers reach the node's transfer engine at (its
`local_hostname`: 127.0.0.1 for a pool on one machine) and answers anyone who reaches it: a
request names hashes only, and the answer says where blocks sit, which the index tells every
reader anyway; what it costs the holder is disk reads (a bounded request, a thread each).

Wire format (TCP, one request per connection, little-endian): request u32 count, then count
32-byte hashes; answer count records of (u8 staged, u64 offset, u64 generation).

Threading: the server handles each connection on a daemon thread of its own; `stage` is a
blocking call for a pool thread (never the engine loop).
"""
from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

MAX_BLOCKS = 4096            # hashes per request at most
_COUNT = struct.Struct("<I")
_ANSWER = struct.Struct("<BQQ")
HASH_BYTES = 32

# What the holder does for one request: per hash, (offset, generation) of its DRAM slot now,
# or None where it could not stage the block.
StageFn = Callable[[list[bytes]], list[tuple[int, int] | None]]


class StageError(Exception):
    """A stage request got no (complete) answer."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.io_timeout_s)
        try:
            (count,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
            if not 0 < count <= MAX_BLOCKS:
                log.warning("stage request for %d blocks refused (1..%d)", count, MAX_BLOCKS)
                return
            raw = _recv_exact(sock, count * HASH_BYTES)
            hashes = [raw[i * HASH_BYTES:(i + 1) * HASH_BYTES] for i in range(count)]
            answers = self.server.stage_fn(hashes)
            sock.sendall(b"".join(_ANSWER.pack(0, 0, 0) if a is None else _ANSWER.pack(1, a[0], a[1])
                                  for a in answers))
        except OSError as err:  # the reader gave up (its bound passed) or went away
            log.info("stage request from %s not answered: %s", self.client_address, err)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], stage_fn: StageFn, io_timeout_s: float) -> None:
        self.stage_fn = stage_fn
        self.io_timeout_s = io_timeout_s
        super().__init__(address, _Handler)


class StageServer:
    """Serves stage requests on `host` (an ephemeral port) until `close`."""

    def __init__(self, stage_fn: StageFn, host: str = "127.0.0.1", io_timeout_s: float = 10.0) -> None:
        self._server = _Server((host, 0), stage_fn, io_timeout_s)
        h, port = self._server.server_address[:2]
        self.address = f"{h}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"stage-{port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def stage(address: str, hashes: Sequence[bytes], timeout_s: float) -> list[tuple[int, int] | None]:
    """Ask the holder at `address` to stage `hashes` into its DRAM; per hash, (offset,
    generation) of its DRAM slot or None. Raises StageError when no complete answer came
    within `timeout_s` (connect, send and each receive)."""
    if not 0 < len(hashes) <= MAX_BLOCKS or any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"stage 1..{MAX_BLOCKS} hashes of {HASH_BYTES} bytes")
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(_COUNT.pack(len(hashes)) + b"".join(hashes))
            raw = _recv_exact(sock, len(hashes) * _ANSWER.size)
    except (OSError, ValueError) as err:
        raise StageError(f"stage request to {address}: {err}") from err
    out: list[tuple[int, int] | None] = []
    for i in range(len(hashes)):
        ok, offset, generation = _ANSWER.unpack_from(raw, i * _ANSWER.size)
        out.append((offset, generation) if ok else None)
    return out
