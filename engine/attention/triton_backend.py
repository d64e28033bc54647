"""Attention backend that launches the Triton paged-attention kernel (used on CUDA)."""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import PagedKVCache


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    from engine.attention.triton_kernels import paged_attention_kernel

    tables, token_seq, token_pos = meta.kernel_tables
    k_cache = cache.blocks[:, layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]; V follows at stride(2)
    out = torch.empty_like(q)
    heads = q.shape[1]
    group = heads // cache.layout.num_kv_heads
    paged_attention_kernel[(q.shape[0], heads)](
        q, k_cache, out, tables, token_seq, token_pos, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cache.blocks.stride(2), tables.stride(0),
        GROUP=group, BLOCK_SIZE=cache.layout.block_size, HEAD_DIM=cache.layout.head_dim,
    )
    return out
