"""Reference attention over the paged cache with torch SDPA (the CPU default)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import PagedKVCache


def causal_mask(num_query: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i (position context_len - num_query + i) sees keys 0 .. its own position."""
    if num_query == 1:
        return None
    q_pos = torch.arange(context_len - num_query, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= q_pos


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> output of the same shape (the new K/V are already cached)."""
    out = torch.empty_like(q)
    for s in meta.seqs:
        qs = q[s.query_start:s.query_start + s.num_query].transpose(0, 1)  # [H, n, hd]
        k, v = cache.gather(layer, s.block_table, s.context_len)            # [ctx, kvh, hd]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if s.num_query == s.context_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = causal_mask(s.num_query, s.context_len, q.device)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s.query_start:s.query_start + s.num_query] = o.transpose(0, 1)
    return out
