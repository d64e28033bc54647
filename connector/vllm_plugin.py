"""`KVPoolConnector`: kvpool as a vLLM 0.32 KV connector plug-in (the only module that imports vLLM).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "connector.vllm_plugin", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"metaserver": "127.0.0.1:50051", "pool_size": "4GiB"}}'

A thin host over the same halves as our engine's `MooncakeConnector`: the scheduler role
wraps a `PoolScheduler`, the worker role a `PoolWorker`; this module only translates vLLM's
objects into their plain values.

- Hashes: vLLM's own chained block hashes (`request.block_hashes`, which carry its extra
  keys such as `cache_salt`), each rehashed with a seed made from this deployment's layout
  fingerprint (the model by its weights' digest, not its path or served name; dtype, block
  size, layers, KV heads, head dim, vLLM's CPU layout, and vLLM, torch and the device:
  their kernels follow the device, so nodes on other CPU or GPU models share no blocks);
  the fingerprint is also the metaserver namespace, so vLLM blocks never meet our engine's.
  A node that finds another serving the same weights in another layout warns at start
  (`connector.model_identity`).
  vLLM's hashes are equal across processes with its default `sha256` algorithm; with a
  non-cryptographic one its seed is random unless PYTHONHASHSEED is set (warned at start).
- Loads are asynchronous (WAITING_FOR_REMOTE_KVS until `get_finished` reports them). vLLM's
  CPU cache is one tensor per layer, `[num_blocks, kv_heads, block_size, 2 * head_dim]`, all
  views of one buffer: a pool block (the block's slice of every layer, in layer order) lands
  whole in the pool's read buffer, is validated there (header + checksum) and copied slice by
  slice into the cache; a failed transfer never writes into vLLM's cache. Only full blocks are saved, after the
  forward pass (`wait_for_save`); a partial last block is recomputed, except in P/D, where the
  producer hands it off too (`connector.handoff`, the tail) and the decode node computes only
  the prompt's last token.
- Failures: blocks that failed are reported by `get_block_ids_with_load_errors`; use
  `kv_load_failure_policy: recompute` (vLLM's default is `fail`). A request whose load
  failed is offered no remote hit again, so vLLM's recompute path cannot loop.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from connector import handoff
from connector.cache_layout import LayeredCache
from connector.messages import PoolConnectorMetadata
from connector.model_identity import warn_namespace_conflicts, weights_digest
from connector.pool_scheduler import PoolScheduler
from connector.pool_worker import PoolWorker
from connector.settings import PoolConnectorSettings
from engine.kv_connector.config import KVTransferConfig
from engine.native.build import cpu_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration (handlers, level) covers it.
log = logging.getLogger("vllm.kvpool")

LAYOUT = "LBHNC"  # vLLM's CPU KV layout: per layer [block, kv head, token, K|V x head_dim]


def model_identity(model: str, revision: str | None) -> str:
    """The model by its weights (`connector.model_identity.weights_digest`) where they are a
    local folder (a path, or a hub id already in the local hub cache); else the hub id and
    revision, which name the same weights on every node."""
    path = Path(model)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception as err:  # noqa: BLE001  # any miss of the local cache: fall back to the id
            log.info("kvpool: %s is not a local folder (%s); naming it by hub id and revision", model, err)
            return f"{model}@{revision or 'main'}"
    return weights_digest(path)


def hardware_identity(device_type: str) -> str:
    """What computed the KV besides the model: vLLM's and torch's versions and the device (the
    CPU model with its family and model numbers, or the GPU's name). vLLM's kernels pick their
    code by the device they run on (oneDNN's ISA and blocking, its attention's ISA; a GPU's
    architecture), so two devices' blocks are not known to be bit-identical: "hw:" and 8 hex
    digits of their digest, a fingerprint's last field."""
    import vllm

    if device_type == "cuda" and torch.cuda.is_available():
        device = f"cuda {torch.cuda.get_device_name(0)}"
    else:
        device = f"{device_type} {cpu_model()}"
    parts = f"vllm {vllm.__version__}|torch {torch.__version__}|{device}"
    log.info("kvpool: the KV namespace's hardware part: %s", parts)
    return "hw:" + hashlib.sha256(parts.encode()).hexdigest()[:8]


def layout_fingerprint(vllm_config: VllmConfig) -> str:
    """The namespace of this deployment's blocks: equal only where the KV bytes are (the
    weights, not the path or served name; dtype, block size, shape, CPU layout, and the
    software and device that compute them: `hardware_identity`)."""
    mc, par = vllm_config.model_config, vllm_config.parallel_config
    dtype = str(mc.dtype).removeprefix("torch.")
    return (f"vllm|{model_identity(mc.model, mc.revision)}|{dtype}|bs{vllm_config.cache_config.block_size}"
            f"|L{mc.get_num_layers(par)}|kv{mc.get_num_kv_heads(par)}|hd{mc.get_head_size()}|{LAYOUT}"
            f"|{hardware_identity(vllm_config.device_config.device_type)}")


class KVPoolMetadata(KVConnectorMetadata):
    """One step's loads and saves, as the scheduler half planned them."""

    def __init__(self, pool: PoolConnectorMetadata) -> None:
        self.pool = pool


@dataclass
class KVPoolStats(KVConnectorStats):
    """Counter increments since the last report (vLLM sums them across workers and logs
    them as "KV Transfer metrics")."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# Our counters as Prometheus counters on vLLM's /metrics (`kvpool:<name>_total`).
PROM_COUNTERS = {
    "connector_loaded_blocks": "blocks loaded from the pool and validated",
    "connector_failed_blocks": "blocks whose load failed (recomputed)",
    "connector_saved_blocks": "blocks saved into this node's pool",
    "connector_sent_blocks": "blocks handed to a remote decode node (P/D sends)",
    "connector_loads": "loads finished (delivered or failed)",
    "connector_load_seconds": "seconds from issue to finish of the finished loads, summed",
    "pool_bytes_read": "payload bytes read from the pool",
    "pool_remote_hit_blocks": "blocks read from other nodes' pools",
    "pool_failed_reads": "block reads that failed or did not validate",
    "pool_quarantined_slots": "read-buffer slots lost to failed transfers (never reused: bytes may still land)",
    "pool_evictions": "pool slots evicted",
    "pool_published": "blocks published to the metaserver",
    "pool_disk_writes": "blocks written to the pool's disk tier",
    "pool_disk_hits": "blocks read from the pool's disk tier and validated",
    "pool_disk_failed_reads": "disk tier reads that did not validate",
    "pool_disk_evictions": "disk tier slots reused by LRU eviction",
    "pool_disk_errors": "disk tier I/O errors (each turns the tier off)",
    "pool_disk_dropped_writes": "evicted blocks not written to disk (the writer's queue was full)",
    "pool_disk_staged": "disk tier blocks promoted into DRAM for other nodes' reads",
}


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's Prometheus endpoint, per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(self._counter_cls(name=f"kvpool:{key}", documentation=doc,
                                                            labelnames=labelnames), per_engine_labelvalues)
            for key, doc in PROM_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)


@dataclass
class _Tracked:
    request: Request
    block_table: list[int]
    pool_hashes: list[bytes] = field(default_factory=list)   # rehashed vLLM block hashes, extended lazily


def _layer_index(name: str) -> int:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


class KVPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        # vLLM bounds no load; our engine's default bound caps each read here too.
        self._settings = PoolConnectorSettings.from_extra(lambda k, d=None: extra.get(k, d),
                                                          KVTransferConfig.kv_load_timeout_s)
        self._fingerprint = layout_fingerprint(vllm_config)
        self._seed = hashlib.sha256(b"kvpool/vllm\0" + self._fingerprint.encode()).digest()
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: PoolScheduler | None = None
        self._worker: PoolWorker | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._reported: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            algo = vllm_config.cache_config.prefix_caching_hash_algo
            if not str(algo).startswith("sha256") and "PYTHONHASHSEED" not in os.environ:
                log.warning("prefix_caching_hash_algo %s seeds vLLM's block hashes at random in each process "
                            "unless PYTHONHASHSEED is set: no node will hit another's blocks", algo)
            self._scheduler = PoolScheduler(self._settings, self._fingerprint, self._block_size,
                                            consume=ktc.is_kv_consumer, produce=ktc.is_kv_producer)
            warn_namespace_conflicts(self._settings, self._fingerprint, log)
        log.info("kvpool connector (%s) for %s, node %s", role.name, self._fingerprint, self._settings.node_id)

    # ---- scheduler side -------------------------------------------------------------

    def _pool_hashes(self, request: Request) -> list[bytes]:
        t = self._tracked.get(request.request_id)
        hashes = t.pool_hashes if t is not None else []
        for h in request.block_hashes[len(hashes):]:
            hashes.append(hashlib.sha256(self._seed + bytes(h)).digest())
        return hashes

    def on_new_request(self, request: Request) -> None:
        """Start the request's lookup as it arrives (it runs off vLLM's scheduler thread)."""
        assert self._scheduler is not None
        self._tracked.setdefault(request.request_id, _Tracked(request, []))
        self._scheduler.start_lookup(request.request_id, self._pool_hashes(request), request.num_tokens,
                                     request.kv_transfer_params, request.prompt_token_ids)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """None while the lookup is in flight (vLLM asks again next step); never blocks."""
        assert self._scheduler is not None
        t = self._tracked.setdefault(request.request_id, _Tracked(request, []))
        n = self._scheduler.num_matched_tokens(request.request_id, self._pool_hashes(t.request), request.num_tokens,
                                               num_computed_tokens)
        return n, bool(n)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        t = self._tracked.setdefault(request.request_id, _Tracked(request, []))
        t.block_table = list(blocks.get_block_ids()[0])
        self._scheduler.on_alloc(request.request_id, t.block_table, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_table = list(new.block_ids[0])
                self._plan_save(t, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_table = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                t.block_table.extend(new_ids[0])
            self._plan_save(t, cached.num_computed_tokens[i], scheduled.get(rid, 0))
        return KVPoolMetadata(self._scheduler.build_meta())

    def _plan_save(self, t: _Tracked, num_computed_tokens: int, num_new_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.plan_save(t.request.request_id, num_computed_tokens, num_new_tokens, t.block_table,
                                  self._pool_hashes(t.request))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.on_worker_report(connector_output.finished_recving or (),
                                         set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill request asking for a remote decode (`do_remote_decode`) that finished by
        its length (an aborted or failed one holds nothing) keeps its blocks until the worker
        has put its full prompt blocks into the pool (`get_finished` reports the send), and
        answers vLLM's P/D params naming them (`connector.handoff.vllm_producer_params`)."""
        from vllm.v1.request import RequestStatus

        assert self._scheduler is not None
        rid, params = request.request_id, request.kv_transfer_params
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            self._scheduler.forget(rid)
            self._tracked.pop(rid, None)
            return False, None
        sent = self._scheduler.finish_request(rid, params, block_ids, self._pool_hashes(request),
                                              request.num_prompt_tokens, request.num_computed_tokens,
                                              request.prompt_token_ids)
        self._tracked.pop(rid, None)
        if not sent:
            return False, None
        return True, handoff.vllm_producer_params(self._settings.node_id, rid, block_ids, sent.full_blocks,
                                                  self._fingerprint, sent.tail_tokens)

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn where vLLM's KV cache blocks are and start this node's pool."""
        layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_index)]
        elem = layers[0].element_size()
        stride = layers[0].stride(0) * elem
        layer_bytes = layers[0][0].numel() * elem
        for t in layers:
            if t.stride(0) * elem != stride or not t[0].is_contiguous() or t[0].numel() * elem != layer_bytes:
                raise ValueError(f"KVPoolConnector needs per-layer caches [num_blocks, ...] with contiguous "
                                 f"blocks of one size; got shape {tuple(t.shape)} strides {t.stride()}")
        self._worker = PoolWorker(self._settings, self._fingerprint, layer_bytes * len(layers))
        self._worker.register_cache(LayeredCache(tuple(t.data_ptr() for t in layers), stride), layers[0].shape[0],
                                    layers)
        log.info("kvpool: %d layers, %d-byte blocks, %d blocks of KV", len(layers), layer_bytes * len(layers),
                 layers[0].shape[0])

    def _meta(self) -> PoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        return meta.pool

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.begin_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and finish before their request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole, after the forward pass, in `wait_for_save`."""

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.save(self._meta().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(P/D sends whose blocks are all in the pool: vLLM frees their blocks, loads that
        finished)."""
        if self._worker is None:
            return None, None
        sent = self._worker.finished_sends()
        self._worker.take_sent_params()  # vLLM answered its params already (`request_finished`)
        return (sent or None), (self._worker.finished_loads() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counter increments since the last call (the worker's and its pool's)."""
        if self._worker is None:
            return None
        now = self._worker.counters()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if k.startswith(("connector_", "pool_"))
                 and k not in ("pool_blocks", "pool_slots", "pool_publishing", "pool_disk_slots",
                                   "pool_held_blocks")}
        self._reported = now
        return KVPoolStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPoolStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
