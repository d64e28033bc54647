"""`kvpool bench kernels`: the calibration behind `--kernels auto` (engine/kernel_choice.py),
run afresh and printed op by op: oneDNN's time over our C kernel's at the model's linear
shapes, whether oneDNN's rows are batch-invariant, the kernel the rule picks, and the C
kernel's rows per micro-kernel call at each batch size of the mix. With
`--write` the result replaces this machine's cached choice (what engines will run).

Then attention: the C kernels (engine/native/csrc/paged_prefill.c where this CPU has AVX-512 or
AVX2 with FMA, paged_decode.c) against the torch paths the engine runs without them (gather the
K/V out of the paged cache, then SDPA), at fresh prefills, chunks after history and decode
batches, each the fastest of interleaved calls (a load from elsewhere only ever adds time)."""
from __future__ import annotations

import argparse
import time

# (query rows, context) of prefill attention calls: fresh prefills and a 512-row chunk after history
ATTENTION_SHAPES = ((128, 128), (512, 512), (512, 2048), (2048, 2048))
# (sequences, context each) of decode attention calls
DECODE_SHAPES = ((1, 512), (8, 512), (8, 2048), (64, 1024))


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("kernels", help="time the C and oneDNN linears at the model's shapes (what --kernels auto picks)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--rounds", type=int, default=1, help="calibrate this many times (to see the spread)")
    p.add_argument("--write", action="store_true", help="store the last round as this machine's choice")


def main(args: argparse.Namespace) -> int:
    import torch

    from engine import kernel_choice as kc
    from kvpool_bench.cpuinfo import cpu_info, describe

    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.loader import load_model

    config = load_model(args.model).config
    ops = kc.linear_ops(config)
    print(describe(cpu_info()) + f"; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'op':8s} {'shape':16s} {'oneDNN / C time':>16s}  {'oneDNN rows invariant':>21s}  "
          f"{'C rows per call (batch:rows)':>28s}  chosen")
    last: dict[str, kc.Choice] = {}
    for _ in range(args.rounds):
        for op in ops:
            t0 = time.perf_counter()
            c = kc.calibrate(op)
            probe = kc.HEAD_PROBE_BATCHES if op.head else kc.PROBE_BATCHES
            invariant = c.invariant if c.invariant is not None else kc.onednn_invariant(op, probe)
            blocks = " ".join(f"{m}:{r}" for m, r in c.blocks)
            print(f"{op.name:8s} {op.key:16s} {c.onednn_s / c.c_s:16.2f}  {str(invariant):>21s}  {blocks:>28s}  "
                  f"{'C panels' if c.kernel == kc.C else 'oneDNN'}  ({time.perf_counter() - t0:.2f} s)")
            last[op.name] = c
    attention(config)
    if args.write:
        path = kc.cache_path()
        path.unlink(missing_ok=True)
        kc.choose(ops, "auto", path, lambda op: last[op.name])
        print(f"written: {path}")
    return 0


def attention(config, repeats: int = 5) -> None:  # noqa: ANN001
    """Print the torch path's time over the C kernels' per attention shape (one layer, the
    engine's `cpu_backend.paged_attention` either way; "not built" where the C kernel is not)."""
    import torch

    from engine.attention import cpu_backend, cpu_kernel
    from engine.attention.metadata import AttentionMetadata, SeqSpan
    from engine.kv_cache import CacheLayout, PagedKVCache

    heads, kvh, hd, bs = config.num_heads, config.num_kv_heads, config.head_dim, 16
    print(f"{'attention':10s} {'rows x context':16s} {'torch / C time':>16s}  {'C (ms)':>8s}  {'torch (ms)':>10s}")
    gen = torch.Generator().manual_seed(0)
    shapes = [("prefill", 1, rows, ctx) for rows, ctx in ATTENTION_SHAPES] + \
             [("decode", seqs, 1, ctx) for seqs, ctx in DECODE_SHAPES]
    for kind, seqs, rows, ctx in shapes:
        nb = -(-ctx // bs)
        cache = PagedKVCache(CacheLayout(1, kvh, hd, bs, torch.float32), seqs * nb + 1)
        cache.blocks.normal_(generator=gen)
        tables = (1 + torch.randperm(seqs * nb, generator=gen)).view(seqs, nb)
        spans = [SeqSpan(i * rows, rows, ctx, tables[i]) for i in range(seqs)]
        q = torch.randn(seqs * rows, heads, hd, generator=gen)
        label = f"{seqs} x {ctx}" if kind == "decode" else f"{rows} x {ctx}"

        def run(c: bool) -> None:
            meta = AttentionMetadata(spans, torch.zeros(seqs * rows, dtype=torch.long),
                                     torch.zeros(seqs * rows, dtype=torch.long))
            cpu_backend.paged_attention(q, cache, 0, meta, 0.125, c_kernels=c)

        built = cpu_kernel.supports_prefill(q, cache.blocks) if kind == "prefill" else \
            cpu_kernel.supports(cache.blocks, heads, kvh)
        if not built:
            print(f"{kind:10s} {label:16s} {'C kernel not built':>16s}")
            continue
        best = {True: float("inf"), False: float("inf")}
        for _ in range(repeats):
            for c in (True, False):
                t0 = time.perf_counter()
                run(c)
                best[c] = min(best[c], time.perf_counter() - t0)
        print(f"{kind:10s} {label:16s} {best[False] / best[True]:16.2f}  {best[True] * 1e3:8.2f}  "
              f"{best[False] * 1e3:10.2f}")
