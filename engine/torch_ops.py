"""The elementwise steps in torch: what the engine runs where the fused C calls
(engine/layer_ops.py) do not (another device or dtype, the library not built) or were slower
(engine/op_choice.py). They work in place on fresh intermediates where they can (fewer large
allocations per layer); each op and its operands are as in the plain formulas, so results are
the same to the bit."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    if dtype == torch.float32:
        return y.mul_(weight)
    return weight * y.to(dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (if any), in place; returns rms_norm(h) * weight."""
    if delta is not None:
        h.add_(delta)
    return rms_norm(h, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1). Computed as
    roll(x) * sin_signed (sin with its first half negated): the same products up to sign, so the
    same result to the bit, in fewer ops."""
    x32 = x.float()
    out = x32 * cos
    out.add_(x32.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed))
    return out.to(x.dtype)


def rope_args(positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`apply_rope`'s tables for these positions (once per pass), broadcast over the heads."""
    return cos[positions][:, None, :], sin_signed[positions][:, None, :]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
