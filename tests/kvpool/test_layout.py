"""Slot layout: a block read into memory is accepted only if every field of its header and
the payload's checksum match what the index promised."""
from __future__ import annotations

import numpy as np
import pytest

from kvpool.layout import HEADER_BYTES, MAGIC, SlotHeader, checksum, valid_block

PAYLOAD = 4096
HASH = b"\x07" * 32
GEN = 9


@pytest.fixture
def slot() -> np.ndarray:
    """Header + payload as a read leaves them in memory, for block HASH at generation GEN."""
    mem = np.zeros(HEADER_BYTES + PAYLOAD, dtype=np.uint8)
    mem[HEADER_BYTES:] = np.random.default_rng(3).integers(0, 255, PAYLOAD, dtype=np.uint8)
    digest = checksum(mem.ctypes.data + HEADER_BYTES, PAYLOAD)
    mem[:HEADER_BYTES] = np.frombuffer(SlotHeader(MAGIC, GEN, PAYLOAD, digest, HASH).pack(), dtype=np.uint8)
    return mem


def _valid(mem: np.ndarray, block_hash: bytes = HASH, generation: int = GEN, nbytes: int = PAYLOAD) -> bool:
    return valid_block(mem.ctypes.data, mem.ctypes.data + HEADER_BYTES, nbytes, block_hash, generation)


def test_the_promised_block_is_valid(slot: np.ndarray) -> None:
    assert _valid(slot)


def test_another_hash_generation_or_size_than_promised_is_not(slot: np.ndarray) -> None:
    assert not _valid(slot, block_hash=b"\x08" * 32)  # the slot now holds another block
    assert not _valid(slot, generation=GEN + 1)       # the slot was rewritten since the index was told
    assert not _valid(slot, nbytes=PAYLOAD - 64)      # a payload of another size


def test_a_slot_being_written_is_not(slot: np.ndarray) -> None:
    slot[:4] = 0  # the writer clears the magic before it rewrites a slot
    assert not _valid(slot)


def test_one_changed_payload_byte_is_caught_by_the_checksum(slot: np.ndarray) -> None:
    slot[HEADER_BYTES + PAYLOAD - 1] ^= 1  # torn read: the last byte came from the next block
    assert not _valid(slot)
    slot[HEADER_BYTES + PAYLOAD - 1] ^= 1
    assert _valid(slot)
