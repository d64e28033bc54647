"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) over a paged KV cache.

A forward pass takes a flat batch of tokens from many sequences (prefill chunks and decode
steps mixed) with their positions and attention metadata, writes each token's K and V into
the cache, and returns the hidden states of the requested tokens.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.model_config import ModelConfig

AttentionFn = Callable[[torch.Tensor, PagedKVCache, int, AttentionMetadata, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Layer:
    def __init__(self, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        get = lambda name: w[prefix + name].to(dtype)  # noqa: E731
        self.in_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        self.qkv = torch.cat([get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"),
                              get("self_attn.v_proj.weight")]).contiguous()
        self.o = get("self_attn.o_proj.weight").contiguous()
        self.gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]).contiguous()
        self.down = get("mlp.down_proj.weight").contiguous()


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, attention: AttentionFn) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention = attention
        to = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        self.embed = to(weights["model.embed_tokens.weight"])
        self.lm_head = self.embed if config.tie_embeddings else to(weights["lm_head.weight"])
        self.norm = to(weights["model.norm.weight"])
        self.layers = [Layer({k: v.to(device) for k, v in weights.items() if k.startswith(f"model.layers.{i}.")},
                             f"model.layers.{i}.", dtype) for i in range(config.num_layers)]
        hd = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
        t = torch.arange(config.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.scale = hd ** -0.5

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x32 = x.float()
        return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Run the batch; returns fp32 logits for the tokens at `logits_indices`."""
        c = self.config
        n = input_ids.shape[0]
        h = self.embed[input_ids]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.in_norm, c.rms_eps)
            qkv = F.linear(x, layer.qkv)
            q = qkv[:, :q_size].view(n, c.num_heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(n, c.num_kv_heads, c.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            cache.write(i, meta.slot_block_ids, meta.slot_offsets, k, v)
            attn = self.attention(q, cache, i, meta, self.scale)
            h = h + F.linear(attn.reshape(n, q_size), layer.o)
            x = rms_norm(h, layer.post_norm, c.rms_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        h = rms_norm(h[logits_indices], self.norm, c.rms_eps)
        return F.linear(h, self.lm_head).float()
