"""The metaserver process: gRPC server (MetaService, grpc.health.v1, reflection).

Two halves: a synchronous gRPC server whose handler threads answer from the in-memory
index, and one asyncio event loop thread that owns everything etcd (load, watch, the
write-behind flusher, leases). See `metaserver.service` for the locking.

Lifecycle: connect to etcd and rebuild the index (retrying while etcd is down, health
NOT_SERVING meanwhile), serve, and on SIGTERM/SIGINT stop accepting calls, write queued
changes through to etcd (bounded by shutdown_flush_s) and exit.

Health: "" and "kvpool.v1.MetaService" are SERVING once the index is loaded (before that,
index reads, queries and watches, are UNAVAILABLE: a client moves to another replica);
"kvpool.v1.MetaService.etcd" is NOT_SERVING while etcd is unreachable (degraded: queries
are still answered from memory and changes are queued), also while idle: any failed etcd
call and the store's periodic probe report it (`DurableStore.report_unreachable`,
`DurableStore._probe_loop`), and the probe turns it SERVING again once etcd answers.

Security (both off by default): TLS on the port, optionally mutual (clients must present a
certificate signed by the configured CA), and bearer tokens checked per call
(`metaserver.auth`). Health and reflection answer without a token (probes), but over the
same TLS port.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool_proto.kvpool.v1 import meta_pb2
from metaserver.auth import Authenticator
from metaserver.config import MetaServerConfig
from metaserver.etcd import EtcdClient, EtcdUnavailable
from metaserver.service import MetaService
from metaserver.servicer import MAX_WATCHERS, MetaServicer

log = logging.getLogger(__name__)

SERVICE_NAME = meta_pb2.DESCRIPTOR.services_by_name["MetaService"].full_name
ETCD_HEALTH_NAME = SERVICE_NAME + ".etcd"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class MetaServer:
    """One replica: `start()` (returns once listening), `wait()`, `stop()`; thread-safe."""

    def __init__(self, config: MetaServerConfig, handler_threads: int = 2) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="etcd-loop", daemon=True)
        self.etcd: EtcdClient | None = None
        self.service: MetaService | None = None
        self.health = health.HealthServicer()
        # WatchIndex streams each hold a thread for as long as they last: room for them beside
        # the handler threads.
        self.server = grpc.server(futures.ThreadPoolExecutor(handler_threads + MAX_WATCHERS, thread_name_prefix="rpc"),
                                  options=[("grpc.max_receive_message_length", 16 << 20), ("grpc.so_reuseport", 0)])
        self._stopped = threading.Event()
        self._ready = threading.Event()

    def _set_health(self, status: int, *names: str) -> None:
        for name in names or ("", SERVICE_NAME):
            self.health.set(name, status)

    def _credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials from the configured PEM files (None: plaintext). Raises OSError."""
        cfg = self.config
        if not cfg.tls:
            return None

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        client_ca = read(cfg.tls_client_ca_file) if cfg.tls_client_ca_file else None
        return grpc.ssl_server_credentials([(read(cfg.tls_key_file), read(cfg.tls_cert_file))],
                                           root_certificates=client_ca, require_client_auth=client_ca is not None)

    def _bind(self) -> None:
        credentials = self._credentials()
        listen = self.config.listen
        try:
            port = (self.server.add_insecure_port(listen) if credentials is None
                    else self.server.add_secure_port(listen, credentials))
        except RuntimeError:  # grpc raises instead of returning 0 (address in use, unusable PEM)
            port = 0
        if port == 0:
            hint = "" if credentials is None else " (or --tls-cert/--tls-key are not a matching PEM certificate and key)"
            raise OSError(f"cannot listen on {listen}: address in use or not local{hint}")
        cfg = self.config
        tls = "plaintext" if credentials is None else (
            "TLS, client certificates required" if cfg.tls_client_ca_file else "TLS")
        roles = [role for role, token in (("admin", cfg.admin_token), ("node", cfg.node_token)) if token]
        auth = f"tokens required ({', '.join(roles)})" if roles else "no tokens: every client may change the index"
        log.info("metaserver %s: %s, %s", cfg.replica_name, tls, auth)
        if roles and credentials is None:
            log.warning("bearer tokens travel in plaintext; use --tls-cert/--tls-key beyond a trusted network")
        if cfg.node_token and not cfg.admin_token:
            log.warning("no admin token: Invalidate and Drain are refused for every caller")

    def start(self) -> None:
        """Bind and serve; loading the index from etcd continues in the background.
        Raises OSError when the port or a TLS file is unusable."""
        self._bind()
        self._loop_thread.start()
        self.etcd = asyncio.run_coroutine_threadsafe(self._make_etcd(), self.loop).result()
        self.service = MetaService(self.config, self.etcd)
        MetaServicer(self.service, self.loop, self.config.etcd_timeout_s * 3).add_to_server(
            self.server, Authenticator(self.config.admin_token, self.config.node_token))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self._set_health(_NOT_SERVING)
        self._set_health(_NOT_SERVING, ETCD_HEALTH_NAME)
        self.server.start()
        log.info("metaserver %s listening on %s (etcd %s)", self.config.replica_name, self.config.listen,
                 ",".join(self.config.etcd_endpoints))
        asyncio.run_coroutine_threadsafe(self._load(), self.loop)

    async def _make_etcd(self) -> EtcdClient:
        return EtcdClient(self.config.etcd_endpoints, timeout_s=self.config.etcd_timeout_s)

    async def _load(self) -> None:
        assert self.service is not None
        delay = self.config.etcd_retry_s
        while True:
            try:
                await self.service.start()
                break
            except EtcdUnavailable as err:
                log.warning("etcd unavailable at start (%s); retrying in %.1fs", err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.service.store.on_health_change = lambda ok: self._set_health(_SERVING if ok else _NOT_SERVING,
                                                                         ETCD_HEALTH_NAME)
        self._set_health(_SERVING if self.service.store.healthy else _NOT_SERVING, ETCD_HEALTH_NAME)
        self._set_health(_SERVING)
        self._ready.set()
        log.info("metaserver %s ready", self.config.replica_name)

    def wait(self) -> None:
        self._stopped.wait()

    def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        log.info("metaserver %s shutting down", self.config.replica_name)
        self._set_health(_NOT_SERVING)
        self.server.stop(grace_s).wait()
        if self.service is not None and self._ready.is_set():
            asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result()
        if self.etcd is not None:
            asyncio.run_coroutine_threadsafe(self.etcd.close(), self.loop).result()
        for task in asyncio.all_tasks(self.loop):
            self.loop.call_soon_threadsafe(task.cancel)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(5)
        self._stopped.set()
        log.info("metaserver %s stopped", self.config.replica_name)


def serve(config: MetaServerConfig, handler_threads: int = 2) -> None:
    """Run one replica in this process until SIGTERM or SIGINT."""
    server = MetaServer(config, handler_threads)
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    server.start()
    stop_requested.wait()
    log.info("signal received")
    server.stop()
