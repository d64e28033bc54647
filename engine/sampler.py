"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""
from __future__ import annotations

import torch

from engine.request import Request


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(seed)
            self._generators[req.request_id] = g
        return g

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, dict[int, float] | None]]:
        """logits: fp32 [len(requests), vocab]. Returns (token, top logprobs or None) per request."""
        out = []
        for row, req in zip(logits, requests):
            p = req.sampling_params
            if p.greedy:
                token = int(torch.argmax(row))
            else:
                x = row / p.temperature
                if p.top_k > 0 and p.top_k < x.shape[0]:
                    kth = torch.topk(x, p.top_k).values[-1]
                    x = x.masked_fill(x < kth, float("-inf"))
                if p.top_p < 1.0:
                    sorted_x, idx = torch.sort(x, descending=True)
                    probs = torch.softmax(sorted_x, dim=-1)
                    drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set reaching top_p
                    x = x.index_put((idx[drop],), torch.tensor(float("-inf")))
                probs = torch.softmax(x, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self._generator(req)))
            lp = None
            if p.logprobs is not None:
                logp = torch.log_softmax(row, dim=-1)
                lp = {token: float(logp[token])}
                if p.logprobs > 0:
                    top = torch.topk(logp, p.logprobs)
                    lp.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
            out.append((token, lp))
        return out
