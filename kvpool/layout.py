"""Slot layout of the node pool, sizes, and raw-memory helpers.

A slot is one whole KV block (all layers, K and V) behind a 64-byte header:

    offset 0   magic      u32   0x4C50564B ("KVPL"); 0 while the slot is being written
           4   version    u16
           6   flags      u16
           8   generation u64   bumped on every write of the slot
          16   payload    u64   payload bytes that follow the header
          24   checksum   u64   xxh3-64 of the payload
          32   hash       32 B  the block's chained prefix hash
    offset 64  payload

A reader fetches header and payload in one batch and accepts the block only if magic,
hash, generation and checksum all match what the index promised: a slot that was evicted
or overwritten during the read fails one of them.
"""
from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = 0x4C50564B
VERSION = 1
HEADER = struct.Struct("<IHHQQQ32s")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 64
SLOT_ALIGN = 64

# Where a block's payload is in the caller's memory: one address (contiguous), or the
# addresses of equal segments in order (a cache laid out per layer, as vLLM's on CPU).
Payload = int | Sequence[int]


@dataclass(frozen=True, slots=True)
class SlotHeader:
    magic: int
    generation: int
    payload_bytes: int
    checksum: int
    block_hash: bytes

    def pack(self) -> bytes:
        return HEADER.pack(self.magic, VERSION, 0, self.generation, self.payload_bytes, self.checksum,
                           self.block_hash.ljust(32, b"\0"))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SlotHeader:
        magic, _version, _flags, gen, n, checksum, h = HEADER.unpack(raw)
        return cls(magic, gen, n, checksum, h)


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes of one slot holding a `block_bytes` payload (header included, 64-aligned)."""
    return (HEADER_BYTES + block_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of raw memory (the caller keeps the memory alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def checksum(addr: int, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(view(addr, nbytes))


def checksum_of(payload: Payload, nbytes: int) -> int:
    """The checksum of a payload of `nbytes` at one address, or split in equal segments at
    several (in order): the same value as for the bytes back to back."""
    if isinstance(payload, int):
        return checksum(payload, nbytes)
    h = xxhash.xxh3_64()
    seg = nbytes // len(payload)
    for addr in payload:
        h.update(view(addr, seg))
    return h.intdigest()


def valid_block(header_addr: int, payload: Payload, nbytes: int, block_hash: bytes, generation: int) -> bool:
    """A slot header read to `header_addr` and its payload read to `payload` (one address, or
    equal segments at several) are the block the index promised: magic, hash, generation and
    size match, and the payload's checksum matches the header's (a slot overwritten or evicted
    during the read fails one of them)."""
    magic, _version, _flags, gen, size, digest, h = HEADER.unpack(ctypes.string_at(header_addr, HEADER_BYTES))
    return (magic == MAGIC and h == block_hash and gen == generation and size == nbytes
            and checksum_of(payload, nbytes) == digest)


def memcpy(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def segments_of(payload: Payload, nbytes: int) -> list[tuple[int, int, int]]:
    """(address, offset in the payload, bytes) of each segment of a payload."""
    if isinstance(payload, int):
        return [(payload, 0, nbytes)]
    seg = nbytes // len(payload)
    return [(addr, k * seg, seg) for k, addr in enumerate(payload)]


class CallerMemory:
    """How the pool reaches its caller's memory: the destinations of reads and the sources of
    puts. The pool's own memory (slots, landing slots, disk buffers) is always host memory; a
    caller's may not be (a KV cache on a GPU: `connector.device_memory`), so every copy across
    that boundary goes through one of these two calls. This one is host memory (memcpy).

    Contract of both: the copy is complete when the call returns (the pool reuses or validates
    its side right after), and `payload` is one address or equal segments in order."""

    def write(self, dest: Payload, src: int, nbytes: int) -> None:
        """Copy `nbytes` of host memory at `src` to the caller's `dest`."""
        for addr, offset, length in segments_of(dest, nbytes):
            memcpy(addr, src + offset, length)

    def read(self, dst: int, src: Payload, nbytes: int) -> None:
        """Copy `nbytes` of the caller's `src` to host memory at `dst`."""
        for addr, offset, length in segments_of(src, nbytes):
            memcpy(dst + offset, addr, length)


HOST_MEMORY = CallerMemory()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.I)


def parse_size(text: str | int) -> int:
    """'4GiB', '512MiB', '1.5G', '4096' -> bytes (K/M/G/T are powers of 1024 with or without i)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4GiB, 512MiB or a number of bytes")
    value, unit = float(m.group(1)), m.group(2).upper()
    return int(value * 1024 ** " KMGT".index(unit or " "))
