"""Test hooks into the node pool's internals (kept out of the production classes)."""
from __future__ import annotations

import numpy as np

from kvpool.layout import HEADER_BYTES, MAGIC, SlotHeader, checksum, view
from kvpool.pool import NodePool
from kvpool.reader import Peers
from metaserver.types import BlockHash


def put_bytes(pool: NodePool, block_hash: bytes, data: bytes | bytearray | memoryview | np.ndarray) -> bool:
    """`NodePool.put` from a Python buffer."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    return pool.put(block_hash, arr.ctypes.data, arr.nbytes)


def overwrite(pool: NodePool, block_hash: bytes, data: bytes) -> None:
    """Rewrite the slot holding `block_hash` in place with a new generation: the eviction race
    a remote reader must detect."""
    with pool._lock:
        slot = pool._lru[BlockHash(block_hash)]
        slot.generation += 1
        base = pool._slot_addr(slot)
        view(base + HEADER_BYTES, len(data))[:] = data
        view(base, HEADER_BYTES)[:] = SlotHeader(MAGIC, slot.generation, len(data),
                                                 checksum(base + HEADER_BYTES, len(data)), slot.block_hash).pack()


def lru_order(pool: NodePool) -> list[BlockHash]:
    """Held blocks, least recently used first."""
    with pool._lock:
        return list(pool._lru)


def contacting(peers: Peers, session: str) -> bool:
    """A first contact with `session` is under way (neither made nor failed yet)."""
    return session in peers._pending
