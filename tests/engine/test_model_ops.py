"""The model's rewritten elementwise steps against their plain forms (to the bit), and the
oneDNN-packed Linear against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import Linear, apply_rope, rms_norm


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rope_bitwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-5), plain_rms_norm(x, w, 1e-5))
    hd = 64
    pos = torch.randint(0, 8192, (37,), generator=g)
    inv = 1.0 / (100000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.outer(torch.arange(8192).float(), inv)
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos(), emb.sin()
    sin_signed = torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), -1)
    q = torch.randn(37, 12, hd, generator=g).to(dtype)
    got = apply_rope(q, cos[pos][:, None], sin_signed[pos][:, None])
    assert torch.equal(got, plain_rope(q, cos[pos][:, None], sin[pos][:, None]))
    # and it is a rotation: a wrong sign or half would change the result
    assert not torch.equal(got, plain_rope(q, cos[pos][:, None], -sin[pos][:, None]))


@pytest.mark.parametrize("n", [0, 1, 7, 64, 300])
def test_linear_matches_f_linear(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(1000, 96, generator=g)
    x = torch.randn(n, 96, generator=g)
    ref = F.linear(x, w)
    assert torch.allclose(Linear(w)(x), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(Linear(w, use_onednn=False)(x), ref)
    assert torch.equal(Linear(w.bfloat16())(x.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))  # not packed
