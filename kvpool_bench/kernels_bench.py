"""`kvpool bench kernels`: the calibration behind `--kernels auto` (engine/kernel_choice.py),
run afresh and printed op by op: oneDNN's time over our C kernel's at the model's linear
shapes, whether oneDNN's rows are batch-invariant, the kernel the rule picks, and the C
kernel's rows per micro-kernel call at each batch size of the mix. With
`--write` the result replaces this machine's cached choice (what engines will run)."""
from __future__ import annotations

import argparse
import time


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

    ops = kc.linear_ops(load_model(args.model).config)
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
    if args.write:
        path = kc.cache_path()
        path.unlink(missing_ok=True)
        kc.choose(ops, "auto", path, lambda op: last[op.name])
        print(f"written: {path}")
    return 0
