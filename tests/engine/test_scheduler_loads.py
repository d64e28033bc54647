"""The scheduler's side of the connector contract, with a scripted connector (no model, no pool).

What is faked: the connector, which only reports what a real one would. What is real: the
scheduler, the KV cache manager and the block pool whose bookkeeping these tests check.
"""
from __future__ import annotations


import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector.base import (EngineContext, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorOutput,
                                      KVConnectorRole)
from engine.kv_connector.config import KVTransferConfig
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput

BS = 4


class ScriptedConnector(KVConnectorBase_V1):
    """Offers `offer[request_id]` external tokens; records what the scheduler told it."""

    def __init__(self) -> None:
        super().__init__(KVTransferConfig("scripted"), EngineContext("fp", BS, 1, 1, 0), KVConnectorRole.SCHEDULER)
        self.offer: dict[str, int | None] = {}
        self.allocated: dict[str, list[int]] = {}
        self.calls = 0
        self.asked: list[str] = []   # request ids, one per call
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        self.calls += 1
        self.asked.append(request.request_id)
        n = self.offer.get(request.request_id, 0)
        return n, bool(n)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        self.allocated[request.request_id] = list(blocks)

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        self.finished.append(request.request_id)
        return False, None

    def start_load_kv(self, forward_context, **kwargs): ...  # noqa: ANN001, ANN003, ANN201
    def wait_for_layer_load(self, layer_name): ...  # noqa: ANN001, ANN201
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...  # noqa: ANN001, ANN003, ANN201
    def wait_for_save(self): ...  # noqa: ANN201


def make(num_blocks: int = 64, policy: str = "recompute", timeout_s: float = 30.0, wait_s: float = 0.0,
         max_seqs: int = 8):  # noqa: ANN201
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, BS, "fp")
    conn = ScriptedConnector()
    sched = Scheduler(SchedulerConfig(64, max_seqs, kv_load_failure_policy=policy, kv_load_timeout_s=timeout_s,
                                      kv_load_wait_s=wait_s), kv, conn)
    return sched, conn, pool


def req(rid: str, n: int, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=4))


def finish_step(sched: Scheduler, out: SchedulerOutput, sampled_token: int = 7,
                report: KVConnectorOutput | None = None) -> list[RequestOutput]:
    """What the runner would report for `out`: a token for each request that samples, and
    the connector's `report` (default: nothing finished)."""
    sampled = {s.request.request_id: [(sampled_token, None)] for s in out.scheduled if s.samples}
    return sched.update_from_output(out, ModelRunnerOutput(sampled, report or KVConnectorOutput()))


def step(sched: Scheduler, sampled_token: int = 7, report: KVConnectorOutput | None = None):  # noqa: ANN201
    out = sched.schedule()
    finish_step(sched, out, sampled_token, report)
    return out


def parked(sched: Scheduler, conn: ScriptedConnector, rid: str, n: int = 21, external: int = 16,
           base: int = 0) -> Request:
    """Add a request the connector has `external` tokens for, and step once: it is loading."""
    r = req(rid, n, base)
    conn.offer[rid] = external
    sched.add_request(r)
    step(sched)
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    return r


def test_request_waits_for_its_load_while_others_run() -> None:
    sched, conn, pool = make()
    a, b = req("a", 21), req("b", 10, base=1000)
    conn.offer["a"] = 16
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["b"]
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(conn.allocated["a"]) == 4 and a.num_computed_tokens == 0
    out = step(sched)  # still loading: b decodes, a stays parked
    assert [s.request.request_id for s in out.scheduled] == ["b"]
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, report=KVConnectorOutput(finished_recving={"a"}))
    out = step(sched)
    sa = next(s for s in out.scheduled if s.request.request_id == "a")
    assert sa.num_new_tokens == 21 - 16  # only the rest is prefilled
    assert a.num_external_tokens == 16 and sched.remote_hit_tokens == 16
    assert sched.prefill_tokens == 10 + 5
    # the loaded blocks are now in the local prefix cache
    assert all(pool.blocks[i].block_hash is not None for i in conn.allocated["a"])


def test_failed_block_and_everything_after_it_are_recomputed() -> None:
    sched, conn, _ = make()
    a = parked(sched, conn, "a")
    blocks = conn.allocated["a"]
    step(sched, report=KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={blocks[2]}))
    out = step(sched)
    assert out.scheduled[0].num_new_tokens == 21 - 8
    assert a.num_external_tokens == 8 and sched.failed_load_blocks == 2


def test_fail_policy_ends_the_request_with_an_error() -> None:
    sched, conn, pool = make(policy="fail")
    a = parked(sched, conn, "a")
    step(sched, report=KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={conn.allocated["a"][0]}))
    outputs = finish_step(sched, sched.schedule())
    assert a.status is RequestStatus.FINISHED_ERROR and "loading KV failed" in (a.error or "")
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]  # reported, though never run
    assert pool.num_free == pool.num_blocks and not sched.has_unfinished()


def test_abort_while_loading_frees_blocks_only_when_the_load_reports() -> None:
    sched, conn, pool = make()
    a = parked(sched, conn, "a")
    held = pool.num_blocks - pool.num_free
    assert held == 4
    sched.abort_request("a")
    assert a.status is RequestStatus.FINISHED_ABORTED and conn.finished == ["a"]
    assert pool.num_free == pool.num_blocks - 4, "a load in flight still writes into these blocks"
    step(sched, report=KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={conn.allocated["a"][1]}))
    assert pool.num_free == pool.num_blocks and not sched.has_unfinished()
    # the failed id of the aborted load does not taint the block's next owner
    b = parked(sched, conn, "b", base=500)
    step(sched, report=KVConnectorOutput(finished_recving={"b"}))
    step(sched)
    assert b.num_external_tokens == 16


def test_abort_after_the_load_reported_frees_at_once() -> None:
    sched, conn, pool = make()
    a = parked(sched, conn, "a")
    finish_step(sched, SchedulerOutput(), report=KVConnectorOutput(finished_recving={"a"}))
    assert sched.abort_request("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert pool.num_free == pool.num_blocks and not sched.has_unfinished()


def test_a_load_that_never_reports_times_out() -> None:
    """The remote-KV phase's clock is advanced past the timeout (no sleep a slow machine outlives)."""
    sched, conn, pool = make(timeout_s=30.0)
    now = [1000.0]
    sched.remote.clock = lambda: now[0]
    a = parked(sched, conn, "a")
    step(sched)
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS    # 0 s of 30: still loading
    now[0] += 30.5
    step(sched)
    assert a.status is RequestStatus.FINISHED_ERROR and "timed out" in (a.error or "")
    assert pool.num_free == pool.num_blocks - 4  # the transfer may still land: held until reported
    step(sched, report=KVConnectorOutput(finished_recving={"a"}))
    assert pool.num_free == pool.num_blocks and not sched.has_unfinished()


def test_none_means_ask_again_later() -> None:
    sched, conn, _ = make()
    a, b = req("a", 9), req("b", 9, base=100)
    conn.offer["a"] = None
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["b"] and a.status is RequestStatus.WAITING
    conn.offer["a"] = 0
    out = step(sched)
    assert "a" in [s.request.request_id for s in out.scheduled]


def test_no_blocks_for_the_load_keeps_the_request_waiting_unchanged() -> None:
    sched, conn, pool = make(num_blocks=4)
    a = req("a", 30)
    conn.offer["a"] = 28  # 7 blocks, the cache has 4
    sched.add_request(a)
    out = step(sched)
    assert not out.scheduled and a.status is RequestStatus.WAITING and a.num_computed_tokens == 0
    assert pool.num_free == 4 and not conn.allocated


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ('{"kv_connector": "mooncake", "kv_role": "kv_sideways"}', "kv_role must be one of"),
    ('{"kv_connector": "mooncake", "kv_load_failure_policy": "ignore"}', "kv_load_failure_policy"),
    ('{"kv_connector": "mooncake", "colour": 1}', "unknown keys ['colour']"),
    ('{"kv_role": "kv_both"}', "kv_connector is required"),
    ('{"kv_connector": "mooncake", "kv_load_wait_s": -1}', "kv_load_wait_s must be in [0, 10], got -1"),
    ('{"kv_connector": "mooncake", "kv_load_wait_s": 60}', "kv_load_wait_s must be in [0, 10], got 60"),
])
def test_kv_transfer_config_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVTransferConfig.from_json(text)


def test_kv_transfer_config_roles() -> None:
    c = KVTransferConfig.from_json('{"kv_connector": "mooncake", "kv_role": "kv_consumer"}')
    assert c.is_consumer and not c.is_producer
    assert KVTransferConfig("mooncake", kv_role="kv_producer").is_producer


def test_unknown_connector_name() -> None:
    from engine.kv_connector import factory

    with pytest.raises(ValueError, match="unknown KV connector 'lmcache'; known: MooncakeConnector, mooncake"):
        factory.create(KVTransferConfig("lmcache"), EngineContext("fp", BS, 1, 1, 0), KVConnectorRole.WORKER)


# ---- load-ahead steps (kv_load_wait_s > 0) ---------------------------------------------

def test_load_ahead_step_starts_the_load_and_its_request_joins_the_next_batch() -> None:
    sched, conn, pool = make(wait_s=0.05)
    running = req("r", 9, base=500)
    sched.add_request(running)
    step(sched)                                  # r prefilled; it decodes from now on
    r = req("a", 21)
    conn.offer["a"] = 16
    sched.add_request(r)
    out = sched.schedule()                       # a load-ahead step: the load only, nothing computed
    assert not out.scheduled and out.loads_to_wait == {"a"} and out.load_wait_s == 0.05
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and conn.allocated["a"]
    finish_step(sched, out, report=KVConnectorOutput(set(), {"a"}, set()))   # the load landed in the wait
    out = step(sched)
    scheduled = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert scheduled == {"r": 1, "a": 21 - 16}   # the very next batch: only the 5 tokens after the load
    assert r.num_cached_tokens == 0 and sched.remote_hit_tokens == 16
    assert conn.asked.count("a") == 1            # asked once, when its load started: phase 2 did not ask again


def test_load_not_reported_in_time_leaves_its_request_loading_and_others_run() -> None:
    sched, conn, pool = make(wait_s=0.05)
    r = req("a", 21)
    conn.offer["a"] = 16
    sched.add_request(r)
    other = req("b", 9, base=300)
    sched.add_request(other)
    out = step(sched)                            # b has no external hit: not started, left to phase 2
    assert out.loads_to_wait == {"a"} and not out.scheduled
    out = step(sched)                            # nothing new to start: a normal step, a still loading
    assert [s.request.request_id for s in out.scheduled] == ["b"]
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and conn.asked.count("a") == 1
    step(sched, report=KVConnectorOutput(set(), {"a"}, set()))
    out = step(sched)
    assert "a" in {s.request.request_id for s in out.scheduled}


def test_idle_step_with_loads_in_flight_asks_the_runner_to_wait_on_them() -> None:
    sched, conn, pool = make()                   # no load-ahead: loads start in phase 2
    parked(sched, conn, "a")
    out = sched.schedule()
    assert not out.scheduled and out.loads_to_wait == {"a"} and 0 < out.load_wait_s <= 0.01


def test_load_ahead_counts_each_lookup_once_and_respects_the_seat_limit() -> None:
    sched, conn, pool = make(wait_s=0.05, max_seqs=1)
    for i in range(3):
        conn.offer[f"q{i}"] = 8
        sched.add_request(req(f"q{i}", 13, base=100 * i))
    out = step(sched)
    assert out.loads_to_wait == {"q0"}           # one seat: only the request the batch admits next
    assert sched.kv.pool.queries == 13           # counted once, when the load started
    out = step(sched)                            # q0 is not started twice: no load-ahead step
    assert out.load_wait_s < 0.05                # (phase 2 parks q1 and q2: loads hold no seat)
    assert sched.kv.pool.queries == 3 * 13       # q0 still counted once


def test_finished_requests_are_told_to_the_runner_once() -> None:
    sched, conn, pool = make()
    a = req("a", 5)
    sched.add_request(a)
    step(sched)
    sched.abort_request("a")
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == frozenset()


def test_a_reload_after_preemption_is_not_reported_as_a_prompt_hit() -> None:
    """The answer reports the prompt tokens loaded at the first admission; a preempted
    request that reloads its blocks (its generated tokens' too) loads more but reports the same."""
    sched, conn, _ = make()
    a = parked(sched, conn, "a", n=21, external=16)
    step(sched, report=KVConnectorOutput(finished_recving={"a"}))
    step(sched)
    assert a.num_prompt_external_tokens == 16 and a.status is RequestStatus.RUNNING
    sched._preempt(a, SchedulerOutput())
    conn.offer["a"] = 20                       # its prompt and a generated token, from the pool
    step(sched)
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(sched, report=KVConnectorOutput(finished_recving={"a"}))
    outputs = finish_step(sched, sched.schedule())
    assert a.num_external_tokens == 20 and a.num_prompt_external_tokens == 16
    assert [o.num_external_tokens for o in outputs if o.request_id == "a"] == [16]
