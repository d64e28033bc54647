"""The scheduler: which requests run this step and with how many tokens.

One step = `schedule()` -> model runner -> `update_from_output()`. Phases of `schedule()`:
1. running requests, decodes first, then prefill chunks of running requests;
   when blocks run out, the most recently admitted unscheduled request is preempted
   (its blocks freed, to be recomputed later);
2. waiting requests in arrival order (preempted ones first): local prefix-cache hit,
   then (with a KV connector) the external hit after it, then blocks for the rest,
   chunked to the remaining token budget.
Budgets: `max_num_batched_tokens` tokens and `max_num_seqs` requests per step; with
`long_prefill_token_threshold` > 0 (vLLM's knob) no request prefills more than that many
tokens in one step, so a long prompt leaves room for the short ones that arrive beside it.

With a KV connector (vLLM's scheduler-side `KVConnectorBase_V1`), a request whose prefix
the connector can load gets blocks for those tokens and waits in WAITING_FOR_REMOTE_KVS
(skipped, not blocking the queue) until the worker side reports the load finished. Then
the loaded tokens count as computed, except from the first block that failed to load on
(recomputed; or the request fails under the `fail` policy). A request still loading when
it is aborted keeps its blocks until the load has finished, so no late write lands in a
block another request owns. Loads cannot be preempted: they hold no running slot.
`start_loads()`, called by the engine before `schedule()`, starts the loads of the waiting
requests `schedule()` would admit next, so that a load reported at once joins this step.

Not thread-safe: one engine loop owns it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler.output import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from connector.base import KVConnectorBase_V1, KVConnectorOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    kv_load_failure_policy: str = "recompute"   # or "fail"
    kv_load_timeout_s: float = 30.0             # a load not reported by then fails the request
    long_prefill_token_threshold: int = 0       # > 0: a request's prefill chunk per step is at most this

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")

    def chunk(self, num_new: int) -> int:
        """A prefill's tokens this step before the step's budget: capped at the long-prefill
        threshold when chunked prefill is on."""
        t = self.long_prefill_token_threshold
        return t if self.enable_chunked_prefill and 0 < t < num_new else num_new


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 connector: KVConnectorBase_V1 | None = None) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.loading: dict[str, float] = {}          # request id -> load start (WAITING_FOR_REMOTE_KVS)
        self._finished_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self.finished_outside_step: list[Request] = []  # ended between steps (load failures); drained by the engine
        # counters, in tokens
        self.prefill_tokens = 0          # prompt tokens computed by the model
        self.remote_hit_tokens = 0       # prompt tokens loaded by the connector
        self.failed_load_blocks = 0      # blocks whose load failed

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
        return bool(self.waiting or self.running or self.loading)

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
            num_new = self.config.chunk(req.num_tokens - req.num_computed_tokens)
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
        skipped: deque[Request] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._load_finished(req):
                    if not req.is_finished:
                        skipped.append(req)
                    continue
            computed: list = []
            if self.kv.has_blocks(req):  # blocks loaded by the connector: only the rest is left
                num_cached = req.num_computed_tokens
            else:
                computed, num_cached = self.kv.get_computed_blocks(req)
                if self.connector is not None:
                    num_external, _ = self.connector.get_num_new_matched_tokens(req, num_cached)
                    if num_external is None:  # the connector asks to be asked again later
                        skipped.append(req)
                        continue
                    if num_external > 0:
                        if not self._start_load(req, computed, num_cached, num_external):
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

    # ---- loads through the connector ------------------------------------------------

    def start_loads(self) -> tuple[SchedulerOutput, list[str]] | None:
        """Before `schedule()`: start the connector loads of the waiting requests it would
        admit next, so that a load which finishes at once (see the engine's step) lets its
        request be prefilled in this step's batch instead of the next. Returns the connector
        metadata for the worker and the requests now loading, or None if none started."""
        if self.connector is None:
            return None
        started: list[str] = []
        room = self.config.max_num_seqs - len(self.running)
        for req in list(self.waiting)[:max(room, 0)]:
            if req.status is not RequestStatus.WAITING or self.kv.has_blocks(req):
                continue
            computed, num_cached = self.kv.get_computed_blocks(req, record=False)
            num_external, _ = self.connector.get_num_new_matched_tokens(req, num_cached)
            if not num_external:  # no external hit (counted when schedule() admits it), or ask later
                continue
            if not self._start_load(req, computed, num_cached, num_external):
                break
            self.kv.record_query(req, num_cached)
            started.append(req.request_id)
        if not started:
            return None
        out = SchedulerOutput()
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out, started

    def _start_load(self, req: Request, computed: list, num_cached: int, num_external: int) -> bool:
        """Allocate blocks for the external tokens and park the request while they load."""
        assert self.connector is not None
        req.num_computed_tokens = num_cached
        new = self.kv.allocate_slots(req, num_external, computed)
        if new is None:
            req.num_computed_tokens = 0
            return False
        self.connector.update_state_after_alloc(req, [b.block_id for b in new], num_external)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        req.num_external_tokens = num_external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = time.monotonic()
        return True

    def load_reported(self, rid: str) -> bool:
        """The worker side has reported this request's load finished (not yet taken up)."""
        return rid in self._finished_recving

    def _load_finished(self, req: Request) -> bool:
        """True once the request's load is over and it can be scheduled (possibly recomputing)."""
        rid = req.request_id
        if rid not in self._finished_recving:
            if time.monotonic() - self.loading[rid] > self.config.kv_load_timeout_s:
                self._fail(req, f"loading {req.num_external_tokens} tokens of KV timed out after "
                                f"{self.config.kv_load_timeout_s:g} s")
            return False
        self._finished_recving.discard(rid)
        del self.loading[rid]
        bs = self.kv.block_size
        ids = self.kv.block_ids(rid)
        first, last = req.num_computed_tokens // bs, (req.num_computed_tokens + req.num_external_tokens) // bs
        bad = next((i for i in range(first, last) if ids[i] in self._invalid_block_ids), None)
        self._invalid_block_ids.difference_update(ids[first:last])
        if bad is not None:
            self.failed_load_blocks += last - bad
            if self.config.kv_load_failure_policy == "fail":
                self._fail(req, f"loading KV failed for {last - bad} of {last - first} blocks")
                return False
            log.info("%s: %d of %d loaded blocks failed; recomputing from block %d", rid, last - bad, last - first, bad)
            last = bad
        req.num_external_tokens = (last - first) * bs
        req.num_computed_tokens = last * bs
        self.remote_hit_tokens += req.num_external_tokens
        self.kv.cache_computed(req)
        req.status = RequestStatus.WAITING
        return True

    def _fail(self, req: Request, message: str) -> None:
        log.warning("%s: %s", req.request_id, message)
        req.error = message
        self.finish(req, RequestStatus.FINISHED_ERROR)
        self.finished_outside_step.append(req)

    def update_from_connector(self, output: KVConnectorOutput) -> None:
        """The worker side's report: finished loads (and failed blocks), finished sends."""
        if self.connector is not None:
            self.connector.update_connector_output(output)
        self._invalid_block_ids |= output.invalid_block_ids
        for rid in output.finished_recving:
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._finished_recving.add(rid)
            elif rid in self.loading:  # ended while loading: its blocks are free to go now
                del self.loading[rid]
                self._release(rid)
        for rid in output.finished_sending:
            self._release(rid)

    def _release(self, rid: str) -> None:
        self._invalid_block_ids.difference_update(self.kv.block_ids(rid))
        self.kv.free_by_id(rid)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if self.connector is not None:
            out.block_tables = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in out.scheduled}
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    # ---- finalize -------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance computed tokens, append sampled tokens, cache newly full blocks."""
        now = time.monotonic()
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted during the step
                continue
            self.prefill_tokens += max(0, min(req.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens)
                                       - req.num_computed_tokens)
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
            self.kv.cache_computed(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stopped, aborted, failed): free its blocks and forget it."""
        rid = req.request_id
        req.status = status
        req.finish_time = time.monotonic()
        hold = False
        if self.connector is not None:
            hold, _ = self.connector.request_finished(req, self.kv.block_ids(rid))
        if rid in self._finished_recving:  # its load is over but was not picked up yet
            self._finished_recving.discard(rid)
            self.loading.pop(rid, None)
        # The blocks stay while the connector still sends them (freed when `finished_sending`
        # reports the request) or a load in flight still writes into them (freed when it reports).
        if not hold and rid not in self.loading:
            self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
