"""What one forward pass needs to know about its sequences (built by the model runner)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True, slots=True)
class SeqSpan:
    query_start: int       # first of this sequence's tokens in the flat batch
    num_query: int         # tokens computed in this pass (a prompt chunk, or 1 for a decode row)
    context_len: int       # tokens in the cache after this pass (history + these)
    block_table: torch.Tensor  # int64 [num_blocks_of_this_seq]
    # Rows of a prompt (engine/runner.py `row_spans`): attention runs them as a prefill chunk
    # even when there is one (the last token after a prefix hit; a chunk's tail in the last
    # layer), never as a decode row. The kernels' sums differ in the last bits, and a prompt
    # row's bits must not depend on how much of the prompt was a hit.
    prompt_row: bool = False

    @property
    def decode(self) -> bool:
        """A decode row: one query, not a prompt's."""
        return self.num_query == 1 and not self.prompt_row


# Decode batching (the CPU backend's path without the C decode kernel). Decode sequences are sorted by context length and cut into
# groups, each padded to its longest member and run as one attention call per layer. The cut
# minimizes  sum over groups of (GROUP_COST_TOKENS + size * padded length): one more group costs
# a few ops per layer, about as much as GROUP_COST_TOKENS keys of gather and attention. A group
# holds at most MAX_GROUP_TOKENS padded keys (its gathered K and V stay in cache) and
# MAX_GROUP_SEQS sequences.
GROUP_COST_TOKENS = 384
MAX_GROUP_TOKENS = 16384
MAX_GROUP_SEQS = 64


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode sequences (one query each) that share one attention call per layer."""
    rows: torch.Tensor               # int64 [n]: each sequence's query token in the flat batch
    blocks: torch.Tensor             # int64 [n * width]: block tables padded to `width` blocks, flattened
    width: int                       # blocks per sequence after padding
    key_mask: torch.Tensor | None    # bool [n, 1, 1, width * block_size]: key in context; None = no padding
    stale_keys: torch.Tensor | None  # int64: keys (of the n * width * block_size gathered) in a sequence's
                                     # last block past its context: stale cache slots, to be zeroed
    _masks: dict = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """0 / -inf key-padding mask in the compute dtype (built once per pass and dtype)."""
        if self.key_mask is None:
            return None
        m = self._masks.get(dtype)
        if m is None:
            m = torch.zeros(self.key_mask.shape, dtype=dtype, device=self.key_mask.device)
            m.masked_fill_(~self.key_mask, float("-inf"))
            self._masks[dtype] = m
        return m


def plan_decode_groups(seqs: list[SeqSpan], block_size: int) -> list[DecodeGroup]:
    """Group the decode sequences of a pass for batched decode attention."""
    dec = sorted((s for s in seqs if s.decode), key=lambda s: s.context_len, reverse=True)
    n = len(dec)
    if not n:
        return []
    w = [-(-s.context_len // block_size) * block_size for s in dec]  # padded keys, non-increasing
    # best[i]: least cost of grouping dec[:i]; start[i]: where the last of those groups starts.
    best = [0] + [0] * n
    start = [0] * (n + 1)
    for i in range(1, n + 1):
        cost, arg = None, i - 1
        for j in range(i - 1, max(-1, i - 1 - MAX_GROUP_SEQS), -1):
            if j < i - 1 and (i - j) * w[j] > MAX_GROUP_TOKENS:
                break
            c = best[j] + GROUP_COST_TOKENS + (i - j) * w[j]
            if cost is None or c < cost:
                cost, arg = c, j
        best[i], start[i] = cost, arg
    groups = []
    i = n
    while i > 0:
        groups.append(dec[start[i]:i])
        i = start[i]
    return [_decode_group(g, block_size) for g in reversed(groups)]


def _decode_group(group: list[SeqSpan], block_size: int) -> DecodeGroup:
    device = group[0].block_table.device
    n = len(group)
    nbs = [-(-s.context_len // block_size) for s in group]
    width = nbs[0]
    padded = torch.nn.utils.rnn.pad_sequence([s.block_table[:nb] for s, nb in zip(group, nbs)], batch_first=True)
    nb_t = torch.tensor(nbs, dtype=torch.long, device=device)
    # Padding blocks: the first block of the longest sequence, which is full wherever padding exists
    # (width >= 2), so holds finite data only; the stale slots of partly filled blocks are zeroed later.
    padded = torch.where(torch.arange(width, device=device)[None, :] < nb_t[:, None], padded, padded[0, 0])
    rows = torch.tensor([s.query_start for s in group], dtype=torch.long, device=device)
    key_mask = stale_keys = None
    keys = width * block_size
    if any(s.context_len != keys for s in group):
        ctx = torch.tensor([s.context_len for s in group], dtype=torch.long, device=device)
        key_mask = (torch.arange(keys, device=device)[None, :] < ctx[:, None])[:, None, None, :]
        stale = [k for i, (s, nb) in enumerate(zip(group, nbs)) for k in range(i * keys + s.context_len,
                                                                              i * keys + nb * block_size)]
        if stale:
            stale_keys = torch.tensor(stale, dtype=torch.long, device=device)
    assert padded.shape == (n, width)
    return DecodeGroup(rows, padded.reshape(-1).to(torch.long), width, key_mask, stale_keys)


@dataclass(frozen=True)
class AttentionMetadata:
    seqs: list[SeqSpan]
    slot_block_ids: torch.Tensor   # int64 [num_tokens]: cache block of each new token
    slot_offsets: torch.Tensor     # int64 [num_tokens]: position inside that block
    _plans: dict = field(default_factory=dict, repr=False, compare=False)

    def decode_groups(self, block_size: int) -> list[DecodeGroup]:
        """Batched-decode groups of this pass, built on the first layer's call and reused by the others."""
        groups = self._plans.get(block_size)
        if groups is None:
            groups = self._plans[block_size] = plan_decode_groups(self.seqs, block_size)
        return groups

    def query_tails(self, rows: list[int]) -> AttentionMetadata | None:
        """This pass over only the query tokens `rows` (ascending flat-batch indices): where the rows
        taken from each sequence are the last of its query (they see the same keys as before: the
        cache already holds every token's K and V), the metadata of that smaller batch, whose
        sequences keep their context and block table and take their tokens in `rows` order.
        Sequences left with no rows drop out. None where `rows` are not such tails."""
        spans: list[SeqSpan] = []
        j = 0
        for s in self.seqs:
            end = s.query_start + s.num_query
            first = j
            while j < len(rows) and s.query_start <= rows[j] < end:
                j += 1
            m = j - first
            if m and rows[first:j] != list(range(end - m, end)):
                return None
            if m:
                spans.append(SeqSpan(first, m, s.context_len, s.block_table, not s.decode))
        if j != len(rows):  # rows outside every sequence, or out of order
            return None
        at = torch.tensor(rows, dtype=torch.long, device=self.slot_block_ids.device)
        return AttentionMetadata(spans, self.slot_block_ids[at], self.slot_offsets[at])

    @cached_property
    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the C decode kernel, built once per pass: the decode spans' (rows [n], context
        lengths [n], block tables concatenated [sum of table lengths], each table's start [n]), int64."""
        dec = [s for s in self.seqs if s.decode]
        device = self.slot_block_ids.device
        starts, at = [], 0
        for s in dec:
            starts.append(at)
            at += len(s.block_table)
        cat = torch.cat([s.block_table for s in dec]) if dec else torch.empty(0, dtype=torch.long, device=device)
        as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return (as_t([s.query_start for s in dec]), as_t([s.context_len for s in dec]),
                cat.to(torch.long).contiguous(), as_t(starts))

    @cached_property
    def prefill_seqs(self) -> list[SeqSpan]:
        return [s for s in self.seqs if not s.decode]

    def causal_mask(self, s: SeqSpan, dtype: torch.dtype) -> torch.Tensor:
        """0 / -inf [num_query, context_len] mask of a prefill chunk after history (query i at position
        context_len - num_query + i sees keys up to it), built once per pass and reused by every layer."""
        key = ("causal", s.query_start, dtype)
        m = self._plans.get(key)
        if m is None:
            device = s.block_table.device
            q_pos = torch.arange(s.context_len - s.num_query, s.context_len, device=device)[:, None]
            future = torch.arange(s.context_len, device=device)[None, :] > q_pos
            m = self._plans[key] = torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(
                future, float("-inf"))
        return m

    @cached_property
    def kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the Triton kernel, built once per pass: (block_tables [S, max_blocks] int32
        zero-padded, one per distinct table, token_seq [T] int32 = each token's table row,
        token_pos [T] int32)."""
        device = self.slot_block_ids.device
        width = max(len(s.block_table) for s in self.seqs)
        # one row per block table: a request's spans (its prompt rows, each row past the prompt)
        # share one tensor, copied to the host once
        distinct = {id(s.block_table): s.block_table for s in self.seqs}
        row_of = {key: i for i, key in enumerate(distinct)}
        tables = torch.zeros(len(distinct), width, dtype=torch.int32)
        for i, table in enumerate(distinct.values()):
            tables[i, :len(table)] = table.to(torch.int32).cpu()
        seq_of: list[int] = []
        pos_of: list[int] = []
        for s in self.seqs:
            seq_of += [row_of[id(s.block_table)]] * s.num_query
            pos_of += range(s.context_len - s.num_query, s.context_len)
        return (tables.to(device), torch.tensor(seq_of, dtype=torch.int32, device=device),
                torch.tensor(pos_of, dtype=torch.int32, device=device))
