"""KV block pool with automatic prefix caching (vLLM v1 style).

Blocks are identified by a chained hash of their tokens: h_i = H(h_{i-1}, tokens_i). The
chain starts from a deterministic seed derived from the model/layout fingerprint and the
request's optional cache_salt, so equal prefixes hash alike in every process and on every
machine, and incompatible or foreign KV never matches. Only full blocks are hashed.

Free blocks wait in an LRU queue (a doubly linked list: O(1) pop, remove, append). A freed
request's blocks are appended tail-first, so its last blocks are evicted first; a cached
block stays reusable until it is popped for a new allocation.

Not thread-safe: owned by the scheduler.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NewType

# 32-byte chained SHA-256 of a full block's tokens; the engine's own type (a connector maps it
# to its index's key type), so that a raw `bytes` is never taken for a hash by mistake.
BlockHash = NewType("BlockHash", bytes)


def chain_seed(fingerprint: str, cache_salt: str | None) -> bytes:
    """The hash that precedes block 0: namespaced by layout fingerprint and tenant salt."""
    return hashlib.sha256(b"kvpool/v1\0" + fingerprint.encode() + b"\0" + (cache_salt or "").encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> BlockHash:
    return BlockHash(hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}i", *token_ids)).digest())


def hash_blocks(seed: bytes, token_ids: Sequence[int], block_size: int, start: int = 0,
                parent: bytes | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start` on (parent = hash of block start-1)."""
    out: list[BlockHash] = []
    prev = parent if parent is not None else seed
    for b in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[b * block_size:(b + 1) * block_size])
        out.append(prev)
    return out


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):  # noqa: ANN204 - head to tail, for tests
        b = self._head.next
        while b is not None and b is not self._tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVBlock] = {}
        self.hits = 0      # prefix-cache lookups that matched, in tokens (set by the manager)
        self.queries = 0   # tokens looked up

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Pop `n` free blocks (evicting their cached content). Caller checks num_free first."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue tail-first."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b} freed too often"
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks stay allocated where in use)."""
        n = len(self.cached)
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        return n
