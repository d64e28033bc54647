"""What one forward pass needs to know about its sequences (built by the model runner)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, slots=True)
class SeqSpan:
    query_start: int       # first of this sequence's tokens in the flat batch
    num_query: int         # tokens computed in this pass (prefill chunk or 1 for decode)
    context_len: int       # tokens in the cache after this pass (history + these)
    block_table: torch.Tensor  # int64 [num_blocks_of_this_seq]


@dataclass(frozen=True)
class AttentionMetadata:
    seqs: list[SeqSpan]
    slot_block_ids: torch.Tensor   # int64 [num_tokens]: cache block of each new token
    slot_offsets: torch.Tensor     # int64 [num_tokens]: position inside that block

    @cached_property
    def kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the Triton kernel, built once per pass: (block_tables [S, max_blocks] int32
        zero-padded, token_seq [T] int32 = sequence of each token, token_pos [T] int32)."""
        device = self.slot_block_ids.device
        width = max(len(s.block_table) for s in self.seqs)
        tables = torch.zeros(len(self.seqs), width, dtype=torch.int32)
        seq_of: list[int] = []
        pos_of: list[int] = []
        for i, s in enumerate(self.seqs):
            tables[i, :len(s.block_table)] = s.block_table.to(torch.int32).cpu()
            seq_of += [i] * s.num_query
            pos_of += range(s.context_len - s.num_query, s.context_len)
        return (tables.to(device), torch.tensor(seq_of, dtype=torch.int32, device=device),
                torch.tensor(pos_of, dtype=torch.int32, device=device))
