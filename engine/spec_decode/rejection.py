"""Verification of speculative proposals: greedy matching, or rejection sampling as in
Leviathan et al. / Chen et al. (speculative sampling), so the emitted tokens follow the target
model's distribution exactly whatever the proposer.

For draft i (token x, proposed with probability q_i(x)): accept with probability
min(1, p_i(x) / q_i(x)); on the first rejection emit a token drawn from the normalised residual
max(0, p_i - q_i) and stop; if every draft is accepted, emit a bonus token drawn from p_k. A
proposer that picks its token deterministically (n-gram lookup) has q_i = one-hot(x): accept
with probability p_i(x), residual = p_i with x removed. Greedy requests (probs None) accept
while the draft equals the target's argmax and emit the argmax where it differs: the tokens
of plain greedy decoding, one for one.
"""
from __future__ import annotations

import torch


def verify(logits: torch.Tensor, probs: torch.Tensor | None, drafts: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None = None) -> list[int]:
    """logits: [k + 1, vocab] target logits at the last token and each of the k drafts; probs: the
    target's sampling distributions at those positions ([k + 1, vocab]; None = greedy); draft_probs:
    the proposer's distributions q_i ([k, vocab]; None = deterministic proposals). Returns the
    emitted tokens (accepted drafts + one more)."""
    k = len(drafts)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    if probs is None:
        best = torch.argmax(logits, dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if best[i] != d:
                return out + [best[i]]
            out.append(d)
        return out + [best[k]]
    out = []
    for i, x in enumerate(drafts):
        p = probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u * q_x < float(p[x]):   # u < p(x) / q(x) without dividing by a tiny q
            out.append(x)
            continue
        return out + [_residual_sample(p, draft_probs[i] if draft_probs is not None else x, generator)]
    return out + [int(torch.multinomial(probs[k], 1, generator=generator))]


def _residual_sample(p: torch.Tensor, q: torch.Tensor | int, generator: torch.Generator | None) -> int:
    """A token from max(0, p - q) normalised; q a distribution or a token (one-hot)."""
    if isinstance(q, int):
        r = p.clone()
        r[q] = 0.0
    else:
        r = (p - q).clamp_(min=0.0)
    total = float(r.sum())
    if total <= 0.0:  # p <= q everywhere: only possible when p == q, where nothing is rejected
        r = p
    return int(torch.multinomial(r, 1, generator=generator))
