"""Greedy output of our engine against Hugging Face transformers, and against itself under
chunked prefill, prefix-cache hits, preemption and batching."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.native.build import kernel_isa
from engine.request import SamplingParams
from tests.engine.conftest import make_engine, run_all, varied_prompts

# Each test runs the real model on ~20 prompts (about 30-100 s on a quiet 2-core machine);
# the suite-wide 300 s guard is too tight when the machine is shared. Still bounded.
pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(loaded):  # noqa: ANN001, ANN201
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    path = Path(loaded.source)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """Plain greedy decoding with transformers' KV cache (no logits processors, EOS not special)."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.mark.slow
def test_greedy_tokens_match_transformers(loaded, hf_model) -> None:  # noqa: ANN001
    prompts = varied_prompts(loaded.tokenizer)
    ours = run_all(make_engine(loaded, max_num_batched_tokens=1024), prompts, GREEDY)
    for prompt, out in zip(prompts, ours):
        assert out.token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)} tokens"


@pytest.mark.slow
def test_logits_close_to_transformers(loaded, hf_model) -> None:  # noqa: ANN001
    from engine.attention.metadata import AttentionMetadata, SeqSpan

    engine = make_engine(loaded)
    prompt = varied_prompts(loaded.tokenizer)[-1]
    n = len(prompt)
    table = torch.arange(-(-n // 16))
    pos = torch.arange(n)
    meta = AttentionMetadata([SeqSpan(0, n, n, table)], table[pos // 16], pos % 16)
    ours = engine.model.forward(torch.tensor(prompt), pos, engine.cache, meta, torch.arange(n))
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-3), float((ours - ref).abs().max())


@pytest.fixture(scope="module")
def reference(loaded):  # noqa: ANN001, ANN201
    """Each prompt alone, no chunking, no prefix caching: the outputs to match."""
    prompts = varied_prompts(loaded.tokenizer)[::3]
    engine = make_engine(loaded, enable_chunked_prefill=False, enable_prefix_caching=False,
                         max_num_batched_tokens=4096, max_num_seqs=1)
    return prompts, [o.token_ids for o in run_all(engine, prompts, GREEDY)]


def test_chunked_prefill_gives_identical_output(loaded, reference) -> None:  # noqa: ANN001
    prompts, expected = reference
    engine = make_engine(loaded, max_num_batched_tokens=64, enable_prefix_caching=False)
    outs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert max(len(p) for p in prompts) > 64  # chunking really happened


def test_long_prefill_threshold_gives_identical_output(loaded, reference) -> None:  # noqa: ANN001
    prompts, expected = reference
    engine = make_engine(loaded, max_num_batched_tokens=256, long_prefill_token_threshold=40,
                         enable_prefix_caching=False)
    outs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert engine.scheduler.config.long_prefill_token_threshold == 40


def test_prefix_cache_hit_gives_identical_output(loaded, reference) -> None:  # noqa: ANN001
    prompts, expected = reference
    engine = make_engine(loaded)
    run_all(engine, prompts, GREEDY)
    again = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert all(o.num_cached_tokens >= (len(p) - 1) // 16 * 16 - 16 for o, p in zip(again, prompts))
    assert sum(o.num_cached_tokens for o in again) > 0


def test_preemption_gives_identical_output(loaded, reference) -> None:  # noqa: ANN001
    prompts, expected = reference
    layout_bytes = make_engine(loaded, kv_cache_bytes=1 << 20).layout.block_bytes + 64
    # Room for the longest prompt and a little more: concurrent requests must preempt each other.
    blocks = max(-(-len(p) // 16) for p in prompts) + 4
    engine = make_engine(loaded, kv_cache_bytes=blocks * layout_bytes, enable_prefix_caching=False)
    outs = run_all(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_batched_with_thirty_others_gives_identical_output(loaded, reference) -> None:  # noqa: ANN001
    prompts, expected = reference
    target = prompts[0]
    others = [loaded.tokenizer.encode(f"Story number {i}: the dragon and the") for i in range(30)]
    engine = make_engine(loaded)
    outs = run_all(engine, [target] + others, GREEDY)
    assert outs[0].token_ids == expected[0]
    alone = run_all(make_engine(loaded), others[:1], GREEDY)
    assert outs[1].token_ids == alone[0].token_ids


def test_a_prompt_computed_after_a_hit_to_its_last_token_gives_the_same_bits(loaded) -> None:  # noqa: ANN001
    """The last prompt token alone after a prefix hit (a one-row chunk) runs as a prompt row, not a
    decode row: its logprobs, and the tokens after it, are those of the prompt computed whole, to the
    bit (the decode kernel's sums differ from the prefill kernel's in the last bits)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [p[:len(p) // 16 * 16 + 1] for p in varied_prompts(loaded.tokenizer) if len(p) > 40][:4]
    whole = run_all(make_engine(loaded, enable_prefix_caching=False), prompts, params)
    engine = make_engine(loaded)
    run_all(engine, [p[:-1] for p in prompts], SamplingParams(max_tokens=1))  # the blocks before the last token
    hit = run_all(engine, prompts, params)
    assert [o.num_cached_tokens for o in hit] == [len(p) - 1 for p in prompts]
    for w, h in zip(whole, hit):
        assert h.token_ids == w.token_ids and h.logprobs == w.logprobs


@pytest.mark.skipif(kernel_isa() not in ("x86_64_v4", "x86_64_v3"), reason="the C attention kernels need AVX2 with FMA")
def test_a_follow_up_hitting_a_decoded_answer_gives_the_bits_of_the_prompt_prefilled(loaded) -> None:  # noqa: ANN001
    """A second turn's prompt holds the first turn's answer, whose K/V the decode kernel computed
    (cached here; on another node, pulled from the node that decoded it). The decode kernel
    computes each row as the prefill kernel does, so the follow-up's logprobs equal those of the
    same prompt prefilled whole on an engine that never saw the first turn, to the bit."""
    prompts = varied_prompts(loaded.tokenizer)[1::5]
    engine = make_engine(loaded, kernels="c")
    first = run_all(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    follow_ups = [p + o.token_ids + p[:9] for p, o in zip(prompts, first)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    hit = run_all(engine, follow_ups, params)
    assert all(h.num_cached_tokens >= len(p) + 16 for h, p in zip(hit, prompts))  # blocks of the answer hit
    whole = run_all(make_engine(loaded, kernels="c", enable_prefix_caching=False), follow_ups, params)
    for w, h in zip(whole, hit):
        assert h.token_ids == w.token_ids and h.logprobs == w.logprobs


def test_tokens_recomputed_after_a_preemption_keep_their_bits(loaded) -> None:  # noqa: ANN001
    """A preempted request's generated tokens are recomputed as the decode rows they were
    (engine/runner.py `row_spans`), its prompt as prefill: the logprobs after the preemption
    equal those of the request never preempted, to the bit."""
    prompts = varied_prompts(loaded.tokenizer)[::3]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    alone = run_all(make_engine(loaded, enable_prefix_caching=False), prompts, params)
    layout_bytes = make_engine(loaded, kv_cache_bytes=1 << 20).layout.block_bytes + 64
    blocks = max(-(-len(p) // 16) for p in prompts) + 4  # as test_preemption_gives_identical_output
    engine = make_engine(loaded, kv_cache_bytes=blocks * layout_bytes, enable_prefix_caching=False)
    outs = run_all(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for a, o in zip(alone, outs):
        assert o.token_ids == a.token_ids and o.logprobs == a.logprobs
