"""The gRPC servicer: protobuf in, `MetaService` call, protobuf out; errors become statuses.

Protobuf types stop here; the domain layer sees dataclasses (`metaserver.types`).
Handlers run on the gRPC server's thread pool (the synchronous server handles about 1.5x
the calls per second of grpc.aio here). Plain domain methods lock the index themselves;
async ones (those that talk to etcd before answering) run on the service's event loop.

`add_to_server` registers every method of the service with two steps before the handler:
the caller is authorized (`metaserver.auth`; with no token configured every caller is open
and the metadata is not read), and a request that does not parse is answered
INVALID_ARGUMENT (gRPC's own deserializer would answer INTERNAL). Handlers take
`(request, context, caller)`. WatchIndex is the one server-streaming method: its handler
is a generator holding one handler thread while the stream lasts (the server adds
MAX_WATCHERS threads to its pool for them).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from metaserver.auth import METHOD_ACCESS, OPEN, Authenticator, Caller
from metaserver.errors import InvalidArgument, MetaError, Unavailable
from metaserver.feed import encode_changes, encode_snapshot
from metaserver.service import MetaService
from metaserver.store import node_to_pb, record_from_pb
from metaserver.types import Medium, Namespace, NodeRecord, QueryResult

log = logging.getLogger(__name__)
T = TypeVar("T")

STREAMS = {"WatchIndex"}   # server-streaming methods
MAX_WATCHERS = 64          # WatchIndex streams at once (each holds a handler thread)
HEARTBEAT_S = 0.5          # an idle WatchIndex stream sends an empty event this often


def node_info(node: NodeRecord, num_blocks: int = 0) -> pb.NodeInfo:
    msg = node_to_pb(node)
    msg.num_blocks = num_blocks
    return msg


def query_response(result: QueryResult) -> pb.QueryPrefixResponse:
    order = {node_id: i for i, node_id in enumerate(result.nodes)}
    if result.held:  # a sparse answer: every block present, with its place in the chain
        chain_index = [i for i, loc in enumerate(result.held) if loc is not None]
        locs = [loc for loc in result.held if loc is not None]
    else:
        chain_index, locs = [], list(result.locations)
    return pb.QueryPrefixResponse(
        num_matched=len(result.locations), nodes=[node_info(n) for n in result.nodes.values()],
        node_index=[order[loc.node_id] for loc in locs], offsets=[loc.offset for loc in locs],
        sizes_bytes=[loc.size_bytes for loc in locs], generations=[loc.generation for loc in locs],
        chain_index=chain_index,
        media=[int(loc.medium) for loc in locs] if any(loc.medium for loc in locs) else [])


def _call(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Run a domain call; a MetaError aborts the RPC with its status and message."""
    try:
        return fn()
    except MetaError as err:
        context.abort(err.code, str(err))
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class Malformed:
    """What the lenient deserializer returns for bytes that are not the request message."""

    message: str


def _lenient(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as err:
            return Malformed(f"the request is not a valid {cls.DESCRIPTOR.full_name}: {err}")

    return parse


class MetaServicer:
    def __init__(self, service: MetaService, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.service = service
        self._loop = loop
        self._timeout_s = timeout_s
        self._watch_lock = threading.Lock()
        self._watchers = 0

    def add_to_server(self, server: grpc.Server, auth: Authenticator) -> None:
        """Serve every MetaService method on `server`, each call authorized by `auth`.

        Registered (not generic) handlers: gRPC core matches the method name itself, with no
        Python-level handler lookup per call."""
        service = pb.DESCRIPTOR.services_by_name["MetaService"]
        handlers = {m.name: self._handler(m.name, getattr(pb, m.input_type.name), getattr(pb, m.output_type.name),
                                          auth) for m in service.methods}
        server.add_registered_method_handlers(service.full_name, handlers)

    def _handler(self, name: str, request_cls: type[Message], response_cls: type[Message],
                 auth: Authenticator) -> grpc.RpcMethodHandler:
        assert name in METHOD_ACCESS, f"no access rule for {name}"
        method: Callable[[Any, grpc.ServicerContext, Caller], Message] = getattr(self, name)

        def behavior(request: Message | Malformed, context: grpc.ServicerContext) -> Message:
            # No tokens configured: every caller is OPEN (what authorize answers), without
            # reading the call's metadata.
            caller = _call(context, lambda: auth.authorize(context.invocation_metadata(), name)) \
                if auth.enabled else OPEN
            if isinstance(request, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return method(request, context, caller)

        if name in STREAMS:
            return grpc.unary_stream_rpc_method_handler(behavior, request_deserializer=_lenient(request_cls),
                                                        response_serializer=response_cls.SerializeToString)
        return grpc.unary_unary_rpc_method_handler(behavior,
                                                   request_deserializer=_lenient(request_cls),
                                                   response_serializer=response_cls.SerializeToString)

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._timeout_s)
        except TimeoutError:
            future.cancel()
            raise Unavailable(f"no answer from etcd within {self._timeout_s}s") from None

    def RegisterNode(self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext,
                     caller: Caller) -> pb.RegisterNodeResponse:
        node, session_token = _call(context, lambda: self._on_loop(self.service.register_node(
            request.node_id, request.session_address, request.buffer_address, request.capacity_bytes,
            request.layout_fingerprint, request.lease_ttl_s, caller.node_session, request.api_url,
            request.stage_address)))
        return pb.RegisterNodeResponse(lease_id=node.lease_id, lease_ttl_s=node.lease_ttl_s,
                                       session_token=session_token)

    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext,
                  caller: Caller) -> pb.KeepAliveResponse:
        ttl = _call(context, lambda: self._on_loop(self.service.keepalive(request.node_id, request.lease_id,
                                                                         caller.node_session)))
        return pb.KeepAliveResponse(lease_ttl_s=ttl)

    def UnregisterNode(self, request: pb.UnregisterNodeRequest, context: grpc.ServicerContext,
                       caller: Caller) -> pb.UnregisterNodeResponse:
        n = _call(context, lambda: self._on_loop(self.service.unregister_node(request.node_id, request.lease_id,
                                                                               caller.node_session)))
        return pb.UnregisterNodeResponse(num_blocks_removed=n)

    def Publish(self, request: pb.PublishRequest, context: grpc.ServicerContext,
                caller: Caller) -> pb.PublishResponse:
        media = {int(m) for m in Medium}
        bad = next((i for i, b in enumerate(request.blocks) if b.medium not in media), None)
        if bad is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"publish: block #{bad} has unknown medium {request.blocks[bad].medium}")
        records = [record_from_pb(b) for b in request.blocks]
        n = _call(context, lambda: self.service.publish(request.node_id, records, caller.node_session))
        return pb.PublishResponse(num_published=n)

    def Unpublish(self, request: pb.UnpublishRequest, context: grpc.ServicerContext,
                  caller: Caller) -> pb.UnpublishResponse:
        n = _call(context, lambda: self.service.unpublish(request.node_id, list(request.block_hashes),
                                                          caller.node_session))
        return pb.UnpublishResponse(num_removed=n)

    def QueryPrefix(self, request: pb.QueryPrefixRequest, context: grpc.ServicerContext,
                    caller: Caller) -> pb.QueryPrefixResponse:
        result = _call(context, lambda: self.service.query(
            request.namespace, list(request.block_hashes), request.requester_node_id, request.sparse))
        return query_response(result)

    def QueryPrefixBatch(self, request: pb.QueryPrefixBatchRequest, context: grpc.ServicerContext,
                         caller: Caller) -> pb.QueryPrefixBatchResponse:
        results = _call(context, lambda: self.service.query_batch(
            [(q.namespace, list(q.block_hashes), q.requester_node_id, q.sparse) for q in request.queries]))
        return pb.QueryPrefixBatchResponse(results=[query_response(r) for r in results])

    def ReportFailedRead(self, request: pb.ReportFailedReadRequest, context: grpc.ServicerContext,
                         caller: Caller) -> pb.ReportFailedReadResponse:
        removed, suspect = _call(context, lambda: self.service.report_failed_read(
            request.reporter_node_id, request.source_node_id, list(request.block_hashes)))
        return pb.ReportFailedReadResponse(num_removed=removed, source_suspect=suspect)

    def WatchIndex(self, request: pb.WatchIndexRequest, context: grpc.ServicerContext,
                   caller: Caller) -> Iterator[pb.IndexEvent]:
        """The namespace's index as a stream (see metaserver.feed): a snapshot unless the
        watcher resumes where the feed still reaches, then changes as they apply, a heartbeat
        every HEARTBEAT_S when idle. Holds one handler thread while it lasts; at most
        MAX_WATCHERS at once (RESOURCE_EXHAUSTED beyond)."""
        with self._watch_lock:
            if self._watchers >= MAX_WATCHERS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this replica already streams its index to {MAX_WATCHERS} watchers")
            self._watchers += 1
        try:
            yield from self._watch(request, context)
        finally:
            with self._watch_lock:
                self._watchers -= 1

    def _watch(self, request: pb.WatchIndexRequest, context: grpc.ServicerContext) -> Iterator[pb.IndexEvent]:
        feed, ns = self.service.feed, Namespace(request.namespace)
        epoch, seq = request.epoch, request.after_seq
        resumed = bool(epoch) and feed.since(epoch, seq, ns) is not None
        log.info("%s watches %r (%s)", request.watcher_node_id or "a node", request.namespace,
                 f"resumed at {seq}" if resumed else "snapshot")
        last_sent = 0.0
        while context.is_active():
            got = feed.since(epoch, seq, ns) if epoch else None
            if got is None:  # first contact, a new epoch, or the watcher fell too far behind
                epoch, seq, nodes, blocks, suspects = _call(context, lambda: self.service.watch_snapshot(ns))
                yield from encode_snapshot(nodes, blocks, suspects, epoch, seq)
                last_sent = time.monotonic()
                continue
            changes, upto = got
            if changes or time.monotonic() - last_sent >= HEARTBEAT_S:
                yield encode_changes(changes, epoch, upto)
                last_sent = time.monotonic()
            seq = upto
            feed.wait(epoch, seq, HEARTBEAT_S)

    def Invalidate(self, request: pb.InvalidateRequest, context: grpc.ServicerContext,
                   caller: Caller) -> pb.InvalidateResponse:
        target = request.WhichOneof("target")
        svc = self.service
        calls: dict[str | None, Callable[[], int]] = {
            "hashes": lambda: svc.invalidate_hashes(request.namespace, list(request.hashes.block_hashes)),
            "node_id": lambda: svc.invalidate_node(request.node_id),
            "by_namespace": lambda: svc.invalidate_namespace(request.namespace),
            "all": svc.invalidate_all,
        }

        def run() -> int:
            if target is None or (target in ("by_namespace", "all") and not getattr(request, target)):
                raise InvalidArgument("invalidate needs one target: hashes, node_id, by_namespace or all")
            return calls[target]()

        n = _call(context, run)
        log.info("invalidate %s%s: %d copies removed", target,
                 f" ({request.namespace})" if request.namespace else "", n)
        return pb.InvalidateResponse(num_removed=n)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext,
              caller: Caller) -> pb.DrainResponse:
        n = _call(context, lambda: self.service.drain(request.node_id))
        return pb.DrainResponse(num_removed=n)

    def Undrain(self, request: pb.UndrainRequest, context: grpc.ServicerContext,
                caller: Caller) -> pb.UndrainResponse:
        was_draining = _call(context, lambda: self.service.undrain(request.node_id))
        return pb.UndrainResponse(was_draining=was_draining)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext,
              caller: Caller) -> pb.StatsResponse:
        s = self.service.index_stats()
        c = self.service.counters
        return pb.StatsResponse(
            num_nodes=s.num_nodes, num_blocks=s.num_blocks, num_copies=s.num_copies,
            namespaces=[pb.NamespaceStats(namespace=n.namespace, num_blocks=n.num_blocks, num_copies=n.num_copies,
                                          num_disk_copies=n.num_disk_copies, dram_bytes=n.dram_bytes,
                                          disk_bytes=n.disk_bytes)
                        for n in s.namespaces],
            queries=c.queries, query_blocks=c.query_blocks, query_hit_blocks=c.query_hit_blocks,
            published_blocks=c.published_blocks, etcd_healthy=self.service.store.healthy,
            pending_writes=self.service.store.pending_writes, replica_id=self.service.config.replica_name,
        )

    def ListNodes(self, request: pb.ListNodesRequest, context: grpc.ServicerContext,
                  caller: Caller) -> pb.ListNodesResponse:
        return pb.ListNodesResponse(nodes=[node_info(n, k) for n, k in self.service.nodes()])
