"""The scheduler: which requests run this step and with how many tokens.

One step = `schedule()` -> model runner -> `update_from_output()`. Phases of `schedule()`:
0. (with a KV connector and `kv_load_wait_s` > 0) load ahead: start the loads of the
   waiting requests the next batch would admit; if any started, the step is only that
   (nothing computed: the runner waits up to `kv_load_wait_s` on their completion), so a
   load that lands at once lets its request join the very next batch (a pool read takes
   milliseconds, a step of others' work often hundreds);
1. running requests, decodes first, then prefill chunks of running requests;
   when blocks run out, the most recently admitted unscheduled request is preempted
   (its blocks freed, to be recomputed later);
2. waiting requests in arrival order (preempted ones first): local prefix-cache hit,
   then (with a KV connector) the external hit after it (`remote_kv`), then blocks for
   the rest, chunked to the remaining token budget.
Budgets: `max_num_batched_tokens` tokens and `max_num_seqs` requests per step; with
`long_prefill_token_threshold` > 0 (vLLM's knob) no request prefills more than that many
tokens in one step, so a long prompt leaves room for the short ones that arrive beside it.
`update_from_output()` is the finalize phase: tokens appended, stop checked, outputs made.

Not thread-safe: one engine loop owns it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector.config import KVTransferConfig
from engine.outputs import RequestOutput, make_output, stop_at_max_tokens
from engine.request import Request, RequestStatus
from engine.step import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from engine.scheduler.remote_kv import LoadState, RemoteKV

if TYPE_CHECKING:
    from engine.kv_connector.base import KVConnectorBase_V1
    from engine.spec_decode.speculator import Speculator

log = logging.getLogger(__name__)

# With nothing to compute but loads in flight, a step waits this long at most for them: short,
# so a request that arrives meanwhile waits little; the wait ends as soon as the loads land.
IDLE_LOAD_WAIT_S = 0.005

StopCheck = Callable[[Request], "RequestStatus | None"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    kv_load_failure_policy: str = KVTransferConfig.kv_load_failure_policy   # or "fail"
    kv_load_timeout_s: float = KVTransferConfig.kv_load_timeout_s         # a load not reported by then fails it
    long_prefill_token_threshold: int = 0       # > 0: a request's prefill chunk per step is at most this
    kv_load_wait_s: float = 0.0                 # > 0: load-ahead steps wait this long for their loads

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.kv_load_wait_s < 0:
            raise ValueError("kv_load_wait_s must be >= 0")

    def chunk(self, num_new: int) -> int:
        """A prefill's tokens this step before the step's budget: capped at the long-prefill
        threshold when chunked prefill is on."""
        t = self.long_prefill_token_threshold
        return t if self.enable_chunked_prefill and 0 < t < num_new else num_new


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnectorBase_V1 | None = None,
                 stop: StopCheck = stop_at_max_tokens, speculator: Speculator | None = None) -> None:
        """`stop` decides after each sampled token whether the request ends (the engine's
        checks eos, stop strings and the context length; the default only max_tokens).
        `speculator`: speculative decoding (drafts proposed at the start of each schedule)."""
        self.config = config
        self.kv = kv
        self.stop = stop
        self.speculator = speculator
        self.remote = RemoteKV(connector, kv, config.kv_load_failure_policy, config.kv_load_timeout_s) \
            if connector is not None else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefill_tokens = 0                        # prompt tokens computed by the model (counter)
        self._finished_ids: set[str] = set()           # ended since the last schedule(); told to the runner
        self._finished_outside: list[Request] = []     # ended outside a batch (load failures); output next update
        self._asked_later = False                      # this step, the connector said "ask again later"

    # ---- queue management -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.remote is not None:  # hashes now, so the connector can start its lookup at arrival
            self.kv.update_hashes(request)
            self.remote.connector.on_new_request(request)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.num_loading or self._finished_outside
                    or (self.remote is not None and self.remote.num_sending))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_loading(self) -> int:
        """Requests whose connector load has started and not been taken up by a batch yet."""
        return self.remote.num_loading if self.remote else 0

    @property
    def remote_hit_tokens(self) -> int:
        return self.remote.remote_hit_tokens if self.remote else 0

    @property
    def failed_load_blocks(self) -> int:
        return self.remote.failed_load_blocks if self.remote else 0

    # ---- phase 1: running -----------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        scheduled: set[str] = set()
        for req in decodes + prefills:
            if budget <= 0 or req.status is not RequestStatus.RUNNING:
                continue
            num_new = self.config.chunk(req.num_tokens - req.num_computed_tokens)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    continue
                num_new = budget
            drafts = tuple(req.spec_token_ids[:budget - 1]) if num_new == 1 else ()
            if drafts and self.kv.allocate_slots(req, 1 + len(drafts)) is None:
                drafts = ()  # drafts never preempt anyone: without free blocks for them, a plain step
            if not self._allocate_or_preempt(req, num_new + len(drafts), scheduled, out):
                continue
            if drafts:
                probs = req.spec_probs[:len(drafts)] if req.spec_probs is not None else None
                out.scheduled.append(ScheduledSeq(req, 1 + len(drafts), drafts, probs))
                budget -= len(drafts)
            else:
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
        req.spec_token_ids, req.spec_probs = [], None
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        log.debug("preempted %s", req.request_id)

    # ---- phase 2: waiting -----------------------------------------------------------

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        skipped: deque[Request] = deque()
        remote = self.remote
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert remote is not None
                state, why = remote.claim(req)
                if state is LoadState.FAILED:
                    self._fail(req, why)
                if state is not LoadState.DONE:
                    if not req.is_finished:
                        skipped.append(req)
                    continue
            computed: list = []
            if self.kv.has_blocks(req):  # blocks loaded by the connector: only the rest is left
                num_cached = req.num_computed_tokens
            elif remote is None:
                computed, num_cached = self.kv.get_computed_blocks(req)
            else:
                computed, num_cached, num_external = remote.lookup(req, record=True)
                if num_external is None:  # the connector asks to be asked again later
                    self._asked_later = True
                    skipped.append(req)
                    continue
                if num_external > 0:
                    if not remote.start(req, computed, num_cached, num_external):
                        self.waiting.appendleft(req)
                        break
                    skipped.append(req)
                    continue
            num_new = self.config.chunk(req.num_tokens - num_cached)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    self.waiting.appendleft(req)
                    break
                num_new = budget
            req.num_computed_tokens = num_cached
            if self.kv.allocate_slots(req, num_new, computed) is None:
                if not self.kv.has_blocks(req):
                    req.num_computed_tokens = 0
                self.waiting.appendleft(req)
                break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledSeq(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    # ---- phase 0: load ahead --------------------------------------------------------

    def _load_ahead(self) -> frozenset[str]:
        """Start the connector loads of the waiting requests the next batch would admit (as
        many as there are free seats). Returns the requests now loading."""
        assert self.remote is not None
        started: list[str] = []
        room = self.config.max_num_seqs - len(self.running)
        for req in list(self.waiting)[:max(room, 0)]:
            if req.status is not RequestStatus.WAITING or self.kv.has_blocks(req):
                continue
            computed, num_cached, num_external = self.remote.lookup(req, record=False)
            if not num_external:  # no external hit (counted when phase 2 admits it), or ask later
                continue
            if not self.remote.start(req, computed, num_cached, num_external):
                break
            self.kv.record_query(req, num_cached)
            started.append(req.request_id)
        return frozenset(started)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=frozenset(self._finished_ids))
        self._finished_ids.clear()
        remote = self.remote
        if remote is not None and self.config.kv_load_wait_s > 0:
            started = self._load_ahead()
            if started:
                out.loads_to_wait, out.load_wait_s = started, self.config.kv_load_wait_s
                out.kv_connector_metadata = remote.connector.build_connector_meta(out)
                return out
        if self.speculator is not None:  # after load-ahead: a step that computes nothing drafts nothing
            self.speculator.propose(self.running)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if remote is not None:
            out.block_tables = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in out.scheduled}
            out.kv_connector_metadata = remote.connector.build_connector_meta(out)
            if not out.scheduled and (remote.num_loading or remote.num_sending):
                out.loads_to_wait, out.load_wait_s = remote.loading_ids(), IDLE_LOAD_WAIT_S
            elif not out.scheduled and self._asked_later:  # only lookups in flight: wait on them, not spin
                remote.connector.wait_for_lookups(IDLE_LOAD_WAIT_S)
        self._asked_later = False
        return out

    # ---- finalize -------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Take the runner's report: connector news first, then advance computed tokens,
        append sampled tokens, cache newly full blocks, end requests that stop. Returns an
        output for every request that produced a token or ended."""
        if result.kv_connector_output is not None and self.remote is not None:
            self.remote.report(result.kv_connector_output, self.requests)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted during the step
                continue
            samples = result.sampled.get(req.request_id)
            num_new = s.num_new_tokens
            if s.draft_token_ids and samples is not None:
                # Only the accepted drafts' KV counts as computed; the rest of the step's slots are
                # overwritten later (their blocks past the request's tokens are freed below).
                accepted = len(samples) - 1
                num_new -= len(s.draft_token_ids) - accepted
                if self.speculator is not None:
                    self.speculator.on_verified(req, len(s.draft_token_ids), accepted)
            self.prefill_tokens += max(0, min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
                                       - req.num_computed_tokens)
            req.num_computed_tokens += num_new
            stopped = None
            for token, logprobs in samples or ():
                req.output_token_ids.append(token)
                if logprobs is not None:
                    req.output_logprobs.append(logprobs)
                if req.first_token_time is None:
                    req.first_token_time = now
                stopped = self.stop(req)
                if stopped is not None:  # tokens after a stop (accepted drafts) are dropped
                    break
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self.kv.cache_computed(req)
            if stopped is not None:
                self.finish(req, stopped)
            elif s.draft_token_ids:
                self.kv.trim(req)
            if samples is not None:
                if not (req.is_finished and self.remote is not None and self.remote.is_sending(req.request_id)):
                    outputs.append(make_output(req))   # else: answered when its send finished
        if self.remote is not None:
            self._finished_outside.extend(self.remote.take_sent())
        outputs.extend(make_output(r) for r in self._finished_outside)
        self._finished_outside.clear()
        return outputs

    def _fail(self, req: Request, message: str) -> None:
        log.warning("%s: %s", req.request_id, message)
        req.error = message
        self.finish(req, RequestStatus.FINISHED_ERROR)
        self._finished_outside.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stopped, aborted, failed): free its blocks and forget it. The blocks
        stay while the connector still sends them or a load in flight still writes into them
        (freed when the worker side reports)."""
        rid = req.request_id
        req.status = status
        req.finish_time = time.monotonic()
        hold = self.remote.on_finish(req) if self.remote is not None else False
        if not hold:
            self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(rid, None)
        self._finished_ids.add(rid)
        if self.speculator is not None:
            self.speculator.forget(rid)
