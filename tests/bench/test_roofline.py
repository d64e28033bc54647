"""The throughput run's floor (kvpool_bench/roofline.py): its work model against a hand count
and a token-by-token simulation, and the C ceilings probe on this machine."""
from __future__ import annotations

import random

import pytest
import torch

from engine.model_config import ModelConfig
from kvpool_bench import roofline


def shape(vocab: int, heads: int, head_dim: int, kv_heads: int, intermediate: int, layers: int) -> ModelConfig:
    return ModelConfig(name="toy", vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rope_theta=1e4, rms_eps=1e-5, max_position=4096, tie_embeddings=True, bos_token_id=1,
                       eos_token_ids=(2,))


TINY = shape(vocab=10, heads=2, head_dim=2, kv_heads=1, intermediate=6, layers=2)


def test_a_hand_counted_run() -> None:
    """One 3-token prompt, 2 output tokens: qkv 4 x (4 + 2 + 2) = 32, o 16, MLP 3 x 4 x 6 = 72
    multiply-adds a token and layer (120), LM head 40. Prompt: layer 1 on 3 rows (360), the
    last layer's qkv on 2 rows (64) and all of it on the sampled row (120); the one decode token
    (240); the LM head twice (80): 864 MACs. Attention, 4 FLOPs x 2 heads x 2 dims a pair
    (16): 6 causal pairs in layer 1, the sampled row's 3 in layer 2, and the decode token's 4
    keys in both: 17 pairs, 272. K/V: 4 keys + 4 values of 2 floats x 2 layers = 128 bytes."""
    work = roofline.run_work(TINY, [3], 2)
    assert work.linear_flops == 2 * 864
    assert work.attention_flops == 272
    assert work.kv_read_bytes == 128


def simulate(shape: ModelConfig, prompts: list[int], output_tokens: int) -> roofline.Work:
    """The same work pass by pass, token by token: an independent count of run_work's sums."""
    h, i, layers = shape.hidden_size, shape.intermediate_size, shape.num_layers
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    macs = attn = kv_bytes = 0
    for n in prompts:
        for pos in range(n):                       # the prompt's pass
            sampled = pos == n - 1
            for layer in range(layers):
                macs += h * (q + 2 * kv)
                if layer < layers - 1 or sampled:
                    macs += q * h + 3 * h * i
                    attn += 4 * shape.num_heads * shape.head_dim * (pos + 1)
        macs += h * shape.vocab_size               # its first output token
        for t in range(1, output_tokens):          # decode passes: one token at position n + t - 1
            ctx = n + t
            macs += layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + h * shape.vocab_size
            attn += layers * 4 * shape.num_heads * shape.head_dim * ctx
            kv_bytes += layers * 2 * kv * 4 * ctx
    return roofline.Work(2.0 * macs, float(attn), float(kv_bytes))


def test_the_sums_match_a_token_by_token_count() -> None:
    """Random shapes and prompts: run_work's closed forms equal the pass-by-pass count."""
    rng = random.Random(3)
    for _ in range(20):
        cfg = shape(vocab=rng.randint(10, 500), heads=rng.choice([2, 4, 6]), head_dim=rng.randint(1, 16),
                    kv_heads=rng.choice([1, 2]), intermediate=rng.randint(2, 128), layers=rng.randint(1, 4))
        prompts = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        out = rng.randint(1, 9)
        got, want = roofline.run_work(cfg, prompts, out), simulate(cfg, prompts, out)
        assert got.linear_flops == want.linear_flops
        assert got.attention_flops == want.attention_flops
        assert got.kv_read_bytes == want.kv_read_bytes


def test_bad_runs_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        roofline.run_work(TINY, [3], 0)
    with pytest.raises(ValueError, match="at least one token"):
        roofline.run_work(TINY, [3, 0], 4)


def test_the_ceilings_probe_measures_and_restores_threads() -> None:
    before = torch.get_num_threads()
    c = roofline.measure_ceilings(1, read_gib=0.25, repeats=1)
    assert c.threads == 1 and torch.get_num_threads() == before
    assert c.fma_flops_per_s > 1e9 and c.read_bytes_per_s > 1e8
    arith, kv = roofline.floor_seconds(roofline.Work(c.fma_flops_per_s, 0.0, c.read_bytes_per_s), c)
    assert arith == pytest.approx(1.0) and kv == pytest.approx(1.0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_read_probe_reads_every_element_once_at_any_size(threads: int) -> None:
    """Each thread's part is read as interleaved streams, plus what is left over: the sum of
    arbitrary integers is exact whatever the size and thread count."""
    import ctypes

    lib, before = roofline._library(), torch.get_num_threads()
    torch.set_num_threads(threads)   # the OpenMP count of this thread, which peak.c uses
    try:
        for n in (1, 5, 127, 128, 129, 4096 * 33 + 7, 1_000_003):
            x = torch.randint(-1000, 1000, (n,), dtype=torch.int32)
            total = ctypes.c_int64()
            assert lib.read_bytes(x.data_ptr(), n, ctypes.byref(total)) > 0
            assert total.value == int(x.sum()), n
    finally:
        torch.set_num_threads(before)


def test_the_ceilings_kept_are_the_highest_measured() -> None:
    """A measurement taken while the cores were busy only reads lower: each ceiling is the best seen."""
    a, b = roofline.Ceilings(150e9, 30e9, 2), roofline.Ceilings(190e9, 22e9, 2)
    assert roofline.best(a, b) == roofline.Ceilings(190e9, 30e9, 2)
    assert roofline.best(a) == a
    with pytest.raises(ValueError, match="one thread count"):
        roofline.best(a, roofline.Ceilings(90e9, 20e9, 1))
    with pytest.raises(ValueError, match="one thread count"):
        roofline.best()
