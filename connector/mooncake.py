"""`MooncakeConnector`: prefix hits from the global pool, loaded straight into the paged cache.

Scheduler side: one QueryPrefix per request for the chain of full blocks after the local
prefix-cache hit (cached per request, so repeated calls have no further effect); the
matched blocks are loaded asynchronously while the request waits in WAITING_FOR_REMOTE_KVS.
Each step's metadata carries the loads to start and the blocks that become full (to save).

Worker side: owns the node's `NodePool` (registered with the transfer engine and the
metaserver). Loads are `NodePool.get` reads into the engine's registered KV cache, one
contiguous range per block (the cache leaves header room before each payload); completion
is polled in `get_finished`, and blocks that failed validation are reported by
`get_block_ids_with_load_errors`. Saves copy newly computed full blocks into the pool after
the step's forward pass; their publication to the metaserver is batched and asynchronous.

Extra config keys (`kv_connector_extra_config`): metaserver (HOST:PORT[,..], required),
pool_size ("4GiB"), node_id, protocol, metadata_server, device_name, local_hostname,
transfer_timeout_s, lease_ttl_s, query_timeout_s, debug_load_delay_s (fault drills: wait
this long between the query and the read, so a test can kill or overwrite the source).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from connector.base import EngineContext, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from connector.config import KVTransferConfig
from kvpool.layout import parse_size
from metaserver.errors import MetaError
from metaserver.types import BlockHash, BlockLocation, NodeId, NodeRecord

if TYPE_CHECKING:
    import torch

    from engine.request import Request
    from engine.scheduler.output import SchedulerOutput
    from kvpool.pool import NodePool
    from kvpool.reader import ReadHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    block_ids: tuple[int, ...]              # destination blocks in the paged cache, chain order
    locations: tuple[BlockLocation, ...]    # where each block is read from
    nodes: dict[NodeId, NodeRecord]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    request_id: str
    block_ids: tuple[int, ...]              # blocks that become full (computed) in this step
    block_hashes: tuple[BlockHash, ...]


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Hit:
    num_computed_tokens: int                # local hit the query was made after
    locations: tuple[BlockLocation, ...]
    nodes: dict[NodeId, NodeRecord]


@dataclass
class ConnectorStats:
    queries: int = 0
    query_errors: int = 0
    hit_blocks: int = 0         # blocks the index matched
    loaded_blocks: int = 0      # blocks delivered and validated
    failed_blocks: int = 0      # blocks whose load failed (recomputed)
    saved_blocks: int = 0       # new blocks put into the local pool


def _default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class MooncakeConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, ctx: EngineContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        metaserver = config.extra("metaserver")
        if not metaserver:
            raise ValueError("the mooncake connector needs kv_connector_extra_config.metaserver (HOST:PORT)")
        self.node_id: str = config.extra("node_id") or _default_node_id()
        self.stats = ConnectorStats()
        from metaserver.client import MetaClient
        from metaserver.credentials import ClientSecurity

        security = ClientSecurity.from_files(
            tls_ca_file=config.extra("metaserver_tls_ca", ""), tls_cert_file=config.extra("metaserver_tls_cert", ""),
            tls_key_file=config.extra("metaserver_tls_key", ""), token_file=config.extra("metaserver_token_file", ""))
        self._client = MetaClient(str(metaserver), timeout_s=float(config.extra("rpc_timeout_s", 5.0)),
                                  security=security)
        self._query_timeout_s = float(config.extra("query_timeout_s", 1.0))
        # scheduler side
        self._hits: dict[str, _Hit] = {}
        self._pending_loads: list[LoadSpec] = []
        # worker side
        self.pool: NodePool | None = None
        self._cache_base = 0
        self._loading: dict[str, tuple[ReadHandle | None, LoadSpec, float]] = {}
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self._delay_s = float(config.extra("debug_load_delay_s", 0.0))
        if role is KVConnectorRole.WORKER:
            self.pool = self._make_pool()

    def _make_pool(self) -> NodePool:
        from kvpool.config import PoolConfig
        from kvpool.pool import NodePool
        from kvpool.transfer import TransferConfig

        x = self.config.extra
        transfer = TransferConfig(protocol=x("protocol", "tcp"), metadata_server=x("metadata_server", "P2PHANDSHAKE"),
                                  device_name=x("device_name", ""), local_hostname=x("local_hostname", "127.0.0.1"),
                                  transfer_timeout_s=int(x("transfer_timeout_s", 5)),
                                  progress_timeout_s=int(x("progress_timeout_s", 2)))
        cfg = PoolConfig(node_id=self.node_id, pool_size_bytes=parse_size(x("pool_size", "1GiB")),
                         block_bytes=self.ctx.block_bytes, layout_fingerprint=self.ctx.fingerprint,
                         metaserver=str(x("metaserver")), transfer=transfer, lease_ttl_s=int(x("lease_ttl_s", 10)),
                         read_timeout_s=min(float(x("read_timeout_s", 10.0)), self.config.kv_load_timeout_s))
        pool = NodePool(cfg, self._client)
        pool.start()
        return pool

    # ---- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.is_consumer:
            return 0, False
        bs = self.ctx.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # leave one token to compute: its logits start the output
        if end <= start:
            return 0, False
        hit = self._hits.get(request.request_id)
        if hit is None or hit.num_computed_tokens != num_computed_tokens:
            hit = self._query(request, num_computed_tokens, start, end)
            self._hits[request.request_id] = hit
        return len(hit.locations) * bs, bool(hit.locations)

    def _query(self, request: Request, num_computed_tokens: int, start: int, end: int) -> _Hit:
        self.stats.queries += 1
        try:
            res = self._client.query_prefix(self.ctx.fingerprint, request.block_hashes[start:end], self.node_id,
                                            timeout_s=self._query_timeout_s)
        except MetaError as err:
            self.stats.query_errors += 1
            log.warning("query for %s failed, computing locally: %s", request.request_id, err)
            return _Hit(num_computed_tokens, (), {})
        self.stats.hit_blocks += res.num_matched
        log.debug("query %s: %d of %d blocks hit", request.request_id, res.num_matched, end - start)
        return _Hit(num_computed_tokens, res.locations, res.nodes)

    def update_state_after_alloc(self, request: Request, blocks: list[int], num_external_tokens: int) -> None:
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        n = num_external_tokens // self.ctx.block_size
        if n > len(hit.locations) or len(blocks) < n:
            raise ValueError(f"{request.request_id}: {n} external blocks but {len(hit.locations)} hits "
                             f"and {len(blocks)} blocks allocated")
        locs = hit.locations[:n]
        self._pending_loads.append(LoadSpec(request.request_id, tuple(blocks[:n]), locs,
                                            {loc.node_id: hit.nodes[loc.node_id] for loc in locs
                                             if loc.node_id in hit.nodes}))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self.config.is_producer:
            bs = self.ctx.block_size
            for s in scheduler_output.scheduled:
                req = s.request
                first, last = req.num_computed_tokens // bs, (req.num_computed_tokens + s.num_new_tokens) // bs
                table = scheduler_output.block_tables.get(req.request_id, [])
                last = min(last, len(req.block_hashes), len(table))
                if last > first:
                    meta.saves.append(SaveSpec(req.request_id, tuple(table[first:last]),
                                               tuple(req.block_hashes[first:last])))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        return False, None

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.pool is not None
        if len(kv_caches) != 1:
            raise ValueError("the mooncake connector expects one block-contiguous KV cache tensor")
        (cache,) = kv_caches.values()
        self._cache_base = cache.data_ptr()
        self.pool.register_memory(self._cache_base, cache.numel() * cache.element_size())

    def _payload_addr(self, block_id: int) -> int:
        return self._cache_base + block_id * self.ctx.slot_bytes + self.ctx.header_bytes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:  # noqa: ANN401 - vLLM's signature
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        now = time.monotonic()
        for spec in meta.loads:
            self._loading[spec.request_id] = (None, spec, now + self._delay_s)
        self._issue_due(now)

    def _issue_due(self, now: float) -> None:
        from kvpool.pool import PoolError

        assert self.pool is not None
        for rid, (handle, spec, not_before) in list(self._loading.items()):
            if handle is not None or now < not_before:
                continue
            try:
                handle = self.pool.get(spec.locations, spec.nodes, [self._payload_addr(b) for b in spec.block_ids],
                                       header_room=True)
            except PoolError as err:
                log.warning("load for %s rejected: %s", rid, err)
                self._finish_load(rid, spec, failed=range(len(spec.block_ids)))
                continue
            self._loading[rid] = (handle, spec, not_before)
            log.debug("load %s: %d blocks issued", rid, len(spec.block_ids))

    def _finish_load(self, rid: str, spec: LoadSpec, failed: Any) -> None:  # noqa: ANN401
        bad = [spec.block_ids[i] for i in failed]
        log.debug("load %s: %d blocks done, %d failed", rid, len(spec.block_ids), len(bad))
        self._load_errors.update(bad)
        self.stats.failed_blocks += len(bad)
        self.stats.loaded_blocks += len(spec.block_ids) - len(bad)
        self._recved.add(rid)
        del self._loading[rid]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish before their request is scheduled: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Blocks are saved whole, after the forward pass, in `wait_for_save`."""

    def wait_for_save(self) -> None:
        """Copy this step's newly full blocks into the pool (publication is asynchronous)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata) and self.pool is not None
        n = self.ctx.block_bytes
        for spec in meta.saves:
            for b, h in zip(spec.block_ids, spec.block_hashes):
                if self.pool.put(h, self._payload_addr(b), n):
                    self.stats.saved_blocks += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._issue_due(time.monotonic())
        for rid, (handle, spec, _) in list(self._loading.items()):
            if handle is not None and handle.done():
                assert handle.result is not None
                self._finish_load(rid, spec, failed=handle.result.failed)
        recved, self._recved = self._recved, set()
        return None, (recved or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, float]:
        """This half's counters (connector_*), and the node pool's (pool_*) on the worker side."""
        out: dict[str, float] = {f"connector_{k}": v for k, v in asdict(self.stats).items()}
        if self.pool is not None:
            ps = self.pool.stats
            out.update(pool_puts=ps.puts, pool_evictions=ps.evictions, pool_bytes_read=ps.bytes_read,
                       pool_failed_reads=ps.failed_reads, pool_remote_hit_blocks=ps.remote_hits,
                       pool_local_hit_blocks=ps.local_hits, pool_published=ps.published,
                       pool_unpublished=ps.unpublished, pool_blocks=len(self.pool), pool_slots=self.pool.num_slots,
                       pool_publishing=int(self.pool.publishing))
        return out

    def shutdown(self) -> None:
        if self.pool is not None:
            for handle, _, _ in self._loading.values():
                if handle is not None:
                    handle.wait()
            if self._cache_base:
                self.pool.unregister_memory(self._cache_base)
                self._cache_base = 0
            self.pool.close()
            self.pool = None
        self._client.close()
