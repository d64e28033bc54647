"""The paged KV cache in a block-contiguous layout that the node pool can move whole.

One block = all layers' K and V for `block_size` tokens, contiguous:
    payload[layer][k=0|v=1][token][kv_head][head_dim]
Blocks sit in slot strides: each payload is preceded by `header_bytes` of room that the KV
connector declares (`KVConnectorBase_V1.cache_header_bytes`; 0 without one), so a block read
from a pool that stores a header before each payload lands in place with one transfer and
its header is checked where it landed. Slots are 64-byte aligned (a cache line), the
alignment a pool's slots use too, so runs of cache blocks and runs of pool slots have the
same stride. The whole cache is one uint8 buffer a connector can register.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import hugepages

SLOT_ALIGN = 64


def slot_bytes_for(block_bytes: int, header_bytes: int) -> int:
    """Stride of one cache block: header room + payload, rounded up to SLOT_ALIGN."""
    return (header_bytes + block_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


@dataclass(frozen=True)
class CacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int          # tokens per block
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (all layers, K and V)."""
        elem = torch.finfo(self.dtype).bits // 8
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    def __init__(self, layout: CacheLayout, num_blocks: int, header_bytes: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if header_bytes < 0 or header_bytes % SLOT_ALIGN:
            raise ValueError(f"header_bytes must be a non-negative multiple of {SLOT_ALIGN}, got {header_bytes}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.header_bytes = header_bytes
        self.slot_bytes = slot_bytes_for(layout.block_bytes, header_bytes)
        if torch.device(device).type == "cpu":
            # huge pages: a decode step reads blocks scattered over the whole cache (engine/hugepages.py)
            self.raw = hugepages.empty((num_blocks, self.slot_bytes), torch.uint8).zero_()
        else:
            self.raw = torch.zeros((num_blocks, self.slot_bytes), dtype=torch.uint8, device=device)
        payload = self.raw[:, header_bytes:header_bytes + layout.block_bytes].view(layout.dtype)
        # [block, layer, k/v, token, kv_head, head_dim]
        self.blocks = payload.view(num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                                   layout.head_dim)
        self._workspace: torch.Tensor | None = None  # gather_blocks' output, reused across calls

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def write(self, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store new tokens' K and V ([n, kv_heads, head_dim]) at (block, offset) slots."""
        self.blocks[block_ids, layer, 0, offsets] = k
        self.blocks[block_ids, layer, 1, offsets] = v

    def gather(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `num_tokens` tokens along a block table: [num_tokens, kv_heads, head_dim]."""
        k = self.blocks[:, layer, 0].index_select(0, block_ids)  # [nblk, bs, kvh, hd], one copy each
        v = self.blocks[:, layer, 1].index_select(0, block_ids)
        shape = (-1, self.layout.num_kv_heads, self.layout.head_dim)
        return k.view(shape)[:num_tokens], v.view(shape)[:num_tokens]

    def gather_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of whole blocks: [2 (k/v), len(block_ids), block_size, kv_heads, head_dim], copied into
        a workspace that the next call overwrites (batched decode attention uses it at once)."""
        n = block_ids.shape[0]
        shape = (2, n, self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        numel = 2 * n * shape[2] * shape[3] * shape[4]
        if self._workspace is None or self._workspace.numel() < numel:
            self._workspace = torch.empty(numel, dtype=self.layout.dtype, device=self.blocks.device)
        kv = self._workspace[:numel].view(shape)
        torch.index_select(self.blocks[:, layer, 0], 0, block_ids, out=kv[0])
        torch.index_select(self.blocks[:, layer, 1], 0, block_ids, out=kv[1])
        return kv
