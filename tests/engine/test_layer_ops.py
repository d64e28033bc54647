"""The fused C layer ops (engine/layer_ops.py) against the torch formulas they replace, and the
engine with them against the engine without them (the greedy-equality tests against
transformers in test_correctness.py run the fused path: it is the default on CPU float32)."""
from __future__ import annotations

import pytest
import torch

from engine import layer_ops
from engine.model import Linear, apply_rope, rms_norm
from engine.request import SamplingParams
from tests.engine.conftest import make_engine, run_all, varied_prompts

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    from engine.native.build import build

    build(layer_ops.SOURCE)  # raises if it cannot build: never a silent fall back to the torch ops
    assert layer_ops.library() is not None


def test_rms_norm_and_residual_add() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 40):   # 40 rows: the OpenMP path
        x, w = torch.randn(n, 576, generator=g), torch.randn(576, generator=g)
        assert torch.allclose(layer_ops.rms_norm(x, w, 1e-5), rms_norm(x.clone(), w, 1e-5), **TOL)
        h, d = torch.randn(n, 576, generator=g), torch.randn(n, 576, generator=g)
        want_h = h + d
        got = layer_ops.add_rms_norm(h, d, w, 1e-5)
        assert torch.allclose(h, want_h, **TOL)     # the residual stream is updated in place
        assert torch.allclose(got, rms_norm(want_h, w, 1e-5), **TOL)


def test_rope_in_place_on_strided_rows() -> None:
    g = torch.Generator().manual_seed(1)
    hd, n = 64, 37
    inv = 1.0 / (100000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.outer(torch.arange(8192).float(), inv)
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos(), emb.sin()
    sin_signed = torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), -1)
    pos = torch.randint(0, 8192, (n,), generator=g)
    qkv = torch.randn(n, 15 * hd, generator=g)      # 12 heads roped, 3 more (V) after them in each row
    x = qkv[:, :12 * hd].view(n, 12, hd)             # row stride 15 * hd
    want = apply_rope(x, cos[pos][:, None], sin_signed[pos][:, None])
    wrong = apply_rope(x, cos[pos][:, None], -sin_signed[pos][:, None])
    v_before = qkv[:, 12 * hd:].clone()
    layer_ops.rope_(x, pos, cos, sin_signed)
    assert torch.allclose(x, want, **TOL) and not torch.allclose(x, wrong, **TOL)
    assert torch.equal(qkv[:, 12 * hd:], v_before)  # the rest of each row untouched


def test_silu_mul() -> None:
    g = torch.Generator().manual_seed(2)
    for n in (1, 3, 33):
        gu = torch.randn(n, 2 * 1536, generator=g) * 4
        gu[:, :8] = torch.tensor([-3000., -100., -89., -88., 88., 89., 100., 3000.])  # exp past its range
        gate, up = gu.chunk(2, dim=-1)
        got = layer_ops.silu_mul(gu)
        assert torch.isfinite(got).all() and torch.allclose(got, torch.nn.functional.silu(gate) * up, **TOL)


@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 8, 9, 67, 256, 515])
@pytest.mark.parametrize("in_dim", [576, 100])
def test_panel_matmul_matches_matmul(m: int, in_dim: int) -> None:
    """Row counts below, at and past a block (8 rows) and a work item (256), with tails."""
    g = torch.Generator().manual_seed(m * 1000 + in_dim)
    w = torch.randn(352, in_dim, generator=g)   # 11 panels: the two threads get unequal shares
    x = torch.randn(m, in_dim + 7, generator=g)[:, :in_dim]   # rows in_dim + 7 apart
    got = layer_ops.panel_matmul(x, layer_ops.pack_panels(w))
    assert got.shape == (m, 352) and torch.allclose(got, x @ w.T, rtol=1e-4, atol=1e-4)
    assert not layer_ops.panels_packable(torch.randn(333, in_dim))   # not whole panels: oneDNN takes it


@pytest.mark.parametrize("m", [0, 1, 9, 300])
def test_gated_panel_matmul_is_silu_gate_times_up(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    gate_up = torch.randn(2 * 192, 576, generator=g) * 0.1
    x = torch.randn(m, 576, generator=g)
    x[:, 0] = torch.linspace(-3000, 3000, m) if m > 1 else 3000.   # gates far past exp's range both ways
    gate, up = x @ gate_up[:192].T, x @ gate_up[192:].T
    got = layer_ops.gated_panel_matmul(x, layer_ops.pack_gated_panels(gate_up))
    assert got.shape == (m, 192) and torch.isfinite(got).all()
    assert torch.allclose(got, torch.nn.functional.silu(gate) * up, rtol=1e-4, atol=1e-3)
    assert not layer_ops.gated_packable(torch.randn(2 * 176, 576))   # 16-row halves, not whole panel pairs


def test_panel_matmul_rows_do_not_depend_on_the_batch() -> None:
    """A row's output is the same bits alone, in a block's tail or in a full block of a big batch."""
    g = torch.Generator().manual_seed(5)
    panels = layer_ops.pack_panels(torch.randn(320, 576, generator=g))
    x = torch.randn(300, 576, generator=g)
    whole = layer_ops.panel_matmul(x, panels)
    for i in (0, 13, 64, 257, 299):
        assert torch.equal(layer_ops.panel_matmul(x[i:i + 1], panels)[0], whole[i])
    assert torch.equal(layer_ops.panel_matmul(x[250:261], panels), whole[250:261])


@pytest.mark.parametrize("gated", [False, True])
def test_every_block_rows_gives_the_same_bits(gated: bool) -> None:
    """The rows per micro-kernel call (which this CPU's build offers, each with its tails) and
    where a row falls in a batch change nothing in its output, bit for bit."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(2 * 192 if gated else 352, 576, generator=g) * 0.1
    x = torch.randn(300, 576, generator=g)
    x[:, 0] = torch.linspace(-3000, 3000, 300)   # gates past exp's range
    f = layer_ops.gated_panel_matmul if gated else layer_ops.panel_matmul
    panels = layer_ops.pack_gated_panels(w) if gated else layer_ops.pack_panels(w)
    whole = f(x, panels)
    offered = layer_ops.panel_block_rows()
    assert len(offered) >= 2 and len(set(offered)) == len(offered)
    for rows in offered:
        assert torch.equal(f(x, panels, rows), whole), rows
        for m in (1, 2, 3, 5, 6, 7, 11, 13, 64, 257):
            assert torch.equal(f(x[:m], panels, rows), whole[:m]), (rows, m)
        assert torch.equal(f(x[250:261], panels, rows), whole[250:261]), rows
    with pytest.raises(ValueError, match="block_rows must be one of"):
        f(x[:1], panels, 1000)


def test_linear_takes_the_panels_for_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 96, generator=g)
    lin = Linear(w, panels=True)
    assert lin.panels is not None and lin.packed is None and lin.weight is None   # one packed copy
    calls: list[int] = []
    real = layer_ops.panel_matmul
    monkeypatch.setattr(layer_ops, "panel_matmul",
                        lambda x, weight, rows=0: calls.append(x.shape[0]) or real(x, weight, rows))
    for n in (1, 8, 9, 64, 300):
        x = torch.randn(n, 96, generator=g)
        assert torch.allclose(lin(x), x @ w.T, rtol=1e-4, atol=1e-4)
    assert calls == [1, 8, 9, 64, 300]
    odd = Linear(torch.randn(100, 96, generator=g), panels=True)   # not whole panels: oneDNN or F.linear
    assert odd.panels is None and odd(torch.randn(3, 96)).shape == (3, 100) and calls == [1, 8, 9, 64, 300]


@pytest.mark.slow
def test_engine_with_and_without_the_fused_ops(loaded) -> None:  # noqa: ANN001
    """Same greedy tokens, log-probs within float32 noise, with the fused ops on and off
    (prefill chunks, batched decode and batch-1 decode all run)."""
    prompts = varied_prompts(loaded.tokenizer)[:8]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    fused = make_engine(loaded, max_num_batched_tokens=256)
    assert fused.model.fused and fused.model.layers[0].qkv.panels is not None
    with pytest.MonkeyPatch.context() as mp:  # the linears on oneDNN (or F.linear), not the panels
        mp.setattr(layer_ops, "panels_packable", lambda weight: False)
        plain = make_engine(loaded, max_num_batched_tokens=256)
    plain.model.fused = False
    assert plain.model.layers[0].qkv.panels is None and plain.model.lm_head.panels is None
    got, want = run_all(fused, prompts, params), run_all(plain, prompts, params)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            for tok in la:
                assert abs(la[tok] - lb[tok]) < 1e-3
    solo = run_all(fused, prompts[:1], params)[0]   # batch 1
    assert solo.token_ids == want[0].token_ids
