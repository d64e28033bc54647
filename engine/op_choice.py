"""Which implementation the attention and elementwise ops run on this CPU: our C kernels or the
torch paths the engine runs without them, chosen by timing both at the model's shapes as the
linears' matmul is (engine/kernel_choice.py: the same rule, margin, confirming rounds and
per-machine cache), so that no op runs slower than its fallback on a CPU the kernels were not
tuned on. Three switches, each one op of the engine:

- attn_decode: the decode rows (one query each): the C paged decode kernel
  (engine/attention/cpu_kernel.py) or the batched SDPA groups (engine/attention/cpu_backend.py).
- attn_prefill: the prefill chunks: the C flash prefill kernel or SDPA per sequence.
- layer_ops: RMSNorm (with the residual add), RoPE and SiLU-and-multiply: the fused C calls
  (engine/layer_ops.py) or the torch ops (engine/torch_ops.py).

The pool's equality needs a row's bits not to depend on how its pass was batched or chunked
(a prefix hit's suffix runs as a smaller chunk than the full prefill that made the blocks). The
C kernels have that by construction; a torch path is taken only where it is faster by the
margin and probes show it has it too on this CPU (`torch_invariant`): a sequence's rows
prefilled whole and in chunks of several sizes, a decode row alone and in batches beside longer
and shorter contexts (other padding), the first m rows of a batch against the whole batch's.
Where torch is taken the fingerprint names the op (`tag`: "|torch:attn_prefill@<digest of the
machine key>"): its bits are this CPU model's and this torch's, shared with no other.

Only ops whose C kernel is built here are chosen (`available_ops`); the rest run torch as
before, untagged. `--kernels c` and `--kernels onednn` time none of this: the C kernels run.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import kernel_choice as kc
from engine import layer_ops, torch_ops
from engine.attention import cpu_backend, cpu_kernel
from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.kernel_tags import TORCH_PREFIX
from engine.kv_cache import CacheLayout, PagedKVCache
from engine.model_config import ModelConfig

ATTN_DECODE, ATTN_PREFILL, LAYER_OPS = "attn_decode", "attn_prefill", "layer_ops"
# (query rows, context) of prefill attention calls: fresh prefills and a 512-row chunk after history
PREFILL_SHAPES = ((128, 128), (512, 512), (512, 2048), (2048, 2048))
# (sequences, context each) of decode attention calls
DECODE_SHAPES = ((1, 512), (8, 512), (8, 2048), (64, 1024))
# The probes: contexts prefilled whole and in chunks of these sizes; decode rows of these
# contexts batched in the groups below (SDPA pads a group to its longest member: 400 and 600
# together cross 512 keys, where torch's flash kernel changes its key blocks), each under
# every thread count in `probe_threads`.
PROBE_CONTEXTS = (1000, 2100)
PROBE_CHUNKS = (1, 7, 37, 256, 512)
PROBE_DECODE_CONTEXTS = (1, 15, 16, 17, 100, 257, 400, 600, 700, 1023, 1025, 2100)
PROBE_DECODE_GROUPS = ((4, 5), (6, 7, 8), (0, 1, 2, 3), (3, 9, 10), tuple(range(0, 12, 2)))


@dataclass(frozen=True)
class FallbackOp:
    """One switch of the engine at the model's shapes (`kernel_choice.choose` caches it by `key`)."""
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float
    block_size: int = 16   # the KV cache's tokens per block (attention)
    silu: bool = True      # the layer's SiLU-and-multiply is a step of its own (not fused into gate+up)
    kind = kc.TORCH        # the kernel timed against the C one
    fallback = "torch"

    @property
    def key(self) -> str:
        heads = f"{self.heads}x{self.kv_heads}x{self.head_dim}"
        if self.name == ATTN_DECODE:  # "-tiles": the decode kernel in the prefill's order (a choice before it timed another)
            return f"{self.name}-{heads}-bs{self.block_size}-tiles"
        if self.name != LAYER_OPS:
            return f"{self.name}-{heads}-bs{self.block_size}"
        return f"{self.name}-{self.hidden}-{heads}-{self.intermediate}{'-silu' if self.silu else ''}"


def model_ops(config: ModelConfig, block_size: int = 16, silu: bool = True) -> list[FallbackOp]:
    c = config
    return [FallbackOp(name, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.rms_eps,
                       block_size, silu) for name in (ATTN_DECODE, ATTN_PREFILL, LAYER_OPS)]


def available_ops(config: ModelConfig, cpu_attention: bool = True, block_size: int = 16,
                  silu: bool = True) -> list[FallbackOp]:
    """The model's ops whose C kernel is built on this CPU (attention only on the CPU backend)."""
    blocks = torch.empty((1, 1, 2, block_size, config.num_kv_heads, config.head_dim))
    q = torch.empty((1, config.num_heads, config.head_dim))
    built = {ATTN_DECODE: cpu_attention and cpu_kernel.supports(blocks, config.num_heads, config.num_kv_heads),
             ATTN_PREFILL: cpu_attention and cpu_kernel.supports_prefill(q, blocks),
             LAYER_OPS: layer_ops.library() is not None and config.head_dim <= layer_ops.MAX_HEAD_DIM}
    return [op for op in model_ops(config, block_size, silu) if built[op.name]]


def choose(ops: list[FallbackOp], mode: str = "auto", path: Path | None = None,
           measure: Callable[[FallbackOp], kc.Choice] | None = None) -> dict[str, kc.Choice]:
    """op name -> its kernel (C or TORCH). auto: the cached choice for this machine, or `measure`
    it now (`calibrate`) and cache it, beside the linears' choices. c / onednn: C, nothing timed."""
    if mode not in kc.MODES:
        raise ValueError(f"kernels must be one of {kc.MODES}, got {mode!r}")
    if mode != "auto":
        return {op.name: kc.Choice(kc.C, source="forced", other="torch") for op in ops}
    return kc.choose(ops, "auto", path, measure or calibrate)  # type: ignore[arg-type]


def tag(choices: dict[str, kc.Choice]) -> str:
    """The fingerprint's part for these choices: "" when every op runs C."""
    return kc.tag(choices, TORCH_PREFIX)


def calibrate(op: FallbackOp) -> kc.Choice:
    """Time the C and torch paths at the op's shapes; torch only if faster by the margin in
    every round and probed invariant (`kernel_choice.decide`)."""
    cases = timing_cases(op)
    c_s, torch_s = time_cases(cases)
    kernel, invariant = kc.decide(c_s, torch_s, lambda: torch_invariant(op), lambda: time_cases(cases), kc.TORCH)
    return kc.Choice(kernel, c_s, torch_s, invariant, "calibrated", other="torch")


def time_cases(cases: list[tuple[str, Callable[[bool], object]]]) -> tuple[float, float]:
    """Summed seconds of (C, torch) over the cases: each case's fastest of `kc.REPEATS` calls,
    the two paths' calls interleaved."""
    c_s = torch_s = 0.0
    for _, run in cases:
        c, t = time_case(run)
        c_s += c
        torch_s += t
    return c_s, torch_s


def time_case(run: Callable[[bool], object]) -> tuple[float, float]:
    """(C, torch) seconds of one case: the fastest of `kc.REPEATS` interleaved calls each."""
    with torch.inference_mode():
        t = kc.fastest_calls({kc.C: lambda _: run(True), kc.TORCH: lambda _: run(False)}, None)
    return t[kc.C], t[kc.TORCH]


# ---- the op's calls: (label, run(c: bool)) at the model's shapes, on random inputs -----------

def timing_cases(op: FallbackOp, seed: int = 0) -> list[tuple[str, Callable[[bool], object]]]:
    gen = torch.Generator().manual_seed(seed)
    if op.name == LAYER_OPS:
        return [(f"{m} rows", _layer_call(op, m, gen)) for m in kc.BATCHES]
    if op.name == ATTN_PREFILL:
        return [(f"{rows} x {ctx}", _attention_call(op, [(rows, ctx)], gen)) for rows, ctx in PREFILL_SHAPES]
    return [(f"{seqs} x {ctx}", _attention_call(op, [(1, ctx)] * seqs, gen)) for seqs, ctx in DECODE_SHAPES]


def _paged(op: FallbackOp, contexts: list[int], gen: torch.Generator) -> tuple[PagedKVCache, list[torch.Tensor]]:
    """A one-layer cache of random K/V holding sequences of these contexts, and their block tables."""
    nbs = [-(-ctx // op.block_size) for ctx in contexts]
    cache = PagedKVCache(CacheLayout(1, op.kv_heads, op.head_dim, op.block_size, torch.float32), sum(nbs) + 1)
    cache.blocks.normal_(generator=gen)
    ids = (1 + torch.randperm(sum(nbs), generator=gen)).split(nbs)
    return cache, list(ids)


def _attention(op: FallbackOp, cache: PagedKVCache, q: torch.Tensor, spans: list[SeqSpan], c: bool) -> torch.Tensor:
    n = q.shape[0]
    meta = AttentionMetadata(spans, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    return cpu_backend.paged_attention(q, cache, 0, meta, op.head_dim ** -0.5, c_decode=c, c_prefill=c)


def _attention_call(op: FallbackOp, seqs: list[tuple[int, int]], gen: torch.Generator) -> Callable[[bool], object]:
    """One pass's attention over sequences of (query rows, context): each a sequence's last rows."""
    cache, tables = _paged(op, [ctx for _, ctx in seqs], gen)
    starts = [sum(rows for rows, _ in seqs[:i]) for i in range(len(seqs))]
    spans = [SeqSpan(s, rows, ctx, t) for s, (rows, ctx), t in zip(starts, seqs, tables)]
    q = _queries(op, sum(rows for rows, _ in seqs), gen)
    return lambda c: _attention(op, cache, q, spans, c)


def _queries(op: FallbackOp, n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, heads, head_dim] queries as the model passes them: a view of the QKV projection's rows."""
    qkv = torch.randn(n, op.heads + 2 * op.kv_heads, op.head_dim, generator=gen)
    return qkv[:, :op.heads]


def _layer_inputs(op: FallbackOp, m: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hd = op.head_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    return {"h": torch.randn(m, op.hidden, generator=gen), "delta": torch.randn(m, op.hidden, generator=gen) * 0.01,
            "weight": 1 + 0.1 * torch.randn(op.hidden, generator=gen),
            "qk": torch.randn(m, op.heads + op.kv_heads, hd, generator=gen),
            "positions": torch.randint(0, 4096, (m,), generator=gen), "cos": emb.cos(),
            "sin_signed": torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), dim=-1).contiguous(),
            "gate_up": torch.randn(m, 2 * op.intermediate, generator=gen)}


def _layer_call(op: FallbackOp, m: int, gen: torch.Generator) -> Callable[[bool], object]:
    """A layer's elementwise steps, as the model runs them: two norms with the residual add,
    RoPE on the query and key heads, SiLU-and-multiply."""
    x = _layer_inputs(op, m, gen)
    args = torch_ops.rope_args(x["positions"], x["cos"], x["sin_signed"])  # once per pass, not per layer

    def run(c: bool) -> object:
        h, delta, w = x["h"], x["delta"], x["weight"]
        if c:
            layer_ops.add_rms_norm(h, delta, w, op.eps)
            layer_ops.rope_(x["qk"], x["positions"], x["cos"], x["sin_signed"])
            if op.silu:
                layer_ops.silu_mul(x["gate_up"])
            return layer_ops.add_rms_norm(h, delta, w, op.eps)
        torch_ops.add_rms_norm(h, delta, w, op.eps)
        torch_ops.apply_rope(x["qk"], *args)
        if op.silu:
            torch_ops.silu_mul(x["gate_up"])
        return torch_ops.add_rms_norm(h, delta, w, op.eps)
    return run


# ---- the probes: a row's bits on the torch path, however its pass was batched -----------------

def probe_threads() -> tuple[int, ...]:
    """The thread counts a probe runs its parts under: an engine's --threads may be any (the
    choice is cached per machine, not per thread count), and torch splits rows by it."""
    return tuple(sorted({1, 2, 3, torch.get_num_threads(), os.cpu_count() or 1}))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_invariant(op: FallbackOp) -> bool:
    """Whether the torch path's rows are bit-identical however the engine may batch or chunk
    them, with any thread count. (Not asked of either path: a decode row's bits equal to the same
    row's in a prefill chunk; the C kernels' sums differ there too.)"""
    with torch.inference_mode():
        if op.name == LAYER_OPS:
            return layer_invariant(op, _torch_layer_ops(), threads=probe_threads())
        return attention_invariant(op, c=False, threads=probe_threads())


def _torch_layer_ops() -> dict[str, Callable[..., torch.Tensor]]:
    return {"norm": lambda h, d, w, eps: torch_ops.add_rms_norm(h, d, w, eps),
            "rope": lambda qk, pos, cos, sin: torch_ops.apply_rope(qk, *torch_ops.rope_args(pos, cos, sin)),
            "silu_mul": torch_ops.silu_mul}


def layer_invariant(op: FallbackOp, fns: dict[str, Callable[..., torch.Tensor]],
                    batches: tuple[int, ...] = kc.PROBE_BATCHES, threads: tuple[int, ...] = ()) -> bool:
    """The first m rows of each step's output equal its output on those m rows alone, at every m
    (under each of `threads`, against the whole batch under the current thread count)."""
    x = _layer_inputs(op, max(batches), torch.Generator().manual_seed(1))
    calls = {"norm": lambda m: fns["norm"](x["h"][:m].clone(), x["delta"][:m], x["weight"], op.eps),
             "rope": lambda m: fns["rope"](x["qk"][:m].clone(), x["positions"][:m], x["cos"], x["sin_signed"]),
             "silu_mul": lambda m: fns["silu_mul"](x["gate_up"][:m].contiguous())}
    for call in calls.values():
        full = call(max(batches))
        for n in threads or (torch.get_num_threads(),):
            with _threads(n):
                if not all(torch.equal(call(m), full[:m]) for m in batches):
                    return False
    return True


def _chunks(ctx: int, size: int) -> Iterator[tuple[int, int]]:
    """(first row, rows) of a context prefilled in chunks of `size`; of one row only for the last
    64 rows, after one chunk of the rest (as after a prefix hit)."""
    at = 0
    if size == 1 and ctx > 64:
        yield 0, ctx - 64
        at = ctx - 64
    while at < ctx:
        yield at, min(size, ctx - at)
        at += size


def attention_invariant(op: FallbackOp, c: bool, threads: tuple[int, ...] = ()) -> bool:
    """The path's (c: C kernels, else torch) rows, under each of `threads` against the current
    thread count's: each context of `PROBE_CONTEXTS` prefilled whole equals it prefilled in
    chunks of each `PROBE_CHUNKS` size (one-row chunks as a prompt's, `SeqSpan.prompt_row`); each decode
    row of `PROBE_DECODE_CONTEXTS` in one batch of all equals it alone and in each group of
    `PROBE_DECODE_GROUPS` (other neighbours, other padding)."""
    gen = torch.Generator().manual_seed(2)
    threads = threads or (torch.get_num_threads(),)
    if op.name == ATTN_PREFILL:
        for ctx in PROBE_CONTEXTS:
            cache, (table,) = _paged(op, [ctx], gen)
            q = _queries(op, ctx, gen)
            whole = _attention(op, cache, q, [SeqSpan(0, ctx, ctx, table)], c)
            for n_threads, size in ((t, size) for t in threads for size in PROBE_CHUNKS):
                with _threads(n_threads):
                    for at, n in _chunks(ctx, size):
                        if not torch.equal(_attention(op, cache, q[at:at + n], [SeqSpan(0, n, at + n, table, True)], c),
                                           whole[at:at + n]):
                            return False
        return True
    contexts = list(PROBE_DECODE_CONTEXTS)
    cache, tables = _paged(op, contexts, gen)
    qkv = torch.randn(len(contexts), op.heads + 2 * op.kv_heads, op.head_dim, generator=gen)  # as `_queries`

    def rows(idx: list[int]) -> torch.Tensor:
        spans = [SeqSpan(j, 1, contexts[i], tables[i]) for j, i in enumerate(idx)]
        return _attention(op, cache, qkv[idx][:, :op.heads], spans, c)
    every = rows(list(range(len(contexts))))
    groups = [list(g) for g in PROBE_DECODE_GROUPS] + [[i] for i in range(len(contexts))]
    for n_threads in threads:
        with _threads(n_threads):
            if not all(torch.equal(rows(g), every[g]) for g in groups):
                return False
    return True
