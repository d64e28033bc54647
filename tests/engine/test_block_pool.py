"""Block pool invariants: free-queue order, reference counts, cached-block eviction, hashing."""
from __future__ import annotations

import tracemalloc
from collections import deque

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, chain_seed, hash_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_is_o1_linked_list() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and q.num_free == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2] and q.num_free == 4


def test_freed_request_blocks_are_queued_tail_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.num_free == 3
    pool.free(a)
    # The request's last block is evicted first, its first block last.
    assert ids(pool.free_queue) == [3, 4, 5, 2, 1, 0]


def test_ref_counts_and_shared_blocks() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.touch(a)  # a second request shares both blocks
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free(a)
    assert pool.num_free == 2  # still held by the other request
    pool.free(a)
    assert pool.num_free == 4


def test_cached_blocks_are_reused_until_evicted() -> None:
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    h = hash_blocks(chain_seed("fp", None), list(range(16)), 16)[0]
    pool.cache(b, h)
    pool.free([b])
    assert pool.get_cached(h) is b and b.ref_cnt == 0  # free but still cached
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free == 2
    pool.free([b])
    others = pool.allocate(2)  # the two never-cached blocks go first (LRU: b was freed last)
    assert b not in others and pool.get_cached(h) is b
    [again] = pool.allocate(1)
    assert again is b and pool.get_cached(h) is None and b.block_hash is None


def test_hashes_are_deterministic_chained_and_namespaced() -> None:
    toks = list(range(40))
    seed = chain_seed("model|fp32|bs16", None)
    h = hash_blocks(seed, toks, 16)
    assert len(h) == 2  # only full blocks
    assert h == hash_blocks(chain_seed("model|fp32|bs16", None), toks, 16)
    assert h[0].hex() == hash_blocks(seed, toks[:16], 16)[0].hex()
    assert hash_blocks(seed, [99] + toks[1:], 16)[1] != h[1]  # a change in block 0 changes block 1
    assert hash_blocks(chain_seed("model|fp32|bs16", "tenant-a"), toks, 16)[0] != h[0]
    assert hash_blocks(chain_seed("model|bf16|bs16", None), toks, 16)[0] != h[0]
    assert hash_blocks(seed, toks, 16, start=1, parent=h[0]) == h[1:]


def test_manager_prefix_hit_leaves_one_token_to_compute() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, "fp")
    r1 = Request("r1", list(range(8)), SamplingParams())
    assert kv.allocate_slots(r1, 8) is not None
    r1.num_computed_tokens = 8
    kv.cache_computed(r1)
    kv.free(r1)
    r2 = Request("r2", list(range(8)), SamplingParams())
    blocks, n = kv.get_computed_blocks(r2)
    assert n == 4 and len(blocks) == 1  # a full hit still recomputes the last block's token
    r3 = Request("r3", list(range(8)) + [5], SamplingParams())
    blocks, n = kv.get_computed_blocks(r3)
    assert n == 8
    r4 = Request("r4", list(range(8)), SamplingParams(), cache_salt="other")
    assert kv.get_computed_blocks(r4)[1] == 0
    r3.num_computed_tokens = 8
    assert kv.allocate_slots(r3, 1, blocks) is not None
    assert [b.ref_cnt for b in kv.req_blocks["r3"]] == [1, 1, 1]
    assert kv.allocate_slots(Request("big", list(range(40)), SamplingParams()), 40) is None  # does not fit


def _held_items(*objs: object) -> int:
    """Items held in the containers that are attributes of `objs` (what a leak grows)."""
    total = 0
    for o in objs:
        for v in vars(o).values():
            if isinstance(v, (list, dict, set, deque)):
                total += len(v)
    return total


def test_many_thousands_of_evictions_grow_nothing() -> None:
    """Requests with distinct prompts fill, cache and free blocks in a small pool, so every
    allocation evicts cached blocks: nothing the pool or the manager holds may grow with the
    number of evictions (the pool used to keep every evicted hash in a list no one drained)."""
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, "fp")

    def churn(first: int, n: int) -> list[bytes]:
        hashes = []
        for i in range(first, first + n):
            r = Request(f"r{i}", [i * 8 + t for t in range(8)], SamplingParams())  # two full blocks, unique
            assert kv.allocate_slots(r, 8) is not None
            r.num_computed_tokens = 8
            kv.cache_computed(r)
            hashes.extend(r.block_hashes)
            kv.free(r)
        return hashes

    first = churn(0, 1_000)
    held = _held_items(pool, kv, pool.free_queue)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        churn(1_000, 10_000)                      # 20,000 more evictions
        growth = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename")
                     if s.traceback[0].filename.endswith(("block_pool.py", "kv_cache_manager.py")))
    finally:
        tracemalloc.stop()
    assert all(pool.get_cached(h) is None for h in first)  # evicted, not merely freed
    assert len(pool.cached) <= pool.num_blocks
    assert _held_items(pool, kv, pool.free_queue) == held
    assert growth < 16_384, f"{growth} bytes more held by the block pool after 20,000 evictions"
