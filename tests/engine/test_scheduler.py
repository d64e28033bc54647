"""Scheduler token budgets without a model: chunked prefill and vLLM's long-prefill threshold."""
from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig

BS = 16


def make(budget: int, threshold: int = 0, chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(BlockPool(64), BS, "fp")
    return Scheduler(SchedulerConfig(budget, 8, chunked, long_prefill_token_threshold=threshold), kv)


def req(rid: str, n: int, base: int) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=4))


def step(sched: Scheduler) -> dict[str, int]:
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({s.request.request_id: [(7, None)] for s in out.scheduled if s.samples}))
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_without_threshold_a_long_prompt_takes_the_whole_budget() -> None:
    sched = make(64)
    sched.add_request(req("long", 200, 0))
    sched.add_request(req("short", 10, 1000))
    assert step(sched) == {"long": 64}
    assert step(sched) == {"long": 64}


def test_threshold_caps_each_prefill_and_lets_short_requests_in() -> None:
    sched = make(64, threshold=24)
    sched.add_request(req("long", 200, 0))
    sched.add_request(req("short", 10, 1000))
    assert step(sched) == {"long": 24, "short": 10}
    assert step(sched) == {"short": 1, "long": 24}     # the decode first, the running prefill capped again
    sched.add_request(req("mid", 30, 2000))
    assert step(sched) == {"short": 1, "long": 24, "mid": 24}
    assert step(sched) == {"short": 1, "long": 24, "mid": 6}


def test_threshold_needs_chunked_prefill_and_is_checked() -> None:
    sched = make(256, threshold=24, chunked=False)
    sched.add_request(req("long", 200, 0))
    assert step(sched) == {"long": 200}
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(64, 8, long_prefill_token_threshold=-1)
