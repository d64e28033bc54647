"""`MooncakeConnector`: our engine's host for the pool connector (`--kv-connector mooncake`).

A thin front over the two host-independent halves, as vLLM's own Mooncake connector is:
the scheduler role wraps a `PoolScheduler` (lookups, pending loads, save planning), the
worker role a `PoolWorker` (node pool, loads, saves). This module only translates the
engine's contract (`Request`, `SchedulerOutput`, the cache tensor) into the halves' plain
values, and the halves' failures into `KVConnectorError`.

Settings: `kv_connector_extra_config` (see `connector.settings`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.cache_layout import SlottedCache
from connector.messages import PoolConnectorMetadata
from connector.pool_scheduler import PoolScheduler
from connector.pool_worker import PoolWorker
from connector.settings import PoolConnectorSettings
from engine.kv_connector.base import (EngineContext, KVConnectorBase_V1, KVConnectorError, KVConnectorRole)
from engine.kv_connector.config import KVTransferConfig
from kvpool.layout import HEADER_BYTES
from kvpool.pool import PoolError
from kvpool.transfer import TransferError
from metaserver.errors import MetaError

if TYPE_CHECKING:
    import torch

    from engine.request import Request
    from engine.step import KVConnectorOutput, SchedulerOutput

# What the halves raise when the pool, the transfer engine or the metaserver fails.
_POOL_ERRORS = (PoolError, TransferError, MetaError)


class MooncakeConnector(KVConnectorBase_V1):
    # A cache block read from the pool lands with its slot header in front (one transfer).
    cache_header_bytes = HEADER_BYTES

    def __init__(self, config: KVTransferConfig, ctx: EngineContext, role: KVConnectorRole) -> None:
        super().__init__(config, ctx, role)
        try:
            settings = PoolConnectorSettings.from_extra(config.extra, config.kv_load_timeout_s)
            self.node_id = settings.node_id
            self.scheduler: PoolScheduler | None = None
            self.worker: PoolWorker | None = None
            if role is KVConnectorRole.SCHEDULER:
                self.scheduler = PoolScheduler(settings, ctx.fingerprint, ctx.block_size, config.is_consumer,
                                               config.is_producer)
            else:
                self.worker = PoolWorker(settings, ctx.fingerprint, ctx.block_bytes)
        except _POOL_ERRORS as err:
            raise KVConnectorError(f"the mooncake connector could not start: {err}") from err

    # ---- scheduler side -------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.start_lookup(request.request_id, request.block_hashes, request.num_tokens,
                                    request.kv_transfer_params, request.prompt_token_ids)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        n = self.scheduler.num_matched_tokens(request.request_id, request.block_hashes, request.num_tokens,
                                              num_computed_tokens)
        return n, bool(n)

    def wait_for_lookups(self, timeout_s: float) -> None:
        assert self.scheduler is not None
        self.scheduler.wait_for_lookups(timeout_s)

    def update_state_after_alloc(self, request: Request, blocks: list[int], num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.on_alloc(request.request_id, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolConnectorMetadata:
        assert self.scheduler is not None
        for s in scheduler_output.scheduled:
            req = s.request
            self.scheduler.plan_save(req.request_id, req.num_computed_tokens, s.num_new_tokens,
                                     scheduler_output.block_tables.get(req.request_id, ()), req.block_hashes)
        return self.scheduler.build_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.on_worker_report(connector_output.finished_recving, connector_output.invalid_block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        hold = self.scheduler.finish_request(request.request_id, request.kv_transfer_params, block_ids,
                                             request.block_hashes, request.num_prompt_tokens,
                                             request.num_computed_tokens, request.prompt_token_ids)
        return bool(hold), None  # a send's params come with its report (get_kv_transfer_params)

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        if len(kv_caches) != 1:
            raise KVConnectorError("the mooncake connector expects one block-contiguous KV cache tensor")
        (cache,) = kv_caches.values()
        try:
            self.worker.register_cache(SlottedCache(cache.data_ptr(), self.ctx.slot_bytes, self.ctx.header_bytes),
                                       cache.numel() * cache.element_size() // self.ctx.slot_bytes, [cache])
        except _POOL_ERRORS as err:
            raise KVConnectorError(f"the mooncake connector could not register the KV cache: {err}") from err

    def _meta(self) -> PoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:  # noqa: ANN401 - vLLM's signature
        assert self.worker is not None
        self.worker.begin_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish before their request is scheduled: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Blocks are saved whole, after the forward pass, in `wait_for_save`."""

    def wait_for_save(self) -> None:
        """Copy this step's newly full blocks into the pool (publication is asynchronous)."""
        assert self.worker is not None
        self.worker.save(self._meta().saves)

    def wait_for_loads(self, request_ids: frozenset[str], timeout_s: float) -> None:
        assert self.worker is not None
        self.worker.wait_for_loads(request_ids, timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return (self.worker.finished_sends() or None), (self.worker.finished_loads() or None)

    def get_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        assert self.worker is not None
        return self.worker.take_sent_params()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> dict[str, float]:
        half = self.scheduler or self.worker
        return half.counters() if half is not None else {}

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
