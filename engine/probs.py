"""The distribution a sampled request draws from (shared by the sampler and draft proposers)."""
from __future__ import annotations

import torch

from engine.request import SamplingParams


def target_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: fp32 logits [vocab] after temperature,
    top-k and top-p (the smallest set of most likely tokens reaching top_p), normalised."""
    x = row / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set reaching top_p
        x = x.index_put((idx[drop],), torch.tensor(float("-inf")))
    return torch.softmax(x, dim=-1)
