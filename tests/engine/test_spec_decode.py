"""Speculative decoding: the proposers, the verifier (greedy and rejection sampling), and the
engine with speculation on: greedy output identical to plain decoding, token for token, with
prefix hits, chunked prefill and preemption in the mix; rolled-back KV; statistics."""
from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from engine.probs import target_probs
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.rejection import verify
from tests.engine.conftest import PARAGRAPH, make_engine, run_all, varied_prompts

GREEDY = SamplingParams(max_tokens=48, ignore_eos=False)
# speculating in batches of up to 4 too (the default stops at 2): the batched verify pass is tested
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2,
                          disable_by_batch_size=64)


# ---- proposers and config -------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(2, 4)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert p.propose(toks, 3).tokens == [2, 3, 6]          # suffix [6, 7]: latest earlier match at 6..7
    assert p.propose(toks + [2], 2).tokens == [3, 6]       # suffix [6, 7, 2] (3-gram) at 6..8
    assert p.propose([1, 2, 3, 4], 3) is None              # no repeated 2-gram
    assert p.propose([4, 4, 4], 3).tokens == [4]           # overlapping match: only what exists
    assert NgramProposer(3, 3).propose(toks, 3) is None    # no repeated 3-gram ending the sequence


@pytest.mark.parametrize("text,needle", [
    ("{", "not valid JSON"), ("[1]", "JSON object"), ('{"method": "medusa"}', "method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"), ('{"bogus": 1}', "unknown keys"),
    ('{"num_speculative_tokens": "4"}', "must be int"), ('{"prompt_lookup_min": 5, "prompt_lookup_max": 4}', "lookup"),
])
def test_bad_speculative_configs_are_one_line_errors(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as e:
        SpeculativeConfig.parse(text)
    assert "\n" not in str(e.value)


# ---- the verifier ---------------------------------------------------------------------

def test_greedy_verification_accepts_the_argmax_prefix() -> None:
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate((3, 4, 9, 1)):
        logits[i, t] = 5.0
    assert verify(logits, None, [3, 4, 9], None) == [3, 4, 9, 1]     # all accepted + bonus
    assert verify(logits, None, [3, 7, 9], None) == [3, 4]           # first mismatch: the argmax instead
    assert verify(logits, None, [0, 4, 9], None) == [3]


def test_sampling_edge_cases() -> None:
    g = torch.Generator().manual_seed(0)
    certain = torch.zeros(2, 5)
    certain[:, 2] = 1.0
    for _ in range(50):   # p(x) = 1: always accepted (deterministic draft)
        assert verify(torch.zeros(2, 5), certain, [2], None, g) == [2, 2]
    never = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.2] * 5])
    for _ in range(50):   # p(x) = 0: always rejected, and the residual never gives x back
        out = verify(torch.zeros(2, 5), never, [2], None, g)
        assert len(out) == 1 and out[0] in (1, 3)
    same = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.2] * 5])
    for _ in range(50):   # q == p: nothing is ever rejected
        assert len(verify(torch.zeros(2, 5), same, [3], same[:1], g)) == 2


def _first_token_tv(p: torch.Tensor, q: torch.Tensor, n: int, residual_ok: bool) -> float:
    """Total variation between p and the first emitted token's frequencies over n draws, drafts
    sampled from q. residual_ok=False resamples rejections from p itself (a wrong residual)."""
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros_like(p)
    probs = torch.stack([p, p])
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        if residual_ok:
            t = verify(torch.zeros(2, p.shape[0]), probs, [x], q[None], g)[0]
        else:
            accept = float(torch.rand((), generator=g)) * float(q[x]) < float(p[x])
            t = x if accept else int(torch.multinomial(p, 1, generator=g))
        counts[t] += 1
    return 0.5 * float((counts / n - p).abs().sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Drafts from a q far from p: the emitted distribution is p (TV below a bound that the wrong
    residual, resampling from p, exceeds). n = 20,000: sampling noise in TV is ~0.01."""
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    good = _first_token_tv(p, q, 20_000, residual_ok=True)
    bad = _first_token_tv(p, q, 20_000, residual_ok=False)
    assert good < 0.02, good
    assert bad > 0.05, bad


def test_target_probs_apply_temperature_top_k_top_p() -> None:
    row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = target_probs(row, SamplingParams(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and abs(float(p.sum()) - 1) < 1e-6
    p = target_probs(row, SamplingParams(temperature=0.5, top_p=0.5))
    assert p[0] == 1.0


# ---- the engine ----------------------------------------------------------------------

def copy_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    """Prompts whose answers copy from their context (where n-gram drafts are accepted)."""
    text = "".join(f"Fact {i}: {PARAGRAPH}" for i in range(3))
    asks = [f"Repeat this text exactly:\n{text}", f"Copy the following, word for word:\n{PARAGRAPH}{PARAGRAPH}"]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": a}])) for a in asks]


@pytest.fixture(scope="module")
def plain(loaded):  # noqa: ANN001, ANN201
    prompts = varied_prompts(loaded.tokenizer) + copy_prompts(loaded.tokenizer)
    engine = make_engine(loaded, max_num_seqs=4)
    return prompts, [o.token_ids for o in run_all(engine, prompts, GREEDY)]


def test_greedy_ngram_speculation_is_token_for_token_plain_decoding(loaded, plain) -> None:  # noqa: ANN001
    prompts, expected = plain
    engine = make_engine(loaded, max_num_seqs=4, speculative_config=NGRAM)
    outs = run_all(engine, prompts, GREEDY)
    assert len(prompts) >= 20
    assert [o.token_ids for o in outs] == expected
    s = engine.stats()
    assert s["spec_verify_steps"] > 0 and s["spec_accepted_tokens"] > 0  # it really speculated
    assert 0 < s["spec_acceptance_rate"] <= 1 and s["spec_mean_accepted_length"] > 1
    assert sum(o.spec_proposed_tokens for o in outs) == s["spec_proposed_tokens"]
    assert sum(o.spec_accepted_tokens for o in outs) == s["spec_accepted_tokens"]
    # the copy prompts: most drafts accepted
    copy = outs[-2:]
    assert sum(o.spec_accepted_tokens for o in copy) > 0.5 * sum(o.spec_proposed_tokens for o in copy)
    # every block went back: no block of a rejected draft is left behind
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_speculation_with_prefix_hits_chunked_prefill_and_preemption(loaded, plain) -> None:  # noqa: ANN001
    prompts, expected = plain
    # prefix hits: everything twice (the second round hits the first round's blocks)
    engine = make_engine(loaded, max_num_seqs=4, speculative_config=NGRAM)
    run_all(engine, prompts, GREEDY)
    again = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    # chunked prefill: a 64-token budget (drafts share it with the prefill chunks)
    engine = make_engine(loaded, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False,
                         speculative_config=NGRAM)
    assert [o.token_ids for o in run_all(engine, prompts, GREEDY)] == expected
    assert engine.stats()["spec_verify_steps"] > 0
    # preemption: a cache with room for the longest prompt and a little more
    block_bytes = make_engine(loaded, kv_cache_bytes=1 << 20).layout.block_bytes + 64
    blocks = max(-(-(len(p) + GREEDY.max_tokens) // 16) for p in prompts) + 2
    engine = make_engine(loaded, kv_cache_bytes=blocks * block_bytes, enable_prefix_caching=False,
                         speculative_config=NGRAM)
    outs = run_all(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


def test_greedy_self_draft_is_token_for_token_plain_decoding(loaded, plain) -> None:  # noqa: ANN001
    prompts, expected = plain
    cfg = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, draft_num_layers=10, min_acceptance=0.0,
                            disable_by_batch_size=64)
    engine = make_engine(loaded, max_num_seqs=4, speculative_config=cfg)
    outs = run_all(engine, prompts[::2], GREEDY)
    assert [o.token_ids for o in outs] == expected[::2]
    assert engine.stats()["spec_verify_steps"] > 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_sampled_requests_speculate_and_stay_in_range(loaded) -> None:  # noqa: ANN001
    """Seeded sampling with both proposers: runs, emits valid tokens, max_tokens respected."""
    prompts = copy_prompts(loaded.tokenizer)
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7)
    for cfg in (NGRAM, SpeculativeConfig(method="draft_model", num_speculative_tokens=2, draft_num_layers=10,
                                         min_acceptance=0.0, disable_by_batch_size=64)):
        engine = make_engine(loaded, speculative_config=cfg)
        outs = run_all(engine, prompts, params)
        assert all(1 <= len(o.token_ids) <= 40 for o in outs)
        assert engine.stats()["spec_verify_steps"] > 0


def test_speculation_switches_off_for_large_batches_and_low_acceptance(loaded) -> None:  # noqa: ANN001
    prompts = copy_prompts(loaded.tokenizer)
    cfg = SpeculativeConfig(disable_by_batch_size=1)
    engine = make_engine(loaded, speculative_config=cfg)
    run_all(engine, prompts, GREEDY)   # two requests decode together: never speculated
    s = engine.stats()
    assert s["spec_verify_steps"] == 0 and s["spec_batch_off_steps"] > 0
    # a proposer that is always wrong: after a few rejections the request backs off
    cfg = SpeculativeConfig(min_acceptance=0.5, backoff_steps=1000, disable_by_batch_size=64)
    engine = make_engine(loaded, speculative_config=cfg)
    engine.speculator.proposer = type("Wrong", (), {"propose": lambda self, toks, k: _wrong(k)})()
    outs = run_all(engine, prompts[:1], GREEDY)
    assert outs[0].spec_steps <= 2 and outs[0].spec_accepted_tokens == 0
    assert len(outs[0].token_ids) > 10


def _wrong(k: int):  # noqa: ANN202
    from engine.spec_decode.proposer import Proposal

    return Proposal([49151] * k)   # a token the model never picks here


def test_a_costly_proposer_that_never_pays_stops_being_tried_for_new_requests(loaded) -> None:  # noqa: ANN001
    """The engine-wide acceptance (costly proposers): after a few requests whose drafts all
    fail, a new request starts paused and verifies nothing."""
    from engine.spec_decode.speculator import Speculator

    cfg = SpeculativeConfig(min_acceptance=0.3, backoff_steps=1000)
    engine = make_engine(loaded, speculative_config=cfg)
    wrong = type("CostlyWrong", (), {"costly": True, "propose": lambda self, toks, k: _wrong(k)})()
    engine.scheduler.speculator = engine.speculator = Speculator(cfg, wrong, engine.max_model_len)
    prompt = loaded.tokenizer.encode("Once upon a time")
    outs = [run_all(engine, [prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0] for _ in range(6)]
    assert outs[0].spec_steps >= 1
    assert outs[-1].spec_steps == 0
    assert all(o.token_ids == outs[0].token_ids for o in outs)


def test_speculated_tokens_carry_plain_decodings_logprobs_to_the_bit(loaded) -> None:  # noqa: ANN001
    """A verified row is the decode row it stands for (engine/runner.py `row_spans`): with drafts
    accepted or not, every token's logprobs equal plain decoding's exactly, not to rounding."""
    prompts = copy_prompts(loaded.tokenizer)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    plain_outs = run_all(make_engine(loaded, max_num_seqs=4), prompts, params)
    engine = make_engine(loaded, max_num_seqs=4, speculative_config=NGRAM)
    outs = run_all(engine, prompts, params)
    assert engine.stats()["spec_accepted_tokens"] > 0
    for p, o in zip(plain_outs, outs):
        assert o.token_ids == p.token_ids and o.logprobs == p.logprobs
