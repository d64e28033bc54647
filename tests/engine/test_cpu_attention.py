"""Decode attention of the CPU backend against the per-sequence reference, on random paged
caches: GQA, varied context lengths (block boundaries, one token, long), decode and prefill
chunks in one pass, and garbage (NaN) in every cache slot outside a context. Every test runs
twice: decode in the C kernel (which must build here) and in the batched SDPA groups."""
from __future__ import annotations

import random

import pytest
import torch

from engine.attention import cpu_backend, cpu_kernel
from engine.attention import metadata as md
from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.kv_cache import CacheLayout, PagedKVCache
from engine.native.build import build

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 8


@pytest.fixture(params=["kernel", "groups"], autouse=True)
def decode_path(request, monkeypatch) -> str:
    if request.param == "kernel":
        build(cpu_kernel.SOURCE)  # raises if it cannot build: never a silent fall back to the other path
        assert cpu_kernel.available()
    else:
        monkeypatch.setattr(cpu_kernel, "supports", lambda *a: False)
    return request.param


def random_pass(specs: list[tuple[int, int]], seed: int, dtype: torch.dtype = torch.float32,
                layers: int = 2, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
                block: int = BLOCK) -> tuple[torch.Tensor, PagedKVCache, AttentionMetadata]:
    """specs: (num_query, context_len) per sequence, in batch order. Slots outside every context hold NaN
    (the tail of a partly filled block, unused blocks, block 0), as a failed remote load can leave them."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // block) for _, ctx in specs)
    cache = PagedKVCache(CacheLayout(layers, kv_heads, head_dim, block, dtype), need + 5)
    cache.blocks.fill_(float("nan"))
    perm = 1 + torch.randperm(need + 4, generator=gen)  # block 0 and 4 others stay NaN
    seqs, start, used = [], 0, 0
    for nq, ctx in specs:
        nb = -(-ctx // block)
        table = perm[used:used + nb].clone()
        used += nb
        for layer in range(layers):
            for kv in (0, 1):
                vals = torch.randn(nb * block, kv_heads, head_dim, generator=gen).to(dtype)
                vals[ctx:] = float("nan")  # the tail of the last block: never to be read
                cache.blocks[table, layer, kv] = vals.view(nb, block, kv_heads, head_dim)
        seqs.append(SeqSpan(start, nq, ctx, table))
        start += nq
    meta = AttentionMetadata(seqs, torch.zeros(start, dtype=torch.long), torch.zeros(start, dtype=torch.long))
    q = torch.randn(start, heads, head_dim, generator=gen).to(dtype)
    return q, cache, meta


def fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.seqs, meta.slot_block_ids, meta.slot_offsets)


def check(q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata, atol: float) -> None:
    for layer in range(cache.layout.num_layers):
        ref = cpu_backend.paged_attention_reference(q, cache, layer, meta, 0.3)
        out = cpu_backend.paged_attention(q, cache, layer, meta, 0.3)
        assert torch.isfinite(ref).all()
        assert torch.isfinite(out).all(), f"layer {layer}: non-finite output (padding not masked or not zeroed)"
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= atol, f"layer {layer}: max error {err}"


CONTEXTS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 129, 250, 37, 5, 300, 8, 47, 200]


@pytest.mark.parametrize("group_cost,max_tokens", [(md.GROUP_COST_TOKENS, md.MAX_GROUP_TOKENS),
                                                    (1, 1 << 30),        # one group per distinct length
                                                    (10**9, 1 << 30),    # one group, heavy padding
                                                    (64, 256)])          # small groups by the token cap
def test_batched_decode_matches_reference(monkeypatch, group_cost: int, max_tokens: int) -> None:
    monkeypatch.setattr(md, "GROUP_COST_TOKENS", group_cost)
    monkeypatch.setattr(md, "MAX_GROUP_TOKENS", max_tokens)
    q, cache, meta = random_pass([(1, c) for c in CONTEXTS], seed=1)
    groups = meta.decode_groups(BLOCK)
    rows = sorted(r for g in groups for r in g.rows.tolist())
    assert rows == list(range(len(CONTEXTS)))  # every decode sequence in exactly one group
    if group_cost == 10**9:
        assert len(groups) == 1
    if group_cost == 1:
        assert len(groups) == len({-(-c // BLOCK) for c in CONTEXTS})
    check(q, cache, meta, atol=1e-5)


def test_decode_and_prefill_mixed_in_one_pass() -> None:
    # decodes interleaved with a prefill with history, a fresh prefill, a one-block prefill
    specs = [(1, 37), (5, 20), (1, 16), (9, 9), (1, 1), (1, 129), (16, 16), (3, 50), (1, 64)]
    q, cache, meta = random_pass(specs, seed=2)
    check(q, cache, meta, atol=1e-5)


def test_no_padding_group_and_only_prefills() -> None:
    q, cache, meta = random_pass([(1, 32)] * 5, seed=3)  # all full blocks, same length: no mask
    assert all(g.key_mask is None for g in meta.decode_groups(BLOCK))
    check(q, cache, meta, atol=1e-5)
    q, cache, meta = random_pass([(12, 12), (4, 40)], seed=4)
    assert meta.decode_groups(BLOCK) == []
    check(q, cache, meta, atol=1e-5)


def test_random_passes() -> None:
    rng = random.Random(5)
    for seed in range(6):
        specs = []
        for _ in range(rng.randint(1, 24)):
            ctx = rng.randint(1, 400)
            specs.append((1, ctx) if rng.random() < 0.7 else (rng.randint(1, ctx), ctx))
        q, cache, meta = random_pass(specs, seed=10 + seed)
        check(q, cache, meta, atol=1e-5)


def test_bfloat16() -> None:
    q, cache, meta = random_pass([(1, c) for c in CONTEXTS] + [(7, 30)], seed=6, dtype=torch.bfloat16)
    check(q, cache, meta, atol=2e-2)


def test_a_wrong_key_is_detected() -> None:
    """The comparison can fail: one changed cached key of one sequence changes its output."""
    q, cache, meta = random_pass([(1, c) for c in (40, 17, 9)], seed=7)
    ref = cpu_backend.paged_attention_reference(q, cache, 0, meta, 0.3)
    cache.blocks[meta.seqs[1].block_table[2], 0, 0, 0] += 5.0  # token 16 of the 17-token sequence
    out = cpu_backend.paged_attention(q, cache, 0, fresh(meta), 0.3)
    assert (out[1] - ref[1]).abs().max() > 1e-3
    assert torch.allclose(out[[0, 2]], ref[[0, 2]], atol=1e-5)


def test_float32_decode_takes_the_kernel(decode_path: str, monkeypatch) -> None:
    """With the kernel built, fp32 decode rows go through it (and only decode rows)."""
    calls = []
    real = cpu_kernel.paged_decode
    monkeypatch.setattr(cpu_kernel, "paged_decode", lambda *a: calls.append(a[3].tolist()) or real(*a))
    q, cache, meta = random_pass([(1, 20), (4, 12), (1, 9)], seed=8)
    check(q, cache, meta, atol=1e-5)
    assert calls == ([[0, 5]] * 2 if decode_path == "kernel" else [])


def test_the_models_shapes() -> None:
    """SmolLM2-135M's decode shape (9 query heads on 3 KV heads, head_dim 64, 16-token blocks),
    which the kernel runs in its tiled path (AVX-512 or AVX2) where it can: every block edge, one
    key, long, and past its 1,024-key chunks (one key over, several chunks)."""
    contexts = [1, 2, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 700, 1023, 1024, 1025, 1040, 2100, 3077]
    q, cache, meta = random_pass([(1, c) for c in contexts] + [(5, 40)], seed=12, heads=9, kv_heads=3,
                                 head_dim=64, block=16)
    check(q, cache, meta, atol=1e-5)


def test_a_decode_rows_bits_do_not_depend_on_its_batch(decode_path: str) -> None:
    """The kernel gives a sequence the same bits in a batch of many (where the kernel takes
    whole sequences per work item) as alone (one KV head per item): the pool's equality rests on
    it (a prefix hit's suffix decodes in another batch than the source's). The batched SDPA
    groups pad to a group's longest member: there, equal to float32 rounding."""
    contexts = [1, 15, 16, 17, 100, 257, 700, 1023, 1025, 2100]
    contexts *= max(3, -(-8 * torch.get_num_threads() // len(contexts)))  # paged_decode.c: >= 8 per thread
    q, cache, meta = random_pass([(1, c) for c in contexts], seed=13, heads=9, kv_heads=3, head_dim=64, block=16,
                                 layers=1)
    batch = cpu_backend.paged_attention(q, cache, 0, meta, 0.125)
    for i, seq in enumerate(meta.seqs):
        alone = AttentionMetadata([SeqSpan(0, 1, seq.context_len, seq.block_table)], torch.zeros(1, dtype=torch.long),
                                  torch.zeros(1, dtype=torch.long))
        out = cpu_backend.paged_attention(q[i:i + 1], cache, 0, alone, 0.125)
        same = torch.equal(out[0], batch[i]) if decode_path == "kernel" else torch.allclose(out[0], batch[i], atol=1e-6)
        assert same, f"sequence {i} (context {seq.context_len})"


def test_the_kernel_leaves_subnormal_floats_alone() -> None:
    """Loading the kernel (compiled with -ffast-math) must not turn on flush-to-zero process-wide."""
    build(cpu_kernel.SOURCE)
    tiny, one = float.fromhex("0x0.0000000000001p-1022"), float(len("x"))
    assert tiny * one > 0.0
    t = torch.full((4,), 1e-40, dtype=torch.float32)
    assert (t * 1.0 > 0).all()
