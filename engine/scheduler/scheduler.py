"""The scheduler: which requests run this step and with how many tokens.

One step = `schedule()` -> model runner -> `update_from_output()`. Phases of `schedule()`:
1. running requests, decodes first, then prefill chunks of running requests;
   when blocks run out, the most recently admitted unscheduled request is preempted
   (its blocks freed, to be recomputed later);
2. waiting requests in arrival order (preempted ones first): local prefix-cache hit,
   then blocks for the rest, chunked to the remaining token budget.
Budgets: `max_num_batched_tokens` tokens and `max_num_seqs` requests per step.

Not thread-safe: one engine loop owns it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler.output import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- phase 1: running -----------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        scheduled: set[str] = set()
        for req in decodes + prefills:
            if budget <= 0 or req.status is not RequestStatus.RUNNING:
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    continue
                num_new = budget
            if not self._allocate_or_preempt(req, num_new, scheduled, out):
                continue
            out.scheduled.append(ScheduledSeq(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(req, num_new) is None:
            victims = [r for r in reversed(self.running) if r.request_id not in scheduled and r is not req]
            victim = victims[0] if victims else req
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks; it goes back to the front of the waiting queue."""
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        log.debug("preempted %s", req.request_id)

    # ---- phase 2: waiting -----------------------------------------------------------

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            req.num_computed_tokens = num_cached
            if self.kv.allocate_slots(req, num_new, computed) is None:
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledSeq(req, num_new))
            budget -= num_new
        return budget

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    # ---- finalize -------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance computed tokens, append sampled tokens, cache newly full blocks."""
        now = time.monotonic()
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted during the step
                continue
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
            self.kv.cache_computed(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stopped, aborted, failed): free its blocks and forget it."""
        req.status = status
        req.finish_time = time.monotonic()
        self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
