"""The C prefill-attention kernel (engine/native/csrc/paged_prefill.c) against SDPA.

It runs for float32 caches with head_dim 64 (the model's) on CPUs with AVX-512 or AVX2 with FMA;
the shapes here cut its query tiles (8 rows with AVX-512, 6 with AVX2) and 32-key tiles at every
kind of edge, with history (chunked prefill) and without, NaN in every cache slot outside the
contexts (never to be read), and GQA groups of 3, 1 and 5 (more query heads than a work item
takes: paged_prefill.c's MAX_GROUP).
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_backend, cpu_kernel
from engine.native.build import build, kernel_isa
from tests.engine.test_cpu_attention import fresh, random_pass

HD = cpu_kernel.PREFILL_HEAD_DIM
BUILT = kernel_isa() in ("x86_64_v4", "x86_64_v3")  # the classes with AVX-512 or AVX2 with FMA


@pytest.fixture(autouse=True)
def built() -> None:
    build(cpu_kernel.PREFILL_SOURCE)  # raises if it cannot build: no silent SDPA fallback


def counted(monkeypatch) -> list[tuple[int, int]]:
    """(num_query, context_len) of every call the kernel accepted."""
    calls: list[tuple[int, int]] = []
    real = cpu_kernel.paged_prefill

    def spy(q, blocks, layer, table, ctx, out, scale):  # noqa: ANN001, ANN202
        done = real(q, blocks, layer, table, ctx, out, scale)
        if done:
            calls.append((q.shape[0], ctx))
        return done
    monkeypatch.setattr(cpu_kernel, "paged_prefill", spy)
    return calls


def check(q, cache, meta, atol: float = 2e-5) -> None:  # noqa: ANN001
    for layer in range(cache.layout.num_layers):
        ref = cpu_backend.paged_attention_reference(q, cache, layer, meta, 0.125)
        out = cpu_backend.paged_attention(q, cache, layer, fresh(meta), 0.125)
        assert torch.isfinite(out).all(), f"layer {layer}: a slot outside a context was read"
        err = (out - ref).abs().max().item()
        assert err <= atol, f"layer {layer}: max error {err}"


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (10, 2)])
def test_prefills_and_chunks_match_sdpa(monkeypatch, heads: int, kv_heads: int) -> None:
    specs = [(1, 1), (7, 7), (8, 8), (9, 9), (31, 31), (32, 32), (33, 33), (100, 100), (130, 130),
             (5, 40), (16, 48), (1, 77), (33, 200), (64, 64 + 15)]
    calls = counted(monkeypatch)
    q, cache, meta = random_pass(specs, seed=21, heads=heads, kv_heads=kv_heads, head_dim=HD)
    check(q, cache, meta)
    # decode rows (one query) go to the decode kernel; every longer chunk to this one, per layer
    taken = [s for s in specs if s[0] > 1]
    assert calls == (taken * 2 if BUILT else [])


def test_the_kernel_is_offered_only_where_it_is_built() -> None:
    """Without AVX-512 or AVX2 with FMA the build leaves the kernel out, and the engine says SDPA
    runs (the report `kvpool bench engine` prints), not a kernel that would decline every call."""
    q, cache, _ = random_pass([(9, 9)], seed=25, heads=9, kv_heads=3, head_dim=HD, layers=1)
    assert cpu_kernel.supports_prefill(q, cache.blocks) is BUILT


def test_a_long_prefill_matches_sdpa(monkeypatch) -> None:
    calls = counted(monkeypatch)
    q, cache, meta = random_pass([(600, 600), (300, 1000)], seed=22, heads=9, kv_heads=3, head_dim=HD, layers=1)
    check(q, cache, meta)
    assert len(calls) == (2 if BUILT else 0)


def test_each_row_sees_exactly_its_causal_prefix() -> None:
    """Changing key p changes the rows at positions >= p and no other: the causal mask holds
    inside a key tile and across tiles."""
    q, cache, meta = random_pass([(70, 100)], seed=23, heads=9, kv_heads=3, head_dim=HD, layers=1)
    s = meta.seqs[0]
    before = cpu_backend.paged_attention(q, cache, 0, fresh(meta), 0.125)
    for p in (30, 45, 63, 64, 99):  # positions of the chunk's rows are 30 .. 99
        cache.blocks[s.block_table[p // cache.layout.block_size], 0, 0, p % cache.layout.block_size] += 3.0
        after = cpu_backend.paged_attention(q, cache, 0, fresh(meta), 0.125)
        changed = ((after - before).abs().amax(dim=(1, 2)) > 1e-4).nonzero().flatten().tolist()
        assert changed == list(range(p - 30, 70)), f"key {p}"
        before = after


def test_other_head_sizes_stay_on_sdpa(monkeypatch) -> None:
    calls = counted(monkeypatch)
    q, cache, meta = random_pass([(20, 20)], seed=24, heads=6, kv_heads=2, head_dim=32)
    assert not cpu_kernel.supports_prefill(q, cache.blocks)
    check(q, cache, meta)
    assert calls == []


@pytest.mark.skipif(not BUILT, reason="the kernel is not built on this CPU")
def test_a_rows_bits_do_not_depend_on_the_chunk_it_ran_in() -> None:
    """Chunked prefill gives the bits an unchunked one does (the pool's equality rests on it: a
    prefix hit computes only the suffix): every split of a 150-token prefill into two chunks,
    each cut differently against the query tiles, yields each row bit for bit."""
    n = 150
    q, cache, meta = random_pass([(n, n)], seed=26, heads=9, kv_heads=3, head_dim=HD, layers=1)
    table = meta.seqs[0].block_table

    def run(first: int, last: int) -> torch.Tensor:  # rows first .. last-1, keys 0 .. last-1
        out = torch.empty_like(q[first:last])
        assert cpu_kernel.paged_prefill(q[first:last], cache.blocks, 0, table, last, out, 0.125)
        return out

    whole = run(0, n)
    for split in (1, 5, 6, 7, 8, 31, 32, 33, 64, 97, 149):
        assert torch.equal(run(0, split), whole[:split]), f"first chunk of a split at {split}"
        assert torch.equal(run(split, n), whole[split:]), f"second chunk of a split at {split}"


def decode_rows(q: torch.Tensor, cache, table: torch.Tensor, positions: list[int]) -> torch.Tensor:  # noqa: ANN001
    """The decode kernel's rows for q's rows at `positions`, each a sequence of its own decoding
    the token at that position (context: the keys up to and including it), in one batch."""
    build(cpu_kernel.SOURCE)
    block = cache.blocks.shape[3]
    rows = torch.tensor(positions, dtype=torch.long)
    ctx = rows + 1
    tables = [table[:-(-(p + 1) // block)] for p in positions]
    starts = torch.tensor([0] + [len(t) for t in tables[:-1]], dtype=torch.long).cumsum(0)
    out = torch.zeros_like(q)
    cpu_kernel.paged_decode(q, cache.blocks, 0, rows, ctx, torch.cat(tables).contiguous(), starts, out, 0.125)
    return out[rows]


@pytest.mark.skipif(not BUILT, reason="the kernel is not built on this CPU")
@pytest.mark.parametrize("heads,kv_heads,block", [(9, 3, 16), (3, 3, 16), (10, 2, 8), (8, 2, 32), (6, 1, 16)])
def test_a_decoded_rows_bits_are_the_prefill_rows(heads: int, kv_heads: int, block: int) -> None:
    """A token decoded (the decode kernel: one row over its context) gets the bits the prefill
    kernel gives the same position of a prompt, so a block of generated tokens (a multi-turn
    prompt's earlier answer) pulled from the node that decoded it equals the same tokens
    prefilled elsewhere. Positions at every tile edge and chunk edge (1,024 keys for one KV head
    an item, 512 or 320 for 2 or 3: paged_decode.c's CHUNK_TILES / nh), alone and in a batch
    large enough for whole-sequence work items at this thread count; groups of 1 to 5 query
    heads, blocks of 8-32."""
    n = 1100
    q, cache, meta = random_pass([(n, n)], seed=28, heads=heads, kv_heads=kv_heads, head_dim=HD, layers=1,
                                 block=block)
    table = meta.seqs[0].block_table
    whole = torch.empty_like(q)
    assert cpu_kernel.paged_prefill(q, cache.blocks, 0, table, n, whole, 0.125)
    positions = [0, 1, 7, 15, 16, 30, 31, 32, 33, 63, 64, 100, 319, 320, 321, 511, 512, 513, 639, 640, 960,
                 1022, 1023, 1024, 1025, 1055, 1056, 1099]
    copies = max(2, -(-8 * torch.get_num_threads() // len(positions)))  # paged_decode.c: >= 8 per thread
    batch = decode_rows(q, cache, table, positions * copies)[:len(positions)]
    for i, p in enumerate(positions):
        alone = decode_rows(q, cache, table, [p])[0]
        assert torch.equal(alone, whole[p]), f"position {p} alone: max diff {(alone - whole[p]).abs().max()}"
        assert torch.equal(batch[i], whole[p]), f"position {p} in a batch of {copies * len(positions)}"
