"""The last layer past its K/V write runs on the sampled rows only: which rows qualify
(AttentionMetadata.query_tails), that the layer's MLP really sees only them, and that the output
is what the whole layer computes."""
from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.model import LlamaModel
from engine.request import SamplingParams
from tests.engine.conftest import make_engine, run_all


def _meta(spans: list[tuple[int, int, int]]) -> AttentionMetadata:
    seqs = [SeqSpan(q0, n, ctx, torch.arange(-(-ctx // 16))) for q0, n, ctx in spans]
    total = sum(n for _, n, _ in spans)
    return AttentionMetadata(seqs, torch.arange(total) * 10, torch.arange(total) % 16)


def test_query_tails_keeps_each_sequences_last_rows() -> None:
    # a 5-token prefill chunk after 20 cached tokens, a decode, a 4-token chunk mid-prompt
    meta = _meta([(0, 5, 25), (5, 1, 40), (6, 4, 4)])
    sub = meta.query_tails([4, 5])
    assert sub is not None
    assert [(s.query_start, s.num_query, s.context_len) for s in sub.seqs] == [(0, 1, 25), (1, 1, 40)]
    assert torch.equal(sub.seqs[1].block_table, meta.seqs[1].block_table)
    assert sub.slot_block_ids.tolist() == [40, 50] and sub.slot_offsets.tolist() == [4, 5]
    # a speculating sequence's last three rows stay a three-token query
    sub = meta.query_tails([2, 3, 4, 8, 9])
    assert sub is not None
    assert [(s.query_start, s.num_query, s.context_len) for s in sub.seqs] == [(0, 3, 25), (3, 2, 4)]
    assert meta.query_tails([]).seqs == []


@pytest.mark.parametrize("rows", [[3], [2, 4], [4, 3], [4, 5, 5], [11], [0, 1, 2, 4]])
def test_query_tails_refuses_rows_that_are_not_tails(rows: list[int]) -> None:
    """Not a sequence's last rows, a gap, out of order, repeated, outside the batch."""
    assert _meta([(0, 5, 25), (5, 1, 40), (6, 4, 4)]).query_tails(rows) is None


def _spy_last_mlp(engine, seen: list[int]) -> None:  # noqa: ANN001
    last = engine.model.layers[-1]
    down = last.down

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return down(x)
    last.down = spy


@pytest.mark.slow
def test_last_layer_runs_on_sampled_rows_with_the_same_output(loaded, monkeypatch) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (300, 45, 170)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5)
    # chunks of 128 tokens: passes with a prompt's middle (no sampled row) beside others' last rows
    kw = dict(max_num_batched_tokens=128, long_prefill_token_threshold=0)
    pruned, seen = make_engine(loaded, **kw), []
    _spy_last_mlp(pruned, seen)
    got = run_all(pruned, prompts, params)
    # every pass ran the last MLP on one row per sampling sequence, never a prompt's other tokens
    assert seen and max(seen) <= len(prompts)
    monkeypatch.setattr(LlamaModel, "_last_layer_rows", staticmethod(lambda *a: None))
    whole, seen_whole = make_engine(loaded, **kw), []
    _spy_last_mlp(whole, seen_whole)
    want = run_all(whole, prompts, params)
    assert max(seen_whole) == 128  # the spy sees the whole layer's rows where nothing is cut
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def test_row_spans_split_prompt_rows_from_the_rows_past_the_prompt() -> None:
    """engine/runner.py `row_spans`: a pass's prompt rows are one prefill span (of one row too),
    each row past the prompt a decode span; the last layer's tails keep that kind; the Triton
    tables hold one row per request however many spans it has."""
    from engine.runner import row_spans

    table = torch.arange(4)
    chunk = row_spans(0, 16, 8, 40, table)      # a prompt chunk: one span
    assert [(s.query_start, s.num_query, s.context_len, s.decode) for s in chunk] == [(0, 8, 24, False)]
    tail = row_spans(3, 39, 1, 40, table)       # the prompt's last token alone (after a hit)
    assert [(s.num_query, s.context_len, s.prompt_row, s.decode) for s in tail] == [(1, 40, True, False)]
    verify = row_spans(4, 44, 4, 40, table)     # a decode row and 3 drafts
    assert [(s.query_start, s.num_query, s.context_len, s.decode) for s in verify] == \
        [(4 + i, 1, 45 + i, True) for i in range(4)]
    straddle = row_spans(0, 38, 4, 40, table)   # recompute: 2 prompt rows, then 2 generated ones
    assert [(s.num_query, s.context_len, s.decode) for s in straddle] == [(2, 40, False), (1, 41, True), (1, 42, True)]
    total = 1 + 4
    meta = AttentionMetadata([*row_spans(0, 39, 1, 40, table), *[SeqSpan(1 + i, 1, 45 + i, torch.arange(5)) for i in range(4)]],
                             torch.arange(total), torch.arange(total))
    assert [s.query_start for s in meta.prefill_seqs] == [0] and meta.decode_tables[0].tolist() == [1, 2, 3, 4]
    sub = _meta([(0, 5, 25)]).query_tails([4])  # a prefill chunk's last row stays a prompt row
    assert sub is not None and not sub.seqs[0].decode
    tables, seq_of, pos_of = AttentionMetadata(straddle, torch.arange(4), torch.arange(4)).kernel_tables
    assert tables.shape[0] == 1 and seq_of.tolist() == [0, 0, 0, 0] and pos_of.tolist() == [38, 39, 40, 41]
