"""The engine loop: add requests, `step()` = schedule -> run the model -> update -> outputs.

    out = scheduler.schedule()
    sampled = runner.execute(out)
    finished = self._postprocess(out, sampled)

Not thread-safe: one thread drives it (the HTTP server runs it in its own loop thread).
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache import CacheLayout, PagedKVCache
from engine.kv_cache_manager import KVCacheManager
from engine.loader import LoadedModel, load_model
from engine.model import LlamaModel
from engine.outputs import RequestOutput, check_stop, make_output
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerConfig

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
    from engine.attention.torch_backend import paged_attention

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
                                pick_attention(config.attention_backend, self.device))
        self.layout = CacheLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, dtype)
        num_blocks = max(2, config.kv_cache_bytes // (self.layout.block_bytes + 64))
        self.cache = PagedKVCache(self.layout, num_blocks)
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        self.fingerprint = (f"{mc.name}|{config.dtype}|bs{config.block_size}|L{mc.num_layers}|kv{mc.num_kv_heads}"
                            f"|hd{mc.head_dim}")
        self.block_pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, config.block_size, self.fingerprint)
        self.connector, self.connector_worker = self._make_connectors(config)
        kvt = config.kv_transfer_config
        loads = {"kv_load_failure_policy": kvt.kv_load_failure_policy, "kv_load_timeout_s": kvt.kv_load_timeout_s} \
            if kvt else {}
        self.load_wait_s = kvt.kv_load_wait_s if kvt else 0.0
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                                   config.enable_chunked_prefill, **loads,
                                                   long_prefill_token_threshold=config.long_prefill_token_threshold),
                                   self.kv, self.connector)
        self.sampler = Sampler()
        self.runner = ModelRunner(self.model, self.cache, self.kv, self.sampler)
        self._ids = itertools.count()
        log.info("engine ready: %s %s on %s, %d KV blocks of %d tokens (%.0f MiB)", mc.name, config.dtype,
                 self.device, num_blocks, config.block_size, self.cache.nbytes / 2**20)

    def _make_connectors(self, config: EngineConfig):  # noqa: ANN202
        """The scheduler-side and worker-side halves of the configured KV connector (or None)."""
        if config.kv_transfer_config is None:
            return None, None
        from connector import factory
        from connector.base import EngineContext, KVConnectorRole
        from kvpool.layout import HEADER_BYTES

        ctx = EngineContext(self.fingerprint, config.block_size, self.layout.block_bytes, self.cache.slot_bytes,
                            HEADER_BYTES)
        worker = factory.create(config.kv_transfer_config, ctx, KVConnectorRole.WORKER)
        try:
            worker.register_kv_caches({"kv_cache": self.cache.raw})
            sched = factory.create(config.kv_transfer_config, ctx, KVConnectorRole.SCHEDULER)
        except BaseException:
            worker.shutdown()
            raise
        return sched, worker

    def close(self) -> None:
        """Stop the connector (unregister from the pool). Idempotent."""
        for c in (self.connector_worker, self.connector):
            if c is not None:
                c.shutdown()
        self.connector = self.connector_worker = None
        self.scheduler.connector = None

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> Request:
        """Validate and queue a request. Raises EngineError for one that cannot be served."""
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
        req = Request(request_id or f"req-{next(self._ids)}", ids, params, cache_salt=cache_salt)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort_request(request_id)
        if req is not None:
            self.sampler.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns an output for every request that produced a token or ended."""
        worker = self.connector_worker
        if worker is not None and self.load_wait_s > 0:
            self._load_before_batch(worker)
        out = self.scheduler.schedule()
        if worker is not None:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
        sampled = self.runner.execute(out) if out.scheduled else {}
        if worker is not None:
            if out.scheduled:
                worker.wait_for_save()
            self._connector_report(worker, idle=not out.scheduled)
        self.scheduler.update_from_output(out, {rid: tok for rid, (tok, _) in sampled.items()})
        outputs = []
        for s in out.scheduled:
            req = s.request
            if req.request_id not in sampled or req.is_finished:
                continue
            _, lp = sampled[req.request_id]
            if lp is not None:
                req.output_logprobs.append(lp)
            status = check_stop(req, self.tokenizer, self.model_config.eos_token_ids, self.max_model_len)
            if status is not None:
                self.scheduler.finish(req, status)
                self.sampler.forget(req.request_id)
            outputs.append(make_output(req))
        while self.scheduler.finished_outside_step:
            outputs.append(make_output(self.scheduler.finished_outside_step.pop()))
        return outputs

    def _load_before_batch(self, worker) -> None:  # noqa: ANN001
        """Start the loads of waiting requests with external hits and wait up to `load_wait_s`
        for them: those done by then are reported before `schedule()`, so their requests are
        prefilled in this step (a pool read takes milliseconds, a step of others' work often
        hundreds). Slower loads go on in the background, as they would have anyway; the wait
        is bounded, so a dead or frozen source delays the other requests by at most that."""
        started = self.scheduler.start_loads()
        if started is None:
            return
        meta, rids = started
        worker.bind_connector_metadata(meta.kv_connector_metadata)
        worker.start_load_kv(None)
        deadline = time.monotonic() + self.load_wait_s
        while True:
            self._connector_report(worker, idle=False)
            if not any(rid in self.scheduler.loading and not self.scheduler.load_reported(rid) for rid in rids) \
                    or time.monotonic() >= deadline:
                return
            time.sleep(0.0005)

    def _connector_report(self, worker, idle: bool) -> None:  # noqa: ANN001
        from connector.base import KVConnectorOutput

        sending, recving = worker.get_finished(set())
        self.scheduler.update_from_connector(KVConnectorOutput(
            sending or set(), recving or set(), worker.get_block_ids_with_load_errors()))
        worker.clear_connector_metadata()
        if idle and self.scheduler.loading and not recving:
            time.sleep(0.0005)  # only loads in flight: do not spin

    def stats(self) -> dict[str, float]:
        """Counters for /metrics and benchmarks (tokens unless named otherwise)."""
        s = self.scheduler
        out: dict[str, float] = {
            "prefill_tokens": s.prefill_tokens, "local_hit_tokens": self.block_pool.hits,
            "remote_hit_tokens": s.remote_hit_tokens, "failed_load_blocks": s.failed_load_blocks,
            "num_requests_loading": len(s.loading), "num_preemptions": s.num_preemptions}
        for half in (self.connector, self.connector_worker):
            if half is not None:
                for k, v in half.get_kv_connector_stats().items():
                    out[k] = out.get(k, 0) + v
        return out

    def prefix_cache_hit_rate(self) -> float:
        return self.block_pool.hits / self.block_pool.queries if self.block_pool.queries else 0.0
