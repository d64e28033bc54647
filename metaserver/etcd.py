"""A thin asyncio etcd v3 client over stubs generated from etcd's own protos.

Where it sits: the metaserver's durability layer (`metaserver.store`) talks to etcd only
through this module. The PyPI `etcd3` package no longer imports with current protobuf, and
the maintained asyncio clients either lose watches on disconnect or retry non-idempotent
transactions; this wrapper is small enough to get those two things right:

- every call has a deadline, and gRPC failures become `EtcdUnavailable` / `LeaseNotFound`;
- `watch_prefix` resumes from the last revision it delivered after any disconnect (telling
  the caller through `on_unavailable` first), and raises `WatchCompacted` when etcd no
  longer has that history (the caller resyncs);
- `lease_keepalive` uses one shared keepalive stream that is re-opened whenever a write or
  read on it fails (a write on a dead `grpc.aio` stream raises `asyncio.InvalidStateError`,
  not `AioRpcError`);
- `txn` is never retried: the caller decides, since a timed-out Txn may have committed.

Not thread-safe: use it from one event loop.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from kvpool_proto.etcd.etcdserverpb import rpc_pb2 as rpc
from kvpool_proto.etcd.etcdserverpb import rpc_pb2_grpc as rpc_grpc
from kvpool_proto.etcd.mvccpb import kv_pb2

log = logging.getLogger(__name__)

_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}
_RANGE_PAGE = 10_000


class EtcdError(Exception):
    """An etcd request failed for a reason other than reachability."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached (or did not answer) within the deadline."""


class LeaseNotFound(EtcdError):
    """The lease does not exist (expired or revoked)."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away; the caller must reload and re-watch."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch history compacted at revision {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    is_put: bool        # False: the key was deleted (explicitly or by lease expiry)
    key: bytes
    value: bytes        # empty for deletes
    revision: int       # mod_revision of the change
    lease: int          # the key's lease (for a delete: the lease it had before)


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    prefix: bool = False  # delete every key starting with `key`


Op = Put | Delete


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix` (etcd's range_end)."""
    buf = bytearray(prefix)
    for i in range(len(buf) - 1, -1, -1):
        if buf[i] < 0xFF:
            buf[i] += 1
            return bytes(buf[: i + 1])
    return b"\0"


def grpc_target(endpoints: Sequence[str]) -> str:
    """One gRPC target for one or more `host:port` etcd endpoints (pick_first fails over)."""
    if not endpoints:
        raise ValueError("no etcd endpoints given; pass --etcd HOST:PORT[,HOST:PORT]")
    if len(endpoints) == 1:
        return endpoints[0]
    for ep in endpoints:
        host = ep.rsplit(":", 1)[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"with several etcd endpoints, each must be IP:PORT, got {ep!r}") from None
    return "ipv4:" + ",".join(endpoints)


def _wrap(err: grpc.aio.AioRpcError, what: str) -> EtcdError:
    details = err.details() or ""
    if "lease not found" in details:
        return LeaseNotFound(f"{what}: {details}")
    if err.code() in _UNAVAILABLE_CODES:
        return EtcdUnavailable(f"{what}: {err.code().name}: {details}")
    return EtcdError(f"{what}: {err.code().name}: {details}")


class EtcdClient:
    """Async etcd v3 client; construct inside a running event loop, `await close()` at the end."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(
            grpc_target(self.endpoints),
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self._kv = rpc_grpc.KVStub(self._channel)
        self._lease = rpc_grpc.LeaseStub(self._channel)
        self._watch = rpc_grpc.WatchStub(self._channel)
        self._maint = rpc_grpc.MaintenanceStub(self._channel)
        self._ka_call: grpc.aio.StreamStreamCall | None = None
        self._ka_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._ka_call is not None:
            self._ka_call.cancel()
        await self._channel.close()

    # ---- KV -------------------------------------------------------------------------

    async def status(self) -> int:
        """The cluster's current revision; raises EtcdUnavailable if etcd does not answer."""
        try:
            resp = await self._maint.Status(rpc.StatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _wrap(err, "status") from None
        return resp.header.revision

    async def compact(self, revision: int) -> bool:
        """Compact etcd's history up to `revision` (not physically: etcd frees the pages in
        the background). False if that revision is compacted already (by etcd itself or
        another replica); raises EtcdUnavailable / EtcdError otherwise."""
        try:
            await self._kv.Compact(rpc.CompactionRequest(revision=revision), timeout=self.timeout_s * 5)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (err.details() or ""):
                return False
            raise _wrap(err, "compact") from None
        return True

    async def probe(self, key: bytes, timeout_s: float | None = None) -> int:
        """A cheap liveness check: a linearizable count-only range on `key` (it needs a leader
        and a quorum, as writes and lease renewals do). Returns the revision; raises
        EtcdUnavailable if etcd does not answer within `timeout_s` (default: the client's)."""
        req = rpc.RangeRequest(key=key, count_only=True)
        try:
            resp = await self._kv.Range(req, timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _wrap(err, "probe") from None
        return resp.header.revision

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """All keys under `prefix` at one revision, paged; returns (kvs, revision)."""
        end = prefix_end(prefix)
        key, revision, out = prefix, 0, []
        while True:
            req = rpc.RangeRequest(key=key, range_end=end, limit=_RANGE_PAGE, revision=revision)
            try:
                resp = await self._kv.Range(req, timeout=self.timeout_s * 5)
            except grpc.aio.AioRpcError as err:
                raise _wrap(err, "range") from None
            revision = revision or resp.header.revision
            out.extend(KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return out, revision
            key = resp.kvs[-1].key + b"\0"

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        return await self.txn([Put(key, value, lease)])

    async def txn(self, ops: Sequence[Op]) -> int:
        """Apply `ops` atomically (unconditional Txn); returns the new revision.

        Not retried: on EtcdUnavailable the transaction may or may not have been applied.
        """
        success = []
        for op in ops:
            if isinstance(op, Put):
                success.append(rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value, lease=op.lease)))
            else:
                end = prefix_end(op.key) if op.prefix else b""
                success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key, range_end=end)))
        try:
            resp = await self._kv.Txn(rpc.TxnRequest(success=success), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _wrap(err, "txn") from None
        return resp.header.revision

    # ---- leases ---------------------------------------------------------------------

    async def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """Grant a lease; returns (lease_id, granted_ttl_s)."""
        try:
            resp = await self._lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _wrap(err, "lease grant") from None
        if resp.error:
            raise EtcdError(f"lease grant: {resp.error}")
        return resp.ID, resp.TTL

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease (its keys are deleted). A lease that is already gone is not an error."""
        try:
            await self._lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            wrapped = _wrap(err, "lease revoke")
            if not isinstance(wrapped, LeaseNotFound):
                raise wrapped from None

    async def lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; returns its TTL. Raises LeaseNotFound if it expired."""
        async with self._ka_lock:
            for attempt in range(2):
                try:
                    if self._ka_call is None:
                        self._ka_call = self._lease.LeaseKeepAlive()
                    await asyncio.wait_for(self._ka_call.write(rpc.LeaseKeepAliveRequest(ID=lease_id)), self.timeout_s)
                    resp = await asyncio.wait_for(self._ka_call.read(), self.timeout_s)
                    if resp is grpc.aio.EOF:
                        raise EtcdUnavailable("lease keepalive stream closed")
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError, EtcdUnavailable) as err:
                    self._ka_call.cancel()
                    self._ka_call = None
                    if attempt == 1:
                        raise EtcdUnavailable(f"lease keepalive: {err!r}") from None
                    continue
                if resp.TTL <= 0:
                    raise LeaseNotFound(f"lease {lease_id:x} not found")
                return resp.TTL
        raise AssertionError("unreachable")

    # ---- watch ----------------------------------------------------------------------

    async def watch_prefix(self, prefix: bytes, start_revision: int, retry_s: float = 0.2,
                           on_unavailable: Callable[[EtcdUnavailable], None] | None = None,
                           ) -> AsyncIterator[list[WatchEvent]]:
        """Yield batches of changes under `prefix` from `start_revision` on, forever.

        Survives disconnects by re-watching from the revision after the last one delivered;
        before each retry after a failure that means etcd is unreachable, `on_unavailable` is
        called with it (on this loop). Raises WatchCompacted if that revision is no longer
        available.
        """
        next_rev = start_revision
        while True:
            call = self._watch.Watch()
            try:
                create = rpc.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix),
                                                start_revision=next_rev, prev_kv=True)
                await call.write(rpc.WatchRequest(create_request=create))
                async for resp in call:
                    if resp.compact_revision:
                        raise WatchCompacted(resp.compact_revision)
                    if resp.canceled:
                        raise EtcdError(f"watch canceled: {resp.cancel_reason}")
                    if not resp.events:
                        continue
                    batch = [
                        WatchEvent(ev.type == kv_pb2.Event.PUT, ev.kv.key, ev.kv.value, ev.kv.mod_revision,
                                   ev.kv.lease if ev.type == kv_pb2.Event.PUT else ev.prev_kv.lease)
                        for ev in resp.events
                    ]
                    next_rev = batch[-1].revision + 1
                    yield batch
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
                log.warning("etcd watch on %r broke (%s); resuming from revision %d", prefix, err, next_rev)
                # A write on a dead stream raises InvalidStateError: etcd is gone as well.
                wrapped = (_wrap(err, "watch") if isinstance(err, grpc.aio.AioRpcError)
                           else EtcdUnavailable(f"watch: {err!r}"))
                if on_unavailable is not None and isinstance(wrapped, EtcdUnavailable):
                    on_unavailable(wrapped)
            finally:
                call.cancel()
            await asyncio.sleep(retry_s)
