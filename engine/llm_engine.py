"""The engine loop: add requests, `step()` = schedule -> execute -> update from output.

    out = scheduler.schedule()                          # which requests, how many tokens
    result = runner.execute(out)                        # forward pass, sampling, connector I/O
    return scheduler.update_from_output(out, result)    # tokens appended, stops, outputs

The engine builds the parts and wires the KV connector: the scheduler side goes to the
scheduler, the worker side (with the registered cache) to the model runner.

Not thread-safe: one thread drives it (the HTTP server runs it in its own loop thread).
"""
from __future__ import annotations

import functools
import itertools
import logging

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache import CacheLayout, PagedKVCache, slot_bytes_for
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import factory
from engine.kv_connector.base import EngineContext, KVConnectorBase_V1, KVConnectorRole
from engine.loader import LoadedModel, load_model
from engine.model import LlamaModel
from engine.outputs import RequestOutput, check_stop
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import Speculator

log = logging.getLogger(__name__)


class EngineError(Exception):
    """A request cannot be served (the message is for the client)."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_attention(backend: str, device: torch.device):  # noqa: ANN201
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from engine.attention.triton_backend import paged_attention as triton_attention

        return triton_attention
    from engine.attention.cpu_backend import paged_attention

    return paged_attention


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config.model)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or mc.name
        dtype = getattr(torch, config.dtype)
        self.device = pick_device(config.device)
        self.model = LlamaModel(mc, loaded.weights, dtype, self.device,
                                pick_attention(config.attention_backend, self.device), kernels=config.kernels,
                                block_size=config.block_size)
        self.layout = CacheLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, dtype)
        kvt = config.kv_transfer_config
        header_bytes = factory.connector_class(kvt).cache_header_bytes if kvt else 0
        slot_bytes = slot_bytes_for(self.layout.block_bytes, header_bytes)
        num_blocks = max(2, config.kv_cache_bytes // slot_bytes)
        self.cache = PagedKVCache(self.layout, num_blocks, header_bytes, self.device)
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        # KV computed with other matmul kernels differs in its last bits: another namespace
        self.fingerprint = mc.layout_fingerprint(config.dtype, config.block_size) + self.model.kernel_tag()
        self.block_pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, config.block_size, self.fingerprint)
        self.connector, self.connector_worker = self._make_connectors(config)
        stop = functools.partial(check_stop, tokenizer=self.tokenizer, eos_token_ids=mc.eos_token_ids,
                                 max_model_len=self.max_model_len)
        loads = {"kv_load_failure_policy": kvt.kv_load_failure_policy, "kv_load_timeout_s": kvt.kv_load_timeout_s,
                 "kv_load_wait_s": kvt.kv_load_wait_s} if kvt else {}
        self.speculator = self._make_speculator(config)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                                   config.enable_chunked_prefill, **loads,
                                                   long_prefill_token_threshold=config.long_prefill_token_threshold),
                                   self.kv, self.connector, stop, self.speculator)
        self.sampler = Sampler()
        self.runner = ModelRunner(self.model, self.cache, self.kv, self.sampler, self.connector_worker)
        self._ids = itertools.count()
        log.info("engine ready: %s %s on %s, %d KV blocks of %d tokens (%.0f MiB)", mc.name, config.dtype,
                 self.device, num_blocks, config.block_size, self.cache.nbytes / 2**20)

    def _make_connectors(self, config: EngineConfig) -> tuple[KVConnectorBase_V1 | None, KVConnectorBase_V1 | None]:
        """The scheduler-side and worker-side halves of the configured KV connector (or None).
        Raises KVConnectorError when the connector cannot start."""
        if config.kv_transfer_config is None:
            return None, None
        ctx = EngineContext(self.fingerprint, config.block_size, self.layout.block_bytes, self.cache.slot_bytes,
                            self.cache.header_bytes)
        worker = factory.create(config.kv_transfer_config, ctx, KVConnectorRole.WORKER)
        try:
            worker.register_kv_caches({"kv_cache": self.cache.raw})
            sched = factory.create(config.kv_transfer_config, ctx, KVConnectorRole.SCHEDULER)
        except BaseException:
            worker.shutdown()
            raise
        return sched, worker

    def _make_speculator(self, config: EngineConfig) -> Speculator | None:
        sc = config.speculative_config
        if sc is None:
            return None
        if sc.method == "ngram":
            proposer = NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max)
        else:
            from engine.spec_decode.draft import SelfDraftProposer

            proposer = SelfDraftProposer(self.model, self.cache, self.kv, sc.draft_num_layers)
        return Speculator(sc, proposer, self.max_model_len)

    def close(self) -> None:
        """Stop the connector (unregister from the pool). Idempotent."""
        for c in (self.connector_worker, self.connector):
            if c is not None:
                c.shutdown()

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> Request:
        """Validate and queue a request. Raises EngineError for one that cannot be served.
        `kv_transfer_params` go to the KV connector as they are (P/D, `connector.handoff`)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise EngineError("the prompt is empty")
        if any(not 0 <= t < self.model_config.vocab_size for t in ids):
            raise EngineError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise EngineError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                              "tokens (prompt + output)")
        blocks_needed = -(-(len(ids) + 1) // self.config.block_size)
        if blocks_needed > self.block_pool.num_blocks:
            raise EngineError(f"the prompt needs {blocks_needed} KV blocks; the cache has {self.block_pool.num_blocks}")
        req = Request(request_id or f"req-{next(self._ids)}", ids, params, cache_salt=cache_salt,
                      kv_transfer_params=kv_transfer_params)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; returns an output for every request that produced a token or ended."""
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        return self.scheduler.update_from_output(out, result)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics and benchmarks (tokens unless named otherwise)."""
        s = self.scheduler
        out: dict[str, float] = {
            "prefill_tokens": s.prefill_tokens, "local_hit_tokens": self.block_pool.hits,
            "remote_hit_tokens": s.remote_hit_tokens, "failed_load_blocks": s.failed_load_blocks,
            "num_requests_loading": s.num_loading, "num_preemptions": s.num_preemptions,
            "kv_cache_blocks": self.block_pool.num_blocks}
        for half in (self.connector, self.connector_worker):
            if half is not None:
                for k, v in half.get_kv_connector_stats().items():
                    out[k] = out.get(k, 0) + v
        if self.speculator is not None:
            out.update(self.speculator.stats())
        return out

    def prefix_cache_hit_rate(self) -> float:
        return self.block_pool.hits / self.block_pool.queries if self.block_pool.queries else 0.0
