"""The save policy (connector.save_policy): which computed blocks a node saves into the pool,
through the scheduler half's plan_save and from kv_connector_extra_config."""
from __future__ import annotations

import pytest

from connector.pool_scheduler import PoolScheduler
from connector.save_policy import SavePolicy
from connector.settings import PoolConnectorSettings
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_write_through_saves_every_block() -> None:
    p = SavePolicy("write_through", 4)
    assert p.select([h(1), h(2), h(3)]) == [0, 1, 2]
    assert p.select([h(1), h(2), h(3)]) == [0, 1, 2] and p.skipped == 0


def test_selective_saves_from_the_second_computation() -> None:
    p = SavePolicy("selective", 100)
    assert p.select([h(1), h(2), h(3)]) == []          # first time: nothing
    assert p.select([h(1), h(2), h(4)]) == [0, 1]      # 1 and 2 again; 4 is new
    assert p.select([h(4), h(3), h(5)]) == [0, 1]
    assert p.skipped == 3 + 1 + 1


def test_selective_forgets_the_oldest_beyond_its_capacity() -> None:
    p = SavePolicy("selective", 2)
    p.select([h(1), h(2)])
    p.select([h(1)])                      # 1 is now the most recent
    p.select([h(3)])                      # pushes out 2, the oldest
    assert p.select([h(2)]) == [] and p.select([h(1)]) == []  # 2 forgotten; 1 pushed out by 2 just now
    assert p.select([h(2)]) == [0]


def test_bad_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="save_policy must be one of write_through, selective, got 'sometimes'"):
        SavePolicy("sometimes", 10)
    extra = {"metaserver": "127.0.0.1:1", "save_policy": "lru"}
    with pytest.raises(ValueError, match="kv_connector_extra_config: save_policy must be one of"):
        PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)
    extra = {"metaserver": "127.0.0.1:1", "save_seen_blocks": 0}
    with pytest.raises(ValueError, match="save_seen_blocks and save_queue_blocks must be >= 1"):
        PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)


@pytest.mark.parametrize("policy", ["write_through", "selective"])
def test_plan_save_follows_the_policy(metaserver: MetaserverProcess, policy: str) -> None:
    """Two requests compute the same 3 full blocks (cache blocks 10-12, then 20-22) and one
    block of their own each: write_through saves all 8; selective only the repeated 3, from
    the second request's cache blocks. The step's writes are fenced either way."""
    extra = {"metaserver": metaserver.address, "save_policy": policy}
    settings = PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)
    sched = PoolScheduler(settings, "fp", 16, consume=False, produce=True, client=MetaClient(metaserver.address))
    try:
        sched.plan_save("r1", 0, 64, [10, 11, 12, 13], [h(1), h(2), h(3), h(4)])
        sched.plan_save("r2", 0, 64, [20, 21, 22, 23], [h(1), h(2), h(3), h(5)])
        meta = sched.build_meta()
        saved = [(b, hh) for s in meta.saves for b, hh in zip(s.block_ids, s.block_hashes, strict=True)]
        if policy == "write_through":
            assert [b for b, _ in saved] == [10, 11, 12, 13, 20, 21, 22, 23]
            assert sched.counters()["connector_saves_skipped"] == 0
        else:
            assert saved == [(20, h(1)), (21, h(2)), (22, h(3))]
            assert sched.counters()["connector_saves_skipped"] == 5
        assert meta.writes == [10, 11, 12, 13, 20, 21, 22, 23]
    finally:
        sched.close()


def test_a_block_filled_by_accepted_drafts_is_saved_at_the_next_step(metaserver: MetaserverProcess) -> None:
    """Speculative decoding: a step computes tokens 30..34 (the last real one and 4 drafts); the
    drafts fill block 1 (tokens 16..31) but its hash is not known when the step is planned. The
    drafts are accepted; the next step (from token 35) saves block 1, and only once."""
    extra = {"metaserver": metaserver.address}
    settings = PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)
    sched = PoolScheduler(settings, "fp", 16, consume=False, produce=True, client=MetaClient(metaserver.address))
    try:
        sched.plan_save("r", 0, 30, [10, 11, 12], [h(1)])          # prefill: block 0 full
        assert [s.block_ids for s in sched.build_meta().saves] == [(10,)]
        sched.plan_save("r", 30, 5, [10, 11, 12], [h(1)])          # 30..34: block 1 has no hash yet
        assert sched.build_meta().saves == []
        sched.plan_save("r", 35, 1, [10, 11, 12], [h(1), h(2)])    # accepted: block 1 now known
        assert [s.block_ids for s in sched.build_meta().saves] == [(11,)]
        sched.plan_save("r", 36, 1, [10, 11, 12], [h(1), h(2)])
        assert sched.build_meta().saves == []
    finally:
        sched.close()
