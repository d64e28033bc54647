"""Self-draft proposer (early exit, as in LayerSkip / self-speculative decoding): the target's
first N layers, then its final norm and LM head, propose k tokens one step at a time.

No smaller model of this family is available offline, so the draft is a slice of the target.
It shares the target's paged KV cache: the draft's K/V of layers 0..N-1 at a position are what
the target computes there for the same token, so the draft reads the target's cache for the
history, writes its own slots for the positions it drafts (blocks allocated for them here),
and the verify pass then overwrites those slots for every layer. Rejected positions are past
the request's computed tokens: never read, never hashed, freed by the scheduler's trim.
"""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.kv_cache import PagedKVCache
from engine.kv_cache_manager import KVCacheManager
from engine.model import LlamaModel
from engine.request import Request
from engine.probs import target_probs
from engine.spec_decode.proposer import Proposal


class SelfDraftProposer:
    prior_acceptance = 0.5   # a failed try costs k draft passes: pause after the first
    costly = True

    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager, num_layers: int = 0) -> None:
        total = len(model.layers)
        self.num_layers = num_layers or max(1, total // 4)
        if not 1 <= self.num_layers < total:
            raise ValueError(f"draft_num_layers must be in 1..{total - 1} for this model, got {num_layers}")
        self.model, self.cache, self.kv = model, cache, kv
        self.block_size = cache.layout.block_size

    def propose_batch(self, requests: list[Request], ks: list[int]) -> list[Proposal | None]:
        """k_i tokens for each request (fewer if its blocks for them cannot be allocated: none)."""
        live = []
        for r, k in zip(requests, ks):
            # room for the positions the draft writes: the last token's and k - 1 drafts'
            if self.kv.allocate_slots(r, k) is not None:
                live.append((r, k))
        out: dict[str, Proposal] = {}
        if not live:
            return [None] * len(requests)
        tokens = {r.request_id: [] for r, _ in live}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in live}
        for step in range(max(k for _, k in live)):
            batch = [(r, k) for r, k in live if step < k]
            logits = self._forward(batch, tokens, step)
            for (r, _), row in zip(batch, logits):
                p = r.sampling_params
                if p.greedy:
                    t = int(torch.argmax(row))
                else:
                    q = target_probs(row, p)
                    t = int(torch.multinomial(q, 1))
                    probs[r.request_id].append(q)
                tokens[r.request_id].append(t)
        for r, _ in live:
            qs = probs[r.request_id]
            out[r.request_id] = Proposal(tokens[r.request_id], torch.stack(qs) if qs else None)
        return [out.get(r.request_id) for r in requests]

    def _forward(self, batch: list[tuple[Request, int]], tokens: dict[str, list[int]], step: int) -> torch.Tensor:
        """One draft step: each request's newest token (its last real one at step 0, then its drafts)."""
        device = self.model.device
        ids, pos, spans, slot_blocks = [], [], [], []
        for i, (r, _) in enumerate(batch):
            p = r.num_computed_tokens + step
            ids.append(r.all_token_ids[-1] if step == 0 else tokens[r.request_id][step - 1])
            pos.append(p)
            table = self.kv.block_ids(r.request_id)
            slot_blocks.append(table[p // self.block_size])
            spans.append(SeqSpan(i, 1, p + 1, torch.tensor(table, dtype=torch.long, device=device)))
        pos_t = torch.tensor(pos, dtype=torch.long, device=device)
        meta = AttentionMetadata(spans, torch.tensor(slot_blocks, dtype=torch.long, device=device),
                                 pos_t % self.block_size)
        return self.model.forward(torch.tensor(ids, dtype=torch.long, device=device), pos_t, self.cache, meta,
                                  torch.arange(len(batch), device=device), num_layers=self.num_layers).cpu()
