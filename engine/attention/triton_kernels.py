"""Triton kernel: paged attention over the block table for decode and prefill-with-history.

One program per (query token, query head): it walks the token's sequence blocks up to its
own position (causal), with an online softmax, reading K and V straight from the
block-contiguous cache (GQA: query head h reads KV head h // group). Decode steps, prefill
chunks with history and fresh prefills of different lengths run in one launch.

Loads are upcast to fp32 at once (the CPU interpreter computes wrongly in bf16).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    Q, K_CACHE, OUT, BLOCK_TABLES, TOKEN_SEQ, TOKEN_POS, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_kv, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(TOKEN_SEQ + t)
    pos = tl.load(TOKEN_POS + t)
    kvh = h // GROUP
    d = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_SIZE)
    q = tl.load(Q + t * stride_qt + h * stride_qh + d).to(tl.float32)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    num_blocks = pos // BLOCK_SIZE + 1
    for b in range(0, num_blocks):
        blk = tl.load(BLOCK_TABLES + seq * stride_bt + b).to(tl.int64)
        tok = b * BLOCK_SIZE + offs
        mask = tok <= pos
        k_ptr = K_CACHE + blk * stride_cb + offs[:, None] * stride_ct + kvh * stride_ch + d[None, :]
        k = tl.load(k_ptr, mask=mask[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(k_ptr + stride_kv, mask=mask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(OUT + t * stride_ot + h * stride_oh + d, (acc / l_i).to(OUT.dtype.element_ty))
