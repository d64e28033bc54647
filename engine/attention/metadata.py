"""What one forward pass needs to know about its sequences (built by the model runner)."""
from __future__ import annotations

from dataclasses import dataclass

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
    # For the Triton path (CUDA): padded block tables and per-sequence arrays.
    block_tables: torch.Tensor | None = None   # int32 [num_seqs, max_blocks]
    query_starts: torch.Tensor | None = None   # int32 [num_seqs + 1]
    context_lens: torch.Tensor | None = None   # int32 [num_seqs]
