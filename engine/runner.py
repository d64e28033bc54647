"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

It also drives the worker side of the KV connector around the forward pass, as vLLM's
model runner does: bind the step's metadata and start its loads before, hand newly full
blocks to the saver after, and collect what finished into the `ModelRunnerOutput`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionMetadata, SeqSpan
from engine.kv_cache import PagedKVCache
from engine.kv_cache_manager import KVCacheManager
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.step import KVConnectorOutput, ModelRunnerOutput, ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from engine.kv_connector.base import KVConnectorBase_V1


def row_spans(q0: int, start: int, n: int, prompt_len: int, table: torch.Tensor) -> list[SeqSpan]:
    """A sequence's n rows of a pass (from flat row q0, positions start..) as attention spans: its
    prompt rows as one prefill chunk (of one row too), each row past the prompt as the decode row
    it is (a new token, one verified with drafts, one recomputed after a preemption). So a row's
    bits follow from its tokens alone, never from how the pass was scheduled: the decode and
    prefill kernels' sums differ in the last bits."""
    p = max(0, min(n, prompt_len - start))
    spans = [SeqSpan(q0, p, start + p, table, prompt_row=True)] if p else []
    spans += [SeqSpan(q0 + i, 1, start + i + 1, table) for i in range(p, n)]
    return spans


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager, sampler: Sampler,
                 connector: KVConnectorBase_V1 | None = None) -> None:
        """`connector` is the worker side of the KV connector (None: no connector)."""
        self.model = model
        self.cache = cache
        self.kv = kv
        self.sampler = sampler
        self.connector = connector
        self.block_size = cache.layout.block_size
        self.device = model.device

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                     list[ScheduledSeq]]:
        """The pass's flat token ids and positions, attention metadata, the rows whose logits are
        needed (one per sampling request; 1 + drafts for a speculating one) and those requests."""
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        logits_idx: list[int] = []
        samplers: list[ScheduledSeq] = []
        slot_blocks: list[int] = []
        bs = self.block_size
        for s in out.scheduled:
            req = s.request
            start, n = req.num_computed_tokens, s.num_new_tokens
            k = len(s.draft_token_ids)
            q0 = len(ids)
            ids.extend(req.all_token_ids[start:start + n - k])
            ids.extend(s.draft_token_ids)
            positions.extend(range(start, start + n))
            block_ids = self.kv.block_ids(req.request_id)
            slot_blocks.extend(block_ids[p // bs] for p in range(start, start + n))
            table = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            spans.extend(row_spans(q0, start, n, req.num_prompt_tokens, table))
            if s.samples:
                logits_idx.extend(range(q0 + n - 1 - k, q0 + n))
                samplers.append(s)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(spans, torch.tensor(slot_blocks, dtype=torch.long, device=self.device),
                                 pos_t % bs)
        return torch.tensor(ids, dtype=torch.long, device=self.device), pos_t, meta, logits_idx, samplers

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step: the connector's loads start, the batch (if any) is computed and
        sampled, its new full blocks are handed to the connector's saver, and what the
        connector finished is reported."""
        for rid in out.finished_req_ids:
            self.sampler.forget(rid)
        c = self.connector
        if c is not None:
            c.bind_connector_metadata(out.kv_connector_metadata)
            c.start_load_kv(None)
        result = ModelRunnerOutput(self._forward(out) if out.scheduled else {})
        if c is not None:
            if out.scheduled:
                c.wait_for_save()
            if out.loads_to_wait:
                c.wait_for_loads(out.loads_to_wait, out.load_wait_s)
            result.kv_connector_output = self._connector_report(c, out.finished_req_ids)
        return result

    def _forward(self, out: SchedulerOutput) -> dict[str, list[tuple[int, dict[int, float] | None]]]:
        """The tokens each scheduled request that samples emits (and their logprobs)."""
        ids, pos, meta, logits_idx, seqs = self.prepare(out)
        logits_at = torch.tensor(logits_idx, dtype=torch.long, device=self.device)  # may be empty: no one samples
        logits = self.model.forward(ids, pos, self.cache, meta, logits_at).cpu()
        plain = [i for i, s in enumerate(seqs) if not s.draft_token_ids]
        rows = [0]
        for s in seqs:
            rows.append(rows[-1] + 1 + len(s.draft_token_ids))
        result: dict[str, list[tuple[int, dict[int, float] | None]]] = {}
        if plain:
            picked = logits[[rows[i] for i in plain]]
            for i, sample in zip(plain, self.sampler.sample(picked, [seqs[i].request for i in plain])):
                result[seqs[i].request.request_id] = [sample]
        for i, s in enumerate(seqs):
            if s.draft_token_ids:
                result[s.request.request_id] = self.sampler.verify(logits[rows[i]:rows[i + 1]], s.request,
                                                                   list(s.draft_token_ids), s.draft_probs)
        return result

    @staticmethod
    def _connector_report(c: KVConnectorBase_V1, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        sending, recving = c.get_finished(set(finished_req_ids))
        report = KVConnectorOutput(sending or set(), recving or set(), c.get_block_ids_with_load_errors(),
                                   c.get_kv_transfer_params() if sending else {})
        c.clear_connector_metadata()
        return report
