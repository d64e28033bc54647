"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens."""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.kv_cache import PagedKVCache
from engine.kv_cache_manager import KVCacheManager
from engine.model import LlamaModel
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler.output import SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager, sampler: Sampler) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.sampler = sampler
        self.block_size = cache.layout.block_size
        self.device = model.device

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                     list[Request]]:
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        logits_idx: list[int] = []
        samplers: list[Request] = []
        slot_blocks: list[int] = []
        bs = self.block_size
        for s in out.scheduled:
            req = s.request
            start, n = req.num_computed_tokens, s.num_new_tokens
            q0 = len(ids)
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            block_ids = self.kv.block_ids(req.request_id)
            slot_blocks.extend(block_ids[p // bs] for p in range(start, start + n))
            spans.append(SeqSpan(q0, n, start + n, torch.tensor(block_ids, dtype=torch.long, device=self.device)))
            if s.samples:
                logits_idx.append(q0 + n - 1)
                samplers.append(req)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(spans, torch.tensor(slot_blocks, dtype=torch.long, device=self.device),
                                 pos_t % bs)
        return torch.tensor(ids, dtype=torch.long, device=self.device), pos_t, meta, logits_idx, samplers

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, dict[int, float] | None]]:
        """Run the step; returns the sampled token (and logprobs) of each request that samples."""
        if not out.scheduled:
            return {}
        ids, pos, meta, logits_idx, reqs = self.prepare(out)
        logits_at = torch.tensor(logits_idx, dtype=torch.long, device=self.device)  # may be empty: no one samples
        logits = self.model.forward(ids, pos, self.cache, meta, logits_at)
        return {r.request_id: s for r, s in zip(reqs, self.sampler.sample(logits.cpu(), reqs))}
