"""Which matmul each of the model's linears runs on this CPU: our C panel kernel
(engine/layer_ops.py) or oneDNN's packed GEMM (torch), chosen by timing both at the model's
shapes on the machine the engine runs on.

The C kernel was tuned on one CPU (AMD Zen 4); on another, oneDNN may be faster for some
shapes. `choose` keeps the faster one per weight shape, under these rules:

- One kernel per weight shape, for every batch size: an output row's bits never depend on
  the batch it was computed in (the pool's equality rests on it: a prefix hit's suffix runs in
  a smaller batch than a full prefill). The C kernel is batch-invariant by construction;
  oneDNN is eligible only where its rows come out bit-identical at every probed batch size
  (`PROBE_BATCHES`); on Zen 4 its down projection is not (batch 1 takes another path).
- oneDNN is taken only when it ran at least `MARGIN` faster over the batch mix (the sum of
  each batch size's fastest call at `BATCHES`, the two kernels' calls interleaved: a load
  from elsewhere only ever adds time, so the fastest call is the kernel's own), so noise does
  not flip a near tie: where the C kernel ties or wins it stays (today's choice on the CPU it
  was tuned on). A first round that favours oneDNN is timed again `CONFIRM_ROUNDS` times,
  and every round must agree (a burst of load on the machine must not decide).
- The choice is cached per (CPU model, torch version, shape) in
  $XDG_CACHE_HOME/kvpool/kernels.json (~/.cache by default), read and written under a file
  lock: every engine on one machine, started together or not, with any `--threads`, runs the
  same kernels, so the KV blocks they share and the answers they give are bit-identical; a
  machine calibrates once per CPU model and shape (with the threads of the first engine that
  needed it). Delete the file to calibrate again.
- A choice other than the C kernel is named in the KV layout fingerprint (`tag`), with the
  CPU model it was made on: blocks computed with other kernels are another namespace, never
  mixed with these.
- The C kernel's rows per micro-kernel call (`layer_ops.panel_block_rows()`: what fits the
  CPU's vector registers) are timed too, per batch size of the mix: each gives the same bits,
  so the fastest is taken for the batch sizes up to it (`Choice.blocks`), with no margin.
  `--kernels c` takes them from the cache too (or times them alone): on AVX2 the build's
  default (2 rows) is far from the 6-row half panels a calibration picks.

The attention and elementwise ops are chosen by the same rule and cache, against torch's
paths (engine/op_choice.py).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernel_tags import TAG_PREFIX
from engine.model_config import ModelConfig
from engine.native import build

log = logging.getLogger(__name__)

C, ONEDNN, TORCH = "c", "onednn", "torch"  # TORCH: attention and layer ops (engine/op_choice.py)
MODES = ("auto", C, ONEDNN)
MARGIN = 0.15                     # oneDNN must be this much faster (fraction of the C kernel's time)
BATCHES = (1, 8, 64, 512)         # decode batch sizes and a prefill chunk's rows
HEAD_BATCHES = (1, 8, 64)         # the lm head runs on the sampled rows only
PROBE_BATCHES = (*range(1, 65), 96, 128, 200, 256, 333, 512, 1000, 2048)
HEAD_PROBE_BATCHES = (*range(1, 65), 96, 128, 256)  # sampled rows: up to max_num_seqs
REPEATS = 7
CONFIRM_ROUNDS = 2


@dataclass(frozen=True)
class Op:
    """One linear of the model: its weight's shape and how it is used. `gated`: the MLP's
    gate+up projection followed by SiLU-and-multiply (the C kernel fuses both)."""
    name: str
    out_dim: int
    in_dim: int
    gated: bool = False
    head: bool = False
    kind = ONEDNN        # the kernel timed against the C one
    fallback = "oneDNN"  # and its name in `Choice.describe`

    @property
    def key(self) -> str:
        return f"{self.out_dim}x{self.in_dim}{'-gated' if self.gated else ''}"


def linear_ops(config: ModelConfig) -> list[Op]:
    """The model's linears, as `LlamaModel` runs them (q, k and v in one; gate and up in one)."""
    c, hd = config, config.head_dim
    return [Op("qkv", (c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size), Op("o", c.hidden_size, c.num_heads * hd),
            Op("gate_up", 2 * c.intermediate_size, c.hidden_size, gated=True),
            Op("down", c.hidden_size, c.intermediate_size), Op("lm_head", c.vocab_size, c.hidden_size, head=True)]


@dataclass(frozen=True)
class Choice:
    kernel: str                   # C or ONEDNN
    c_s: float = 0.0              # summed fastest calls over the batch mix (0: not timed)
    onednn_s: float = 0.0
    invariant: bool | None = None  # oneDNN's rows bit-identical at every probed batch (None: not probed)
    source: str = "default"       # default | calibrated | cached | forced
    # The C kernel's rows per micro-kernel call by batch size: (up to m rows, block rows), the
    # bounds ascending, the last used beyond its bound too; () = the build's default.
    blocks: tuple[tuple[int, int], ...] = ()
    other: str = "oneDNN"         # what `onednn_s` timed: oneDNN for the linears, torch for the rest

    def describe(self) -> str:
        """How it was chosen, e.g. "calibrated: oneDNN / C time 1.36, C rows per call 4/8"."""
        parts = [f"{self.other} / C time {self.onednn_s / self.c_s:.2f}"] if self.c_s and self.onednn_s else []
        if self.invariant is False:
            parts.append(f"{self.other}'s rows depend on the batch")
        if self.blocks:
            parts.append(f"C rows per call {'/'.join(str(b) for _, b in self.blocks)}")
        return f"{self.source}: {', '.join(parts)}" if parts else self.source


def block_for(blocks: tuple[tuple[int, int], ...], m: int) -> int:
    """The block rows for a call of m rows (0: the build's default)."""
    for bound, rows in blocks:
        if m <= bound:
            return rows
    return blocks[-1][1] if blocks else 0


def faster(c_s: float, onednn_s: float) -> bool:
    return onednn_s <= (1 - MARGIN) * c_s


def decide(c_s: float, onednn_s: float, invariant: Callable[[], bool],
           again: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0), other: str = ONEDNN) -> tuple[str, bool | None]:
    """The rule: `other` (oneDNN) only if at least MARGIN faster in the first round and in each
    of CONFIRM_ROUNDS more (`again` times one), and batch-invariant (probed only then)."""
    if not faster(c_s, onednn_s) or not all(faster(*again()) for _ in range(CONFIRM_ROUNDS)):
        return C, None
    ok = invariant()
    return (other if ok else C), ok


# ---- timing and probing the two kernels on random weights of the op's shape ------------------

def _kernels(op: Op, seed: int = 0) -> tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(C kernel taking (x, block_rows), oneDNN taking x) on random weights of the op's shape."""
    from engine import layer_ops

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(op.out_dim, op.in_dim, generator=g) * op.in_dim ** -0.5
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)

    def onednn(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return layer_ops.silu_mul(y) if op.gated else y

    if op.gated:
        panels = layer_ops.pack_gated_panels(w)
        return (lambda x, rows=0: layer_ops.gated_panel_matmul(x, panels, rows)), onednn
    panels = layer_ops.pack_panels(w)
    return (lambda x, rows=0: layer_ops.panel_matmul(x, panels, rows)), onednn


def fastest_calls(fns: dict, x: torch.Tensor) -> dict:
    """Each function's fastest of REPEATS calls on x, their calls interleaved (a load that comes
    and goes weighs on all)."""
    for fn in fns.values():
        fn(x)  # warm: first-touch of buffers, oneDNN's primitive cache
    times: dict = {k: [] for k in fns}
    for _ in range(REPEATS):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(x)
            times[k].append(time.perf_counter() - t0)
    return {k: min(t) for k, t in times.items()}


def time_blocks(op: Op, batches: Iterable[int]) -> tuple[tuple[tuple[int, int], ...], float, float]:
    """The C kernel's fastest block rows per batch size, and the summed seconds over `batches`
    of (the C kernel at those blocks, oneDNN)."""
    from engine import layer_ops

    c_fn, onednn_fn = _kernels(op)
    fns: dict = {rows: (lambda x, r=rows: c_fn(x, r)) for rows in layer_ops.panel_block_rows()}
    fns[ONEDNN] = onednn_fn
    blocks, c_total, onednn_total = [], 0.0, 0.0
    with torch.inference_mode():
        for m in sorted(batches):
            t = fastest_calls(fns, torch.randn(m, op.in_dim))
            rows = min((r for r in t if r != ONEDNN), key=lambda r: t[r])
            blocks.append((m, rows))
            c_total += t[rows]
            onednn_total += t[ONEDNN]
    return tuple(blocks), c_total, onednn_total


def time_both(op: Op, batches: Iterable[int], blocks: tuple[tuple[int, int], ...] = ()) -> tuple[float, float]:
    """Summed seconds of (C at `blocks`, oneDNN) over `batches`: each batch size's fastest of
    REPEATS calls, the two kernels' calls interleaved."""
    c_fn, onednn_fn = _kernels(op)
    c_total = onednn_total = 0.0
    with torch.inference_mode():
        for m in batches:
            rows = block_for(blocks, m)
            t = fastest_calls({C: lambda x: c_fn(x, rows), ONEDNN: onednn_fn}, torch.randn(m, op.in_dim))
            c_total += t[C]
            onednn_total += t[ONEDNN]
    return c_total, onednn_total


def onednn_invariant(op: Op, batches: Iterable[int] = PROBE_BATCHES) -> bool:
    """oneDNN's rows for the first m inputs equal its rows for all of them, bit for bit, at
    every m in `batches` (and a row alone at an offset)."""
    _, onednn_fn = _kernels(op)
    batches = list(batches)
    x = torch.randn(max(batches), op.in_dim, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = onednn_fn(x)
        if not torch.equal(onednn_fn(x[5:6].contiguous()), full[5:6]):
            return False
        return all(torch.equal(onednn_fn(x[:m].contiguous()), full[:m]) for m in batches)


def calibrate(op: Op) -> Choice:
    batches = HEAD_BATCHES if op.head else BATCHES
    blocks, c_s, onednn_s = time_blocks(op, batches)
    probe = HEAD_PROBE_BATCHES if op.head else PROBE_BATCHES
    kernel, invariant = decide(c_s, onednn_s, lambda: onednn_invariant(op, probe),
                               lambda: time_both(op, batches, blocks))
    return Choice(kernel, c_s, onednn_s, invariant, "calibrated", blocks)


def calibrate_blocks(op: Op) -> Choice:
    """`--kernels c`: the C kernel, at the block rows `calibrate` would time (nothing else)."""
    blocks, _, _ = time_blocks(op, HEAD_BATCHES if op.head else BATCHES)
    return Choice(C, source="forced", blocks=blocks)


# ---- the cache ---------------------------------------------------------------------------

def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpool" / "kernels.json"


def machine_key() -> str:
    """What a calibration is valid for besides the shape: the CPU model, the ISA class the C
    kernels are built for and torch's version (not the thread count: engines on one machine
    must agree whatever their --threads)."""
    model = build.cpu_model()  # with family and model: the name alone can be generic under KVM
    # "panels N": the C kernel's builds since its last change in speed (1 -> 2: per-CPU block
    # rows, an older choice timed a kernel that spilled its registers on AVX2 machines; 2 -> 3:
    # half panels and tail blocks in registers on AVX2; 3 -> 4: the AVX-512 block's row counts
    # constants and its accumulators in registers; 4 -> 5: built per ISA class, not -march=native).
    return f"{model}|{build.kernel_isa()}|torch {torch.__version__}|panels 5"


def choose(ops: Iterable[Op], mode: str = "auto", path: Path | None = None,
           measure: Callable[[Op], Choice] | None = None) -> dict[str, Choice]:
    """op name -> its kernel. auto: the cached choice for this machine, or `measure` it now
    (`calibrate`) and cache it. ONEDNN: oneDNN for every op, nothing timed. C: the C kernel for
    every op, at the block rows cached for this machine (an auto choice's, whichever kernel it
    took), or `measure`d now (`calibrate_blocks`) and cached where there are none: a forced
    choice fixes the kernel, not how many rows its calls take. A cache that cannot be read or
    written is worked around (logged): the choice is then this process's alone."""
    ops = list(ops)
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
    if mode == ONEDNN:
        return {op.name: Choice(mode, source="forced") for op in ops}
    measure = measure or (calibrate if mode == "auto" else calibrate_blocks)
    path = path or cache_path()
    machine = machine_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one calibration at a time; the next reads its result
            return _choose_locked(ops, path, machine, measure, forced=mode == C)
    except OSError as err:
        log.warning("kernel choice cache %s unusable (%s): calibrating for this process only", path, err)
        return {op.name: measure(op) for op in ops}


def _choose_locked(ops: list[Op], path: Path, machine: str, measure: Callable[[Op], Choice],
                   forced: bool) -> dict[str, Choice]:
    """`forced`: the C kernel whatever an entry says; an entry of block rows alone (what a forced
    choice caches) serves it, and an auto choice measures over it."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entries = cache.setdefault(machine, {})
    out, changed = {}, False
    for op in ops:
        hit = entries.get(op.key) or {}
        blocks = tuple((int(m), int(r)) for m, r in hit.get("blocks", ()))
        if forced and "blocks" in hit:
            out[op.name] = Choice(C, source="forced", blocks=blocks)
            continue
        if not forced and hit.get("kernel") in (C, op.kind):
            out[op.name] = Choice(hit["kernel"], hit.get("c_s", 0.0), hit.get("onednn_s", 0.0), hit.get("invariant"),
                                  "cached", blocks, op.fallback)
            continue
        choice = measure(op)
        out[op.name] = choice
        entry = {"blocks": [list(b) for b in choice.blocks]}
        if not forced:
            entry.update(kernel=choice.kernel, c_s=choice.c_s, onednn_s=choice.onednn_s, invariant=choice.invariant)
        entries[op.key] = entry
        changed = True
        log.info("kernel for %s (%s): %s (%s)", op.name, op.key, choice.kernel, choice.describe())
    if changed:
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    return out


def tag(choices: dict[str, Choice], prefix: str = TAG_PREFIX) -> str:
    """The layout fingerprint's part for these choices: empty when every op runs the C kernel,
    else `prefix`, the ops on the other kernel and a digest of `machine_key()`. oneDNN (and
    torch's own CPU kernels) pick their code and blocking by the CPU they run on (its ISA, its
    caches), so their bits are only known to agree on one CPU model with one torch: such a
    choice never shares blocks beyond that."""
    other = sorted(name for name, c in choices.items() if c.kernel != C)
    if not other:
        return ""
    return f"{prefix}{','.join(other)}@{hashlib.sha256(machine_key().encode()).hexdigest()[:8]}"


def isa_tag(flags: str | None = None) -> str:
    """The layout fingerprint's part for the ISA class the C kernels are built for
    (`build.kernel_isa`: "|isa:x86_64_v4", "|isa:x86_64_v3", "|isa:x86_64"; `flags` a
    /proc/cpuinfo flags line, this CPU's by default). Each class's build differs (the vector
    width, the SiLU's exp, the attention kernels: engine/native/csrc), and so do oneDNN's and
    torch's, so KV computed by one class is not bit-identical to another's: nodes of different
    classes keep their blocks apart, as nodes of different kernel choices do; within a class
    every CPU runs the same machine code (engine/native/build.py)."""
    return f"|isa:{build.kernel_isa(flags)}"
