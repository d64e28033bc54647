"""The floor under `kvpool bench engine`'s throughput run on this machine: the run's float32
work at this machine's ceilings, with nothing else costing time.

Work (`run_work`): every multiply-add of the run (counted as 2 FLOPs) and every byte of K/V the
decode steps must read, for a Llama-shaped model, with our engine's shortcuts counted in its
favour: a prompt's last layer runs past its QKV projection (attention included) only on the
sampled row, and the LM head only on sampled rows. Attention is exact causal (a prompt of l
tokens scores l(l+1)/2 pairs per head and layer); a decode token at context c reads c keys and
c values of every KV head in every layer, once.

Ceilings (`measure_ceilings`, kvpool_bench/csrc/peak.c): FMA throughput from a register-only
loop, read bandwidth from summing a 1 GiB array (8 interleaved streams per thread: one stream
per core read about half as fast, slower than the decode attention itself), both on the
engine's threads; `kvpool bench
engine --reference vllm` measures them before and after its runs and keeps the higher of each
(`best`).

floor = FLOPs / FMA peak + decode K/V bytes / bandwidth: the two are added, not overlapped,
because a decode step's attention waits on its layer's linears and the next layer's linears
on it. No run of an implementation with this arithmetic can beat it.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from engine.model_config import ModelConfig

SOURCE = Path(__file__).with_name("csrc") / "peak.c"


@dataclass(frozen=True)
class Work:
    linear_flops: float      # projections, MLP and LM head
    attention_flops: float   # QK^T and P.V, prompts and decode
    kv_read_bytes: float     # K/V read by the decode steps

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops


@dataclass(frozen=True)
class Ceilings:
    fma_flops_per_s: float
    read_bytes_per_s: float
    threads: int


def run_work(shape: ModelConfig, prompt_lens: list[int], output_tokens: int, dtype_bytes: int = 4) -> Work:
    """The work of generating `output_tokens` tokens after each prompt (no prefix hits, no
    speculation): the first token comes from the prompt's pass, each later one from a decode
    pass over one token at context prompt + tokens so far."""
    if output_tokens < 1 or any(n < 1 for n in prompt_lens):
        raise ValueError("every prompt and the output need at least one token")
    h, q_dim, kv_dim = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    qkv = h * (q_dim + 2 * kv_dim)
    per_layer = qkv + q_dim * h + 3 * h * shape.intermediate_size   # qkv, o, gate + up + down (MACs a token)
    head = h * shape.vocab_size
    prompts, seqs, layers = sum(prompt_lens), len(prompt_lens), shape.num_layers
    decode_tokens = seqs * (output_tokens - 1)
    macs = (prompts * (layers - 1) * per_layer     # prompt rows, all but the last layer
            + (prompts - seqs) * qkv               # the last layer: K/V for every row ...
            + seqs * per_layer                     # ... and the whole layer on each sampled row
            + decode_tokens * layers * per_layer
            + seqs * output_tokens * head)         # LM head on every sampled row
    # Decode contexts: prompt + 1 .. prompt + output_tokens - 1 (the token being decoded included).
    ctx_sum = sum(n * (output_tokens - 1) + (output_tokens - 1) * output_tokens // 2 for n in prompt_lens)
    # Causal pairs of the prompts: every row in all but the last layer, the sampled row in it.
    pairs = sum((layers - 1) * (n * (n + 1) // 2) + n for n in prompt_lens)
    attn = 4 * shape.num_heads * shape.head_dim * (pairs + layers * ctx_sum)   # 2 FLOPs each for QK and PV
    kv_bytes = 2 * kv_dim * dtype_bytes * layers * ctx_sum
    return Work(2.0 * macs, float(attn), float(kv_bytes))


def _library() -> ctypes.CDLL:
    from engine.native.build import build

    lib = build(SOURCE)
    lib.fma_flops.argtypes = [ctypes.c_int64, ctypes.c_float, ctypes.POINTER(ctypes.c_float)]
    lib.fma_flops.restype = ctypes.c_double
    lib.read_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    lib.read_bytes.restype = ctypes.c_double
    return lib


def measure_ceilings(threads: int, read_gib: float = 1.0, repeats: int = 3) -> Ceilings:
    """FMA peak and read bandwidth on `threads` threads (best of `repeats`; ~2 s)."""
    import torch

    lib = _library()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)   # also the OpenMP count of this thread, which peak.c uses
    try:
        sink, total = ctypes.c_float(), ctypes.c_int64()
        fma = max(lib.fma_flops(50_000_000 // threads, 1.0 + r, ctypes.byref(sink)) for r in range(repeats))
        data = torch.ones(int(read_gib * (1 << 30)) // 4, dtype=torch.int32)
        read = max(lib.read_bytes(data.data_ptr(), data.numel(), ctypes.byref(total)) for _ in range(repeats))
        if total.value != data.numel():   # every element read once
            raise RuntimeError(f"read_bytes summed {total.value}, expected {data.numel()}")
    finally:
        torch.set_num_threads(before)
    return Ceilings(fma, read, threads)


def best(*measured: Ceilings) -> Ceilings:
    """Each ceiling's highest value over several measurements on the same threads: a ceiling
    is what the machine reached, and a measurement taken while something else held the cores
    (a server still exiting, a neighbour on a shared host) only reads lower."""
    if not measured or len({c.threads for c in measured}) != 1:
        raise ValueError("best() needs measurements on one thread count")
    return Ceilings(max(c.fma_flops_per_s for c in measured), max(c.read_bytes_per_s for c in measured),
                    measured[0].threads)


def floor_seconds(work: Work, ceilings: Ceilings) -> tuple[float, float]:
    """(arithmetic at the FMA peak, decode K/V at the read bandwidth), in seconds."""
    return work.flops / ceilings.fma_flops_per_s, work.kv_read_bytes / ceilings.read_bytes_per_s


def summary(work: Work, ceilings: Ceilings, output_tokens: int, wall_s: float, reference_tok_s: float) -> tuple[str, dict]:
    """The floor as one printed paragraph and as report fields, beside a run of `wall_s` seconds
    that produced `output_tokens` tokens and a reference's tokens/s."""
    arith, kv = floor_seconds(work, ceilings)
    floor = arith + kv
    tok_s = output_tokens / floor
    text = (f"floor of the throughput run on this machine (float32, {ceilings.threads} threads): "
            f"{work.flops / 1e12:.2f} TFLOP at the FMA peak {ceilings.fma_flops_per_s / 1e9:.0f} GFLOPS "
            f"(a register-only loop) = {arith:.1f} s, + {work.kv_read_bytes / 1e9:.0f} GB of decode K/V at "
            f"{ceilings.read_bytes_per_s / 1e9:.1f} GB/s (a summing loop) = {kv:.1f} s: {floor:.1f} s, "
            f"{tok_s:.1f} output tok/s = {tok_s / reference_tok_s:.2f}x vLLM-CPU's; this run reached "
            f"{floor / wall_s:.0%} of the floor's speed")
    fields = {"floor_s": floor, "floor_tok_per_s": tok_s, "floor_vs_reference": tok_s / reference_tok_s,
              "tflop": work.flops / 1e12, "decode_kv_gb": work.kv_read_bytes / 1e9,
              "fma_gflops": ceilings.fma_flops_per_s / 1e9, "read_gb_per_s": ceilings.read_bytes_per_s / 1e9}
    return text, fields
