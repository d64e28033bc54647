"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs; and the
verification of speculative proposals (`spec_decode.rejection`) with the same distributions."""
from __future__ import annotations

import torch

from engine.probs import target_probs
from engine.request import Request, SamplingParams
from engine.spec_decode.rejection import verify

Sample = tuple[int, "dict[int, float] | None"]  # (token, its top logprobs or None)


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

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Sample]:
        """logits: fp32 [len(requests), vocab]. Returns (token, top logprobs or None) per request."""
        out = []
        for row, req in zip(logits, requests):
            p = req.sampling_params
            if p.greedy:
                token = int(torch.argmax(row))
            else:
                token = int(torch.multinomial(target_probs(row, p), 1, generator=self._generator(req)))
            out.append((token, self._logprobs(row, token, p)))
        return out

    def verify(self, logits: torch.Tensor, req: Request, drafts: list[int],
               draft_probs: torch.Tensor | None) -> list[Sample]:
        """logits: fp32 [len(drafts) + 1, vocab], the target's at the request's last token and at each
        draft. The tokens the request emits this step: the accepted drafts, then the target's
        correction (or, all accepted, a bonus token), so 1 .. len(drafts) + 1 of them."""
        p = req.sampling_params
        probs = None if p.greedy else torch.stack([target_probs(row, p) for row in logits])
        tokens = verify(logits, probs, drafts, draft_probs, self._generator(req))
        return [(t, self._logprobs(logits[i], t, p)) for i, t in enumerate(tokens)]

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, p: SamplingParams) -> dict[int, float] | None:
        if p.logprobs is None:
            return None
        logp = torch.log_softmax(row, dim=-1)
        lp = {token: float(logp[token])}
        if p.logprobs > 0:
            top = torch.topk(logp, p.logprobs)
            lp.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
        return lp
