"""Which requests speculate this step, with what proposals, and how well it went.

Called by the engine before each schedule: every decoding request gets up to k draft tokens
(`Request.spec_token_ids`) from the proposer, unless speculation does not pay: more than
`disable_by_batch_size` requests decode (the verify pass then computes k + 1 tokens per
request where the weights' one read no longer dominates), or the request's recent
acceptance fell below `min_acceptance` (it backs off `backoff_steps` steps, then tries again;
each failed try doubles the pause, up to 2**MAX_DOUBLINGS times). For a costly proposer (a
draft model: k forward passes per try) the engine keeps the same running acceptance over all
requests: while it is below `min_acceptance`, a new request starts paused, as long as the
last pause in the engine (a draft that never pays stops costing anything after the first few
requests; one good step anywhere lifts it). A cheap one (n-gram lookup) is judged per request
only: a try costs a few verified tokens, and one request's text says little about another's.
After the step the scheduler reports each verification (`on_verified`).
"""
from __future__ import annotations

from typing import Protocol

from engine.request import Request, RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Proposal

RECENT_WEIGHT = 0.5  # weight of the latest step in a request's running acceptance
ENGINE_WEIGHT = 0.25  # ... and in the engine's, over all requests
MAX_DOUBLINGS = 4


class Proposer(Protocol):
    # A request's running acceptance starts here: a cheap proposer (n-gram lookup) starts at 1
    # and pauses after two failed steps; a costly one (a draft model: k forward passes of its
    # own) starts lower and pauses after the first.
    prior_acceptance: float
    costly: bool   # judged over all requests too (see the module docstring)

    def propose(self, tokens: list[int], k: int) -> Proposal | None: ...


class BatchProposer(Protocol):
    prior_acceptance: float
    costly: bool

    def propose_batch(self, requests: list[Request], ks: list[int]) -> list[Proposal | None]: ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | BatchProposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.verify_steps = 0            # request-steps that verified a proposal
        self.batch_off_steps = 0         # steps with no proposals: the batch was too large
        self._recent: dict[str, float] = {}
        self._backoff: dict[str, int] = {}
        self._pauses: dict[str, int] = {}   # request id -> pauses in a row (no good step between)
        self._engine_recent = getattr(proposer, "prior_acceptance", 1.0)
        self._engine_pauses = 0             # pauses in a row over all requests
        self._costly = bool(getattr(proposer, "costly", False))

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of this step's decoding requests (and clear everyone else's)."""
        decoding = []
        for r in running:
            r.spec_token_ids, r.spec_probs = [], None
            if r.status is RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1:
                decoding.append(r)
        if not decoding:
            return
        if len(decoding) > self.config.disable_by_batch_size:
            self.batch_off_steps += 1
            return
        todo, ks = [], []
        for r in decoding:
            rid = r.request_id
            if self._costly and rid not in self._recent and self._engine_recent < self.config.min_acceptance:
                # new here while the proposer does not pay: start paused
                self._recent[rid] = self.config.min_acceptance
                self._pause(rid, self._engine_pauses)
            wait = self._backoff.get(rid, 0)
            if wait:
                self._backoff[r.request_id] = wait - 1
                continue
            # never propose past max_tokens or the context (the bonus token counts too)
            k = min(self.config.num_speculative_tokens,
                    r.sampling_params.max_tokens - len(r.output_token_ids) - 1,
                    self.max_model_len - r.num_tokens - 1)
            if k > 0:
                todo.append(r)
                ks.append(k)
        if hasattr(self.proposer, "propose_batch"):
            proposals = self.proposer.propose_batch(todo, ks)
        else:
            proposals = [self.proposer.propose(r.all_token_ids, k) for r, k in zip(todo, ks)]
        for r, p in zip(todo, proposals):
            if p is not None and p.tokens:
                r.spec_token_ids, r.spec_probs = p.tokens, p.probs

    def on_verified(self, req: Request, proposed: int, accepted: int) -> None:
        """A request's step verified `proposed` drafts and accepted `accepted` of them."""
        req.spec_proposed_tokens += proposed
        req.spec_accepted_tokens += accepted
        req.spec_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verify_steps += 1
        rid = req.request_id
        rate = accepted / proposed
        prior = getattr(self.proposer, "prior_acceptance", 1.0)
        recent = (1 - RECENT_WEIGHT) * self._recent.get(rid, prior) + RECENT_WEIGHT * rate
        self._engine_recent = (1 - ENGINE_WEIGHT) * self._engine_recent + ENGINE_WEIGHT * rate
        if recent < self.config.min_acceptance:
            self._pause(rid, self._pauses.get(rid, 0))
            self._engine_pauses += 1
            recent = self.config.min_acceptance  # one good step after the pause brings it back
        elif rate >= self.config.min_acceptance:
            self._pauses.pop(rid, None)
            self._engine_pauses = 0
        self._recent[rid] = recent

    def _pause(self, rid: str, pauses: int) -> None:
        self._backoff[rid] = self.config.backoff_steps << min(pauses, MAX_DOUBLINGS)
        self._pauses[rid] = pauses + 1

    def forget(self, request_id: str) -> None:
        self._recent.pop(request_id, None)
        self._backoff.pop(request_id, None)
        self._pauses.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        """Counters for /metrics: tokens proposed and accepted, verify steps, their ratios."""
        p, a, n = self.proposed_tokens, self.accepted_tokens, self.verify_steps
        return {"spec_proposed_tokens": p, "spec_accepted_tokens": a, "spec_verify_steps": n,
                "spec_acceptance_rate": a / p if p else 0.0,
                "spec_mean_accepted_length": 1 + a / n if n else 0.0,
                "spec_batch_off_steps": self.batch_off_steps}
