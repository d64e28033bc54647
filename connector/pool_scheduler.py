"""The pool connector's scheduler half: prefix lookups, pending loads, save planning.

Host-independent: it takes plain values (request id, block hashes, token counts, block ids)
and never sees a host's request or scheduler-output classes, so our engine's
`MooncakeConnector` and a vLLM plug-in wrap the same logic.

Lookup: one QueryPrefix per request for the chain of full blocks after the local hit,
remembered per (request, local hit), so the scheduler may ask again at no cost. A failed
query is a miss (the request computes locally). A request whose load failed is offered no
remote hit again (a host that sends it back to admission, as vLLM's `recompute` policy
does, would otherwise be offered the same failing blocks forever). Loads and saves
accumulate until `build_meta()` hands them to the worker half.

Not thread-safe: the host's scheduler thread owns it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from connector.messages import LoadSpec, PoolConnectorMetadata, SaveSpec
from connector.settings import PoolConnectorSettings
from metaserver.client import MetaClient
from metaserver.errors import MetaError
from metaserver.types import BlockHash, BlockLocation, NodeId, NodeRecord

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Hit:
    num_computed_tokens: int                # local hit the query was made after
    locations: tuple[BlockLocation, ...]
    nodes: dict[NodeId, NodeRecord]


@dataclass
class LookupStats:
    queries: int = 0
    query_errors: int = 0
    hit_blocks: int = 0         # blocks the index matched


class PoolScheduler:
    def __init__(self, settings: PoolConnectorSettings, fingerprint: str, block_size: int, consume: bool,
                 produce: bool, client: MetaClient | None = None) -> None:
        """`consume`: look up and load hits; `produce`: plan saves of newly full blocks.
        `client`: the metaserver client to query (default: a new one from `settings`)."""
        self.settings = settings
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.consume = consume
        self.produce = produce
        self.stats = LookupStats()
        self._client = client or settings.meta_client()
        self._hits: dict[str, _Hit] = {}
        self._loading: dict[str, frozenset[int]] = {}   # request id -> cache blocks its load writes
        self._load_failed: set[str] = set()             # requests offered no remote hit again
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []

    def num_matched_tokens(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int,
                           num_computed_tokens: int) -> int:
        """Tokens after the local hit (`num_computed_tokens`, block-aligned) the pool can load.
        Leaves the request's last token to compute (its logits start the output). Queries
        once per (request, local hit); later calls answer from memory."""
        if not self.consume or request_id in self._load_failed:
            return 0
        bs = self.block_size
        start, end = num_computed_tokens // bs, (num_tokens - 1) // bs
        if end <= start:
            return 0
        hit = self._hits.get(request_id)
        if hit is None or hit.num_computed_tokens != num_computed_tokens:
            hit = self._query(request_id, block_hashes[start:end], num_computed_tokens)
            self._hits[request_id] = hit
        return len(hit.locations) * bs

    def _query(self, request_id: str, chain: Sequence[bytes], num_computed_tokens: int) -> _Hit:
        self.stats.queries += 1
        try:
            res = self._client.query_prefix(self.fingerprint, chain, self.settings.node_id,
                                            timeout_s=self.settings.query_timeout_s)
        except MetaError as err:
            self.stats.query_errors += 1
            log.warning("query for %s failed, computing locally: %s", request_id, err)
            return _Hit(num_computed_tokens, (), {})
        self.stats.hit_blocks += res.num_matched
        log.debug("query %s: %d of %d blocks hit", request_id, res.num_matched, len(chain))
        return _Hit(num_computed_tokens, res.locations, res.nodes)

    def on_alloc(self, request_id: str, block_table: Sequence[int], num_external_tokens: int) -> None:
        """The host allocated the request's blocks (`block_table`: all of them, from block 0)
        for its first `num_external_tokens` external tokens after the local hit: plan their
        load. ValueError if that is more than the lookup found."""
        hit = self._hits.pop(request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        n = num_external_tokens // self.block_size
        first = hit.num_computed_tokens // self.block_size
        dests = tuple(block_table[first:first + n])
        if n > len(hit.locations) or len(dests) < n:
            raise ValueError(f"{request_id}: {n} external blocks but {len(hit.locations)} hits "
                             f"and {len(dests)} blocks allocated after the local hit")
        locs = hit.locations[:n]
        self._loading[request_id] = frozenset(dests)
        self._loads.append(LoadSpec(request_id, dests, locs,
                                    {loc.node_id: hit.nodes[loc.node_id] for loc in locs if loc.node_id in hit.nodes}))

    def on_worker_report(self, finished_loads: Iterable[str], invalid_block_ids: set[int]) -> None:
        """What the worker half reported: loads that finished, cache blocks that failed. A
        request with a failed block is offered no remote hit again."""
        if invalid_block_ids:
            for rid, blocks in self._loading.items():
                if not blocks.isdisjoint(invalid_block_ids):
                    self._load_failed.add(rid)
        for rid in finished_loads:
            self._loading.pop(rid, None)

    def plan_save(self, request_id: str, num_computed_tokens: int, num_new_tokens: int, block_table: Sequence[int],
                  block_hashes: Sequence[bytes]) -> None:
        """The request computes `num_new_tokens` after `num_computed_tokens` this step: save
        the blocks that become full (those with a hash and a cache block)."""
        if not self.produce:
            return
        bs = self.block_size
        first = num_computed_tokens // bs
        last = min((num_computed_tokens + num_new_tokens) // bs, len(block_hashes), len(block_table))
        if last > first:
            self._saves.append(SaveSpec(request_id, tuple(block_table[first:last]),
                                        tuple(BlockHash(h) for h in block_hashes[first:last])))

    def build_meta(self) -> PoolConnectorMetadata:
        """This step's loads and saves for the worker half; starts a new step."""
        meta = PoolConnectorMetadata(self._loads, self._saves)
        self._loads, self._saves = [], []
        return meta

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is remembered about it."""
        self._hits.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._load_failed.discard(request_id)

    def counters(self) -> dict[str, float]:
        return {f"connector_{k}": v for k, v in asdict(self.stats).items()}

    def close(self) -> None:
        self._client.close()
