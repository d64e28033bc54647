"""The metaserver process: gRPC server (MetaService, grpc.health.v1, reflection) on asyncio.

Lifecycle: connect to etcd and rebuild the index (retrying while etcd is down, health
NOT_SERVING meanwhile), serve, and on SIGTERM/SIGINT stop accepting calls, write queued
changes through to etcd (bounded) and exit.

Health: the overall service "" and "kvpool.v1.MetaService" are SERVING once the index is
loaded; "kvpool.v1.MetaService.etcd" is NOT_SERVING while etcd is unreachable (degraded:
queries are still answered from memory and changes are queued).
"""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool_proto.kvpool.v1 import meta_pb2, meta_pb2_grpc
from metaserver.config import MetaServerConfig
from metaserver.etcd import EtcdClient, EtcdUnavailable
from metaserver.service import MetaService
from metaserver.servicer import MetaServicer

log = logging.getLogger(__name__)

SERVICE_NAME = meta_pb2.DESCRIPTOR.services_by_name["MetaService"].full_name
ETCD_HEALTH_NAME = SERVICE_NAME + ".etcd"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class MetaServer:
    """One replica. `await start()`, then `await wait()`; `await stop()` from anywhere."""

    def __init__(self, config: MetaServerConfig) -> None:
        self.config = config
        self._stopped = asyncio.Event()
        self.etcd = EtcdClient(config.etcd_endpoints, timeout_s=config.etcd_timeout_s)
        self.service = MetaService(config, self.etcd)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20),
                                               ("grpc.so_reuseport", 0)])
        meta_pb2_grpc.add_MetaServiceServicer_to_server(MetaServicer(self.service), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = self.server.add_insecure_port(config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen}")

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _on_etcd_health(self, healthy: bool) -> None:
        asyncio.get_running_loop().create_task(self.health.set(ETCD_HEALTH_NAME, _SERVING if healthy else _NOT_SERVING))

    async def start(self) -> None:
        await self._set_health(_NOT_SERVING)
        await self.health.set(ETCD_HEALTH_NAME, _NOT_SERVING)
        await self.server.start()
        log.info("metaserver %s listening on %s (etcd %s)", self.config.replica_name, self.config.listen,
                 ",".join(self.config.etcd_endpoints))
        delay = self.config.etcd_retry_s
        while True:
            try:
                await self.service.start()
                break
            except EtcdUnavailable as err:
                log.warning("etcd unavailable at start (%s); retrying in %.1fs", err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.service.store.on_health_change = self._on_etcd_health
        await self.health.set(ETCD_HEALTH_NAME, _SERVING)
        await self._set_health(_SERVING)
        log.info("metaserver %s ready", self.config.replica_name)

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        log.info("metaserver %s shutting down", self.config.replica_name)
        await self._set_health(_NOT_SERVING)
        await self.server.stop(grace_s)
        await self.service.stop()
        await self.etcd.close()
        self._stopped.set()
        log.info("metaserver %s stopped", self.config.replica_name)


async def serve(config: MetaServerConfig) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    server = MetaServer(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    start = asyncio.create_task(server.start())
    await stop_requested.wait()
    log.info("signal received")
    start.cancel()
    await asyncio.gather(start, return_exceptions=True)
    await server.stop()
