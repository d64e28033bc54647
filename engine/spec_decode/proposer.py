"""What a proposer hands the verifier: draft tokens and, for sampled drafts, their distributions.

A proposer takes a request's tokens so far and proposes up to k next tokens. Deterministic ones
(n-gram lookup) leave `probs` None (q = one-hot); a draft model that samples gives the
distribution each token was drawn from, so rejection sampling stays exact. An EAGLE-style head
(hidden states in, tokens out) fits the same contract: the verifier only sees tokens and q.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None   # [len(tokens), vocab] fp32 q_i, or None: deterministic
