"""The gRPC servicer: protobuf in, `MetaService` call, protobuf out; errors become statuses.

Protobuf types stop here; the domain layer sees dataclasses (`metaserver.types`).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from kvpool_proto.kvpool.v1 import meta_pb2 as pb
from kvpool_proto.kvpool.v1 import meta_pb2_grpc as pb_grpc
from metaserver.errors import InvalidArgument, MetaError
from metaserver.service import MetaService
from metaserver.store import node_to_pb
from metaserver.types import BlockHash, BlockLocation, BlockRecord, NodeRecord

log = logging.getLogger(__name__)
T = TypeVar("T")


def location_to_pb(loc: BlockLocation) -> pb.BlockLocation:
    return pb.BlockLocation(block_hash=loc.block_hash, node_id=loc.node_id, offset=loc.offset,
                            size_bytes=loc.size_bytes, generation=loc.generation)


def node_info(node: NodeRecord, num_blocks: int = 0) -> pb.NodeInfo:
    msg = node_to_pb(node)
    msg.num_blocks = num_blocks
    return msg


async def _call(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T] | T]) -> T:
    """Run a domain call; a MetaError aborts the RPC with its status and message."""
    try:
        result = fn()
        if isinstance(result, Awaitable):
            result = await result
        return result  # type: ignore[return-value]
    except MetaError as err:
        await context.abort(err.code, str(err))
    raise AssertionError("unreachable")


class MetaServicer(pb_grpc.MetaServiceServicer):
    def __init__(self, service: MetaService) -> None:
        self.service = service

    async def RegisterNode(self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext) -> pb.RegisterNodeResponse:
        node = await _call(context, lambda: self.service.register_node(
            request.node_id, request.session_address, request.buffer_address, request.capacity_bytes,
            request.layout_fingerprint, request.lease_ttl_s))
        return pb.RegisterNodeResponse(lease_id=node.lease_id, lease_ttl_s=node.lease_ttl_s)

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext) -> pb.KeepAliveResponse:
        ttl = await _call(context, lambda: self.service.keepalive(request.node_id, request.lease_id))
        return pb.KeepAliveResponse(lease_ttl_s=ttl)

    async def UnregisterNode(self, request: pb.UnregisterNodeRequest, context: grpc.aio.ServicerContext) -> pb.UnregisterNodeResponse:
        n = await _call(context, lambda: self.service.unregister_node(request.node_id, request.lease_id))
        return pb.UnregisterNodeResponse(num_blocks_removed=n)

    async def Publish(self, request: pb.PublishRequest, context: grpc.aio.ServicerContext) -> pb.PublishResponse:
        records = [BlockRecord(BlockHash(b.block_hash), b.offset, b.size_bytes, b.generation) for b in request.blocks]
        n = await _call(context, lambda: self.service.publish(request.node_id, records))
        return pb.PublishResponse(num_published=n)

    async def Unpublish(self, request: pb.UnpublishRequest, context: grpc.aio.ServicerContext) -> pb.UnpublishResponse:
        n = await _call(context, lambda: self.service.unpublish(request.node_id, list(request.block_hashes)))
        return pb.UnpublishResponse(num_removed=n)

    async def QueryPrefix(self, request: pb.QueryPrefixRequest, context: grpc.aio.ServicerContext) -> pb.QueryPrefixResponse:
        result = await _call(context, lambda: self.service.query(
            request.namespace, list(request.block_hashes), request.requester_node_id))
        return pb.QueryPrefixResponse(
            num_matched=result.num_matched,
            locations=[location_to_pb(loc) for loc in result.locations],
            nodes=[node_info(n) for n in result.nodes.values()],
        )

    async def Invalidate(self, request: pb.InvalidateRequest, context: grpc.aio.ServicerContext) -> pb.InvalidateResponse:
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

        n = await _call(context, run)
        log.info("invalidate %s%s: %d copies removed", target,
                 f" ({request.namespace})" if request.namespace else "", n)
        return pb.InvalidateResponse(num_removed=n)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        n = await _call(context, lambda: self.service.drain(request.node_id))
        return pb.DrainResponse(num_removed=n)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        s = self.service.index_stats()
        c = self.service.counters
        return pb.StatsResponse(
            num_nodes=s.num_nodes, num_blocks=s.num_blocks, num_copies=s.num_copies,
            namespaces=[pb.NamespaceStats(namespace=n.namespace, num_blocks=n.num_blocks, num_copies=n.num_copies)
                        for n in s.namespaces],
            queries=c.queries, query_blocks=c.query_blocks, query_hit_blocks=c.query_hit_blocks,
            published_blocks=c.published_blocks, etcd_healthy=self.service.store.healthy,
            pending_writes=self.service.store.pending_writes, replica_id=self.service.config.replica_name,
        )

    async def ListNodes(self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext) -> pb.ListNodesResponse:
        return pb.ListNodesResponse(nodes=[node_info(n, k) for n, k in self.service.nodes()])
