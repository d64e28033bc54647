"""The Triton paged-attention kernel against the CPU backend, on CPU under TRITON_INTERPRET=1.

Runs in a child process so that TRITON_INTERPRET is set before any @triton.jit runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import torch
from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.attention import cpu_backend, triton_backend
from engine.kv_cache import CacheLayout, PagedKVCache

torch.manual_seed(0)
layout = CacheLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
cache = PagedKVCache(layout, 24)
cache.blocks.normal_()
# Decode (1 query, 37 in context), prefill with history (5 of 20), fresh prefill (9 of 9),
# another decode at a block boundary (1 of 16): GQA 6 query heads over 2 KV heads.
specs = [(1, 37), (5, 20), (9, 9), (1, 16)]
perm = torch.randperm(24)
seqs, start, used = [], 0, 0
for nq, ctx in specs:
    nb = -(-ctx // 8)
    seqs.append(SeqSpan(start, nq, ctx, perm[used:used + nb].clone()))
    start += nq
    used += nb
meta = AttentionMetadata(seqs, torch.zeros(start, dtype=torch.long), torch.zeros(start, dtype=torch.long))
q = torch.randn(start, 6, 16)
for layer in (0, 1):
    ref = cpu_backend.paged_attention(q, cache, layer, meta, 0.25)
    out = triton_backend.paged_attention(q, cache, layer, meta, 0.25)
    err = (out - ref).abs().max().item()
    assert err < 1e-4, err
print("OK", err)
"""


def test_triton_kernel_matches_torch_reference_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK")
