"""Where a block's KV lies in a host's cache: the worker half reads into and saves out of it.

A pool slot always holds a block as one contiguous payload (all layers, K and V). A host's
cache lays the same bytes out its own way:
- `SlottedCache` (our engine): each block contiguous, in slot strides (room for a slot
  header before each payload, so the engine's cache can be read like a pool slot);
- `LayeredCache` (vLLM on CPU): one tensor per layer; a block's payload is its slice of
  each layer, in layer order (a load copies it there slice by slice, a save gathers it).
"""
from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True, slots=True)
class SlottedCache:
    base: int            # address of block 0's slot
    slot_bytes: int      # stride between blocks
    header_bytes: int    # room before each payload (>= the pool's header: reads land in one range)

    def payload(self, block_id: int) -> int:
        return self.base + block_id * self.slot_bytes + self.header_bytes


@dataclass(frozen=True, slots=True)
class LayeredCache:
    layer_bases: tuple[int, ...]   # address of block 0 in each layer's tensor, layer order
    block_stride: int              # bytes between blocks inside one layer's tensor

    def payload(self, block_id: int) -> tuple[int, ...]:
        off = block_id * self.block_stride
        return tuple(base + off for base in self.layer_bases)


CacheLayout = SlottedCache | LayeredCache
