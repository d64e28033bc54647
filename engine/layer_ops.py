"""Fused elementwise steps of a decoder layer on CPU (engine/native/csrc/layer_ops.c), called via ctypes.

RMSNorm, residual add + RMSNorm, RoPE in place and SiLU-and-multiply, float32, each one C call
instead of 3-6 torch ops: at decode batch sizes those ops cost their dispatch, not their
arithmetic. And the linears' matmul over weights packed in panels (`panel_matmul`), which ran
faster than oneDNN's packed GEMM at every batch size measured (docs/journal/benchmarks-history.md).
Built like the decode attention kernel (`engine.native.build`).
`usable(...)` says whether a call may take this path (CPU, float32, contiguous rows, the
library built); engine/model.py falls back to its torch ops otherwise. The results agree with
the torch formulas to float32 rounding (a different summation order), not to the bit.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from engine import hugepages
from engine.native.build import CSRC, LazyLibrary

SOURCE = CSRC / "layer_ops.c"
MAX_HEAD_DIM = 512  # the C source's scratch row

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "rms_norm_f32": [_ptr, _ptr, _ptr, _i64, _i64, _f32],
    "add_rms_norm_f32": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "rope_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "silu_mul_f32": [_ptr, _ptr, _i64, _i64],
    "gemm_f32": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64],
    "gemm_silu_f32": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64],
    "gemm_block_rows": [_ptr, _i64],
    "gemm_half_panels": [],
}
PANEL = 32  # output rows per packed panel (the C source's PANEL)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.gemm_block_rows.restype = _i64
    lib.gemm_half_panels.restype = _i64
    return lib


_library = LazyLibrary(SOURCE, _bind, "C layer ops unavailable, using torch ops")


def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be built (logged once)."""
    return _library.get()


def usable(*tensors: torch.Tensor) -> bool:
    """CPU float32 tensors whose last dimension is contiguous, and the library built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors) \
        and library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [n, dim] contiguous -> a new [n, dim] tensor."""
    lib = library()
    assert lib is not None and x.is_contiguous()
    out = torch.empty_like(x)
    lib.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (both [n, dim] contiguous); returns rms_norm(h) in a new tensor."""
    lib = library()
    assert lib is not None and h.is_contiguous() and delta.is_contiguous() and h.shape == delta.shape
    out = torch.empty_like(h)
    lib.add_rms_norm_f32(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), h.shape[0],
                         h.shape[1], eps)
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """RoPE in place on x: [n, heads, head_dim] (heads and dims contiguous, any row stride);
    positions: int64 [n]; cos / sin_signed: [max_position, head_dim] contiguous tables."""
    lib = library()
    n, heads, hd = x.shape
    assert lib is not None and x.stride(2) == 1 and x.stride(1) == hd and hd <= MAX_HEAD_DIM
    assert positions.dtype == torch.int64 and positions.is_contiguous() and cos.is_contiguous()
    lib.rope_f32(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), n, heads, hd)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [n, 2 * inter] contiguous -> silu(gate) * up, a new [n, inter] tensor."""
    lib = library()
    assert lib is not None and gate_up.is_contiguous()
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype)
    lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), n, inter)
    return out


@functools.cache
def half_panels() -> bool:
    """Whether this CPU's build reads each panel as two halves, each contiguous (without
    AVX-512: the C source's gemm_half_panels)."""
    lib = library()
    assert lib is not None
    return bool(lib.gemm_half_panels())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the panels `panel_matmul` reads: a contiguous [out / PANEL, in, PANEL]
    tensor (out must be a multiple of PANEL: see `panels_packable`) holding, per panel, either
    [k][j] = weight[panel row j][k], or with `half_panels()` the same as [half][k][j of 16]."""
    out_dim, in_dim = weight.shape
    n = out_dim // PANEL
    panels = hugepages.empty((n, in_dim, PANEL), weight.dtype)  # streamed every step
    if half_panels():
        half = PANEL // 2
        panels.view(n, 2, in_dim, half).copy_(weight.view(n, 2, half, in_dim).transpose(2, 3))
        return panels
    return panels.copy_(weight.view(n, PANEL, in_dim).transpose(1, 2))


def panels_packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % PANEL == 0 and usable(weight)


def pack_gated_panels(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [2 * inter, in] (the gate's rows, then the up projection's) -> panels that hold 16
    gate rows and the same 16 up rows each, for `gated_panel_matmul`."""
    two_inter, in_dim = gate_up.shape
    half = PANEL // 2
    paired = gate_up.view(2, two_inter // 2 // half, half, in_dim).transpose(0, 1).reshape(two_inter, in_dim)
    return pack_panels(paired)


def gated_packable(gate_up: torch.Tensor) -> bool:
    return gate_up.dim() == 2 and gate_up.shape[0] % (2 * PANEL) == 0 and usable(gate_up)


@functools.cache
def panel_block_rows() -> tuple[int, ...]:
    """The rows per micro-kernel call this CPU's build of the panel kernel takes, its default
    first (they depend on the vector registers: the C source). Every one gives the same bits;
    which is fastest depends on the CPU (engine/kernel_choice.py times them)."""
    lib = library()
    assert lib is not None
    out = (ctypes.c_int64 * 16)()
    return tuple(out[:lib.gemm_block_rows(out, 16)])


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, block_rows: int = 0) -> torch.Tensor:
    """x: [m, in] (any m, last dim contiguous), panels: `pack_panels(weight)` -> x @ weight.T,
    a new [m, out] tensor. Each output row depends on its input row alone (the same bits whatever
    the batch and whichever `block_rows`: one of `panel_block_rows()`, 0 for the default)."""
    return _panel_call("gemm_f32", x, panels, PANEL, block_rows)


def gated_panel_matmul(x: torch.Tensor, panels: torch.Tensor, block_rows: int = 0) -> torch.Tensor:
    """x: [m, in], panels: `pack_gated_panels(gate_up)` -> silu(x @ gate.T) * (x @ up.T), a new
    [m, inter] tensor: the MLP's first half in one pass, never writing the [m, 2 * inter] product."""
    return _panel_call("gemm_silu_f32", x, panels, PANEL // 2, block_rows)


def _panel_call(name: str, x: torch.Tensor, panels: torch.Tensor, cols_per_panel: int, block_rows: int) -> torch.Tensor:
    if block_rows and block_rows not in panel_block_rows():
        raise ValueError(f"block_rows must be one of {panel_block_rows()} (or 0), got {block_rows}")
    lib = library()
    m, k = x.shape
    assert lib is not None and x.stride(1) == 1 and panels.is_contiguous()
    assert panels.shape[1] == k and panels.shape[2] == PANEL
    out = torch.empty((m, panels.shape[0] * cols_per_panel), dtype=torch.float32)
    if m:
        getattr(lib, name)(panels.data_ptr(), panels.shape[0] * PANEL, k, x.data_ptr(), x.stride(0), m,
                           out.data_ptr(), out.stride(0), block_rows)
    return out
