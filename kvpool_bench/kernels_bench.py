"""`kvpool bench kernels`: the calibration behind `--kernels auto` (engine/kernel_choice.py),
run afresh and printed op by op: oneDNN's time over our C kernel's at the model's linear
shapes, whether oneDNN's rows are batch-invariant, the kernel the rule picks, and the C
kernel's rows per micro-kernel call at each batch size of the mix. With
`--write` the result replaces this machine's cached choice (what engines will run).

Then the attention and elementwise ops (engine/op_choice.py): the C kernels
(engine/native/csrc/paged_prefill.c where this CPU has AVX-512 or AVX2 with FMA, paged_decode.c,
the layer ops) against the torch paths the engine runs without them (gather the K/V out of the
paged cache, then SDPA; the torch norms, RoPE and SiLU), at fresh prefills, chunks after history,
decode batches and a layer's elementwise steps, each the fastest of interleaved calls (a load
from elsewhere only ever adds time); then each op's choice by the same rule and whether the
torch path's rows are bit-identical however a pass is batched or chunked."""
from __future__ import annotations

import argparse
import time



def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("kernels", help="time the C kernels against oneDNN and torch at the model's shapes (what --kernels auto picks)")
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
    from engine import layer_ops

    # as the engine runs it: the SiLU a step of its own unless the C gated panels fuse it
    gated = last["gate_up"].kernel == kc.C and layer_ops.gated_packable(
        torch.empty(2 * config.intermediate_size, config.hidden_size))
    others = other_ops(config, args.rounds, silu=not gated)
    if args.write:
        path = kc.cache_path()
        path.unlink(missing_ok=True)
        kc.choose(ops, "auto", path, lambda op: last[op.name])
        kc.choose([op for op, _ in others.values()], "auto", path, lambda op: others[op.name][1])
        print(f"written: {path}")
    return 0


def other_ops(config, rounds: int, silu: bool) -> dict:  # noqa: ANN001
    """The attention and elementwise ops (engine/op_choice.py): per shape, the torch path's time
    over the C kernel's (the fastest of interleaved calls; "C kernel not built" where it is not),
    then each op's choice by the engine's rule, `rounds` times. Returns the last round's choices."""
    import torch

    from engine import kernel_choice as kc
    from engine import op_choice as oc

    built = {op.name for op in oc.available_ops(config, silu=silu)}
    print(f"{'op':12s} {'rows x context':16s} {'torch / C time':>16s}  {'C (ms)':>8s}  {'torch (ms)':>10s}")
    for op in oc.model_ops(config, silu=silu):
        kind = {oc.ATTN_PREFILL: "prefill", oc.ATTN_DECODE: "decode"}.get(op.name, op.name)
        for label, run in oc.timing_cases(op):
            if op.name not in built:
                print(f"{kind:12s} {label:16s} {'C kernel not built':>16s}")
                continue
            c_s, torch_s = oc.time_case(run)
            print(f"{kind:12s} {label:16s} {torch_s / c_s:16.2f}  {c_s * 1e3:8.2f}  {torch_s * 1e3:10.2f}")
    print(f"{'op':12s} {'key':28s} {'torch / C time':>16s}  {'torch rows invariant':>20s}  chosen")
    last: dict = {}
    for _ in range(rounds):
        for op in oc.model_ops(config, silu=silu):
            if op.name not in built:
                continue
            t0 = time.perf_counter()
            c = oc.calibrate(op)
            with torch.inference_mode():
                invariant = c.invariant if c.invariant is not None else oc.torch_invariant(op)
            print(f"{op.name:12s} {op.key:28s} {c.onednn_s / c.c_s:16.2f}  {str(invariant):>20s}  "
                  f"{'C' if c.kernel == kc.C else 'torch'}  ({time.perf_counter() - t0:.2f} s)")
            last[op.name] = (op, c)
    return last
