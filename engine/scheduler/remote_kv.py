"""The scheduler's remote-KV phase: requests whose prefix a KV connector loads.

A request the connector has an external hit for gets blocks for those tokens and waits in
WAITING_FOR_REMOTE_KVS (skipped, not blocking the queue) until the worker side reports its
load finished. Then the loaded tokens count as computed, except from the first block that
failed to load on (recomputed; or the request fails under the `fail` policy). A request
still loading when it ends keeps its blocks until its load has reported, so no late write
lands in a block another request owns. Loads hold no running slot and are not preempted.

Sends (P/D): a request whose `kv_transfer_params` ask for a remote decode and whose blocks
the connector holds at its end answers only once the connector reports its send finished
(its KV is where a decode node can read it), with the params reported then; past
`load_timeout_s` it answers without them (a decode node then computes the prompt itself).

Every call the scheduler makes to the connector goes through here (arrival, lookups, the
step's metadata, waiting on lookups), so this is the one seam between them. `clock` is
injectable: timeout tests advance it instead of sleeping.

Not thread-safe: owned by the scheduler, on the engine loop.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.block_pool import KVBlock
    from engine.kv_cache_manager import KVCacheManager
    from engine.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata
    from engine.step import KVConnectorOutput, SchedulerOutput

log = logging.getLogger(__name__)


class LoadState(enum.Enum):
    LOADING = "loading"      # not reported yet: skip the request this step
    DONE = "done"            # loaded (possibly partly): schedule the rest
    FAILED = "failed"        # the request must end with `error`


class RemoteKV:
    """Lookups through the connector and the bookkeeping of loads in flight."""

    def __init__(self, connector: KVConnectorBase_V1, kv: KVCacheManager, failure_policy: str,
                 load_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.connector = connector
        self.clock = clock
        self.kv = kv
        self.failure_policy = failure_policy
        self.load_timeout_s = load_timeout_s
        self._started: dict[str, float] = {}      # request id -> load start, while in flight or unclaimed
        self._reported: set[str] = set()          # loads the worker side reported, not yet claimed
        self._invalid_block_ids: set[int] = set()
        self._sending: dict[str, tuple[Request, float]] = {}  # answers held for their send: id -> (req, since)
        self._sent: list[Request] = []            # sends finished (or given up): to answer now
        self.remote_hit_tokens = 0                # prompt tokens loaded (counter)
        self.failed_load_blocks = 0               # blocks whose load failed (counter)

    def on_new_request(self, req: Request) -> None:
        """A request arrived (its block hashes known): the connector may start its lookup."""
        self.connector.on_new_request(req)

    def build_meta(self, out: SchedulerOutput) -> KVConnectorMetadata:
        """The connector's metadata for the step `out` describes."""
        return self.connector.build_connector_meta(out)

    def wait_for_lookups(self, timeout_s: float) -> None:
        """Nothing to run but lookups in flight: wait on them (up to `timeout_s`), not spin."""
        self.connector.wait_for_lookups(timeout_s)

    @property
    def num_loading(self) -> int:
        """Requests whose load has started and not been claimed by the scheduler yet."""
        return len(self._started)

    def loading_ids(self) -> frozenset[str]:
        """Requests the worker side is still busy with: loads in flight and held sends."""
        return frozenset(self._started) | frozenset(self._sending)

    @property
    def num_sending(self) -> int:
        """Finished requests whose answer waits for their send."""
        return len(self._sending)

    def take_sent(self) -> list[Request]:
        """Requests whose held answer may go out now (send finished or timed out)."""
        now = self.clock()
        for rid, (req, since) in list(self._sending.items()):
            if now - since > self.load_timeout_s:
                log.warning("%s: its KV was not sent within %g s; answering without transfer params", rid,
                            self.load_timeout_s)
                req.kv_transfer_params_out = None
                del self._sending[rid]
                self._sent.append(req)
        sent, self._sent = self._sent, []
        return sent

    def lookup(self, req: Request, record: bool) -> tuple[list[KVBlock], int, int | None]:
        """The local prefix hit (blocks, tokens) and the connector's external hit after it in
        tokens (None: the connector asks to be asked again later). `record` counts the local
        lookup in the hit-rate counters."""
        computed, num_cached = self.kv.get_computed_blocks(req, record=record)
        num_external, _ = self.connector.get_num_new_matched_tokens(req, num_cached)
        return computed, num_cached, num_external

    def start(self, req: Request, computed: list[KVBlock], num_cached: int, num_external: int) -> bool:
        """Allocate blocks for the external tokens and park the request while they load.
        False (and nothing changed) if the blocks do not fit."""
        req.num_computed_tokens = num_cached
        new = self.kv.allocate_slots(req, num_external, computed)
        if new is None:
            req.num_computed_tokens = 0
            return False
        # As vLLM does: the request's whole block table (the connector knows where its hit starts).
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), num_external)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        req.num_external_tokens = num_external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._started[req.request_id] = self.clock()
        return True

    def claim(self, req: Request) -> tuple[LoadState, str]:
        """Where the load of a WAITING_FOR_REMOTE_KVS request stands. On DONE the request is
        WAITING again with the loaded tokens computed (up to the first bad block) and cached;
        on FAILED the second value says why (the caller ends the request)."""
        rid = req.request_id
        if rid not in self._reported:
            if self.clock() - self._started[rid] > self.load_timeout_s:
                return LoadState.FAILED, (f"loading {req.num_external_tokens} tokens of KV timed out after "
                                          f"{self.load_timeout_s:g} s")
            return LoadState.LOADING, ""
        self._reported.discard(rid)
        del self._started[rid]
        bs = self.kv.block_size
        ids = self.kv.block_ids(rid)
        # The load wrote blocks first..last-1; the last one may be a hand-off's tail, whose
        # tokens after the loaded ones are computed next (connector.handoff).
        end = req.num_computed_tokens + req.num_external_tokens
        first, last = req.num_computed_tokens // bs, -(-end // bs)
        bad = next((i for i in range(first, last) if ids[i] in self._invalid_block_ids), None)
        self._invalid_block_ids.difference_update(ids[first:last])
        if bad is not None:
            self.failed_load_blocks += last - bad
            if self.failure_policy == "fail":
                return LoadState.FAILED, f"loading KV failed for {last - bad} of {last - first} blocks"
            log.info("%s: %d of %d loaded blocks failed; recomputing from block %d", rid, last - bad, last - first, bad)
            end = bad * bs
        req.num_external_tokens = end - first * bs
        if req.num_preemptions == 0:
            req.num_prompt_external_tokens = req.num_external_tokens
        req.num_computed_tokens = end
        self.remote_hit_tokens += req.num_external_tokens
        self.kv.cache_computed(req)
        req.status = RequestStatus.WAITING
        return LoadState.DONE, ""

    def report(self, output: KVConnectorOutput, requests: dict[str, Request]) -> None:
        """The worker side's report: finished loads (and failed blocks), finished sends."""
        self.connector.update_connector_output(output)
        self._invalid_block_ids |= output.invalid_block_ids
        for rid in output.finished_recving:
            req = requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._reported.add(rid)
            elif rid in self._started:  # ended while loading: its blocks are free to go now
                del self._started[rid]
                self._release(rid)
        for rid in output.finished_sending:
            self._release(rid)
            held = self._sending.pop(rid, None)
            if held is not None:
                req = held[0]
                req.kv_transfer_params_out = output.kv_transfer_params.get(rid, req.kv_transfer_params_out)
                self._sent.append(req)

    def on_finish(self, req: Request) -> bool:
        """The request ended: tell the connector; True if its blocks must stay (the connector
        still sends them, or a load in flight still writes into them). A request handed to a
        remote decode whose blocks are held is answered later (`is_sending`, `take_sent`)."""
        rid = req.request_id
        hold, params = self.connector.request_finished(req, self.kv.block_ids(rid))
        req.kv_transfer_params_out = params
        if hold and req.status is not RequestStatus.FINISHED_ABORTED and (req.kv_transfer_params or {}).get(
                "do_remote_decode"):
            self._sending[rid] = (req, self.clock())
        if rid in self._reported:  # its load is over but was not claimed yet
            self._reported.discard(rid)
            self._started.pop(rid, None)
        return hold or rid in self._started

    def is_sending(self, rid: str) -> bool:
        return rid in self._sending

    def _release(self, rid: str) -> None:
        self._invalid_block_ids.difference_update(self.kv.block_ids(rid))
        self.kv.free_by_id(rid)
