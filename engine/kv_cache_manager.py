"""Per-request block tables on top of the block pool: prefix hits, allocation, caching, freeing.

Where it sits: scheduler -> KVCacheManager -> BlockPool. Not thread-safe.
"""
from __future__ import annotations

from engine.block_pool import BlockHash, BlockPool, KVBlock, chain_seed, hash_blocks
from engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, fingerprint: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.req_blocks: dict[str, list[KVBlock]] = {}

    # ---- hashes ---------------------------------------------------------------------

    def update_hashes(self, request: Request) -> list[BlockHash]:
        """Extend the request's chained block hashes to all its full blocks."""
        done = len(request.block_hashes)
        tokens = request.all_token_ids
        if len(tokens) // self.block_size > done:
            parent = request.block_hashes[-1] if done else None
            request.block_hashes.extend(hash_blocks(chain_seed(self.fingerprint, request.cache_salt), tokens,
                                                    self.block_size, start=done, parent=parent))
        return request.block_hashes

    # ---- lookups --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request, record: bool = True) -> tuple[list[KVBlock], int]:
        """The longest prefix of the request's full blocks already cached, and its tokens.

        Leaves at least one prompt token to compute (its logits start the output). This
        operation does not take references: `allocate_slots` does. `record=False` leaves the
        hit-rate counters alone (a look that `record_query` may count later).
        """
        hashes = self.update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            b = self.pool.get_cached(h)
            if b is None:
                break
            hit.append(b)
        if record:
            self.record_query(request, len(hit) * self.block_size)
        return hit, len(hit) * self.block_size

    def record_query(self, request: Request, num_cached: int) -> None:
        """Count one prefix-cache lookup of `request` that hit `num_cached` tokens."""
        self.pool.queries += request.num_tokens
        self.pool.hits += num_cached

    # ---- allocation -----------------------------------------------------------------

    def blocks_needed(self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + num_computed_blocks
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - have)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Take the computed blocks (if any) and enough new blocks for `num_new_tokens` more
        tokens after request.num_computed_tokens. None (and no change) if they do not fit."""
        computed_blocks = computed_blocks or []
        # Free cached blocks the request is about to reuse do not count as evictable space.
        reusable_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        need = self.blocks_needed(request, num_new_tokens, len(computed_blocks))
        if need > self.pool.num_free - reusable_free:
            return None
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        new = self.pool.allocate(need)
        blocks.extend(new)
        return new

    def cache_computed(self, request: Request) -> None:
        """Register every full block whose tokens are all computed (call after a step)."""
        hashes = self.update_hashes(request)
        blocks = self.req_blocks.get(request.request_id, [])
        full = min(request.num_computed_tokens // self.block_size, len(hashes), len(blocks))
        for b, h in zip(blocks[:full], hashes[:full]):
            self.pool.cache(b, h)

    def trim(self, request: Request) -> None:
        """Free the request's blocks past those its tokens need (speculative decoding allocated
        room for drafts; the rejected ones' slots are not kept). They were never full of
        computed tokens, so never cached."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-request.num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(extra)

    def free(self, request: Request) -> None:
        self.free_by_id(request.request_id)

    def free_by_id(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)

    def has_blocks(self, request: Request) -> bool:
        return request.request_id in self.req_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
