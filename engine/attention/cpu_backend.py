"""Attention over the paged cache on CPU: C kernels for decode and prefill, torch SDPA for the rest.

Decode sequences (one query each) go to the C decode kernel (`cpu_kernel`, float32) where it
built: it reads K/V in place in the paged blocks. Without it (bf16, no compiler) they run
batched: per layer, each decode group of the pass (see `metadata.plan_decode_groups`) gathers
its padded block tables' K and V with one index_select each and runs one SDPA call with a
key-padding mask. GQA without copies: the group's query heads of one KV head are laid out as
that KV head's query rows ([seqs, kv_heads, group, head_dim] against keys [seqs, kv_heads, keys,
head_dim]), so SDPA's fused CPU kernel runs (enable_gqa would send it to the unfused math path).

Prefill chunks go to the C prefill kernel (float32, head_dim 64, AVX-512 or AVX2 with FMA):
flash-attention tiles over the paged K/V in place, no gather. Without it they run one sequence
at a time through SDPA, GQA by broadcasting each KV head over its query heads (stride 0).

`paged_attention_reference` is the plain per-sequence form the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel
from engine.attention.metadata import AttentionMetadata, DecodeGroup
from engine.kv_cache import PagedKVCache


def causal_mask(num_query: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """Query i (position context_len - num_query + i) sees keys 0 .. its own position."""
    if num_query == 1:
        return None
    q_pos = torch.arange(context_len - num_query, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= q_pos


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                    scale: float, c_decode: bool = True, c_prefill: bool = True) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> output of the same shape (the new K/V are already cached).
    c_decode / c_prefill False: the torch path for the decode rows / the prefill chunks even where
    the C kernel runs (engine/op_choice.py times both and keeps the faster)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if c_decode and cpu_kernel.supports(cache.blocks, q.shape[1], cache.layout.num_kv_heads) and q.stride(-1) == 1:
        rows, ctx, tables, starts = meta.decode_tables
        if rows.numel():
            cpu_kernel.paged_decode(q, cache.blocks, layer, rows, ctx, tables, starts, out, scale)
    else:
        for g in meta.decode_groups(cache.layout.block_size):
            out.index_copy_(0, g.rows, _decode_group_attention(q.index_select(0, g.rows), cache, layer, g, scale))
    in_place = c_prefill and cpu_kernel.supports_prefill(q, cache.blocks)
    for s in meta.prefill_seqs:
        qs = q[s.query_start:s.query_start + s.num_query]
        if in_place and cpu_kernel.paged_prefill(qs, cache.blocks, layer, s.block_table, s.context_len,
                                                 out[s.query_start:s.query_start + s.num_query], scale):
            continue
        k, v = cache.gather(layer, s.block_table, s.context_len)  # [ctx, kvh, hd]
        mask = None if s.num_query == s.context_len else meta.causal_mask(s, q.dtype)
        out[s.query_start:s.query_start + s.num_query] = _prefill_attention(qs, k, v, mask, scale)
    return out


def _decode_group_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, g: DecodeGroup,
                            scale: float) -> torch.Tensor:
    """q: [n, heads, head_dim], one query per sequence -> [n, heads, head_dim]."""
    n, heads, hd = q.shape
    kvh, bs = cache.layout.num_kv_heads, cache.layout.block_size
    keys = g.width * bs
    kv = cache.gather_blocks(layer, g.blocks)  # [2, n * width, bs, kvh, hd]
    if g.stale_keys is not None:
        # Slots past a context in its last block are masked but must be finite (-inf + NaN is NaN,
        # 0 * NaN too): zero them (at most block_size - 1 per sequence). Padding blocks are a full
        # block of the group: finite.
        kv.view(2, n * keys, kvh * hd).index_fill_(1, g.stale_keys, 0)
    k = kv[0].view(n, keys, kvh, hd).transpose(1, 2)  # [n, kvh, keys, hd]
    v = kv[1].view(n, keys, kvh, hd).transpose(1, 2)
    qg = q.view(n, kvh, heads // kvh, hd)        # a KV head's query heads as its query rows
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.additive_mask(q.dtype), scale=scale)
    return o.reshape(n, heads, hd)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """q: [n, heads, hd] (the last n positions of the context), k/v: [ctx, kvh, hd] -> [n, heads, hd].
    mask: None for a fresh prefill (n == ctx: plain causal), else the chunk's causal mask."""
    n, heads, hd = q.shape
    context_len, kvh = k.shape[0], k.shape[1]
    group = heads // kvh
    qg = q.view(n, kvh, group, hd).permute(1, 2, 0, 3)               # [kvh, group, n, hd]
    kg = k.permute(1, 0, 2)[:, None].expand(kvh, group, context_len, hd)  # stride 0 over the group
    vg = v.permute(1, 0, 2)[:, None].expand(kvh, group, context_len, hd)
    if mask is None:
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(n, heads, hd)


def paged_attention_reference(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """One sequence at a time, SDPA with enable_gqa: the reference for tests."""
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
