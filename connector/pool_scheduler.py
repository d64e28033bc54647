"""The pool connector's scheduler half: prefix lookups, pending loads, save planning.

Host-independent: it takes plain values (request id, block hashes, token counts, block ids)
and never sees a host's request or scheduler-output classes, so our engine's
`MooncakeConnector` and a vLLM plug-in wrap the same logic.

Lookup: when a request arrives (`start_lookup`, the host's `on_new_request`) or is first
asked about, its chain of full blocks is looked up off the host's thread, batched with the
other lookups in flight (`connector.lookup`); until the answer is in, `num_matched_tokens`
says "ask again later" (None), and past the lookup deadline the request goes on with its
local hit only. The answer (the longest chain present from block 0) is remembered per
request, so the host may ask again, after any local hit, at no cost. A failed lookup is a
miss (the request computes locally). A request whose load failed is offered no
remote hit again (a host that sends it back to admission, as vLLM's `recompute` policy
does, would otherwise be offered the same failing blocks forever). Loads and saves
accumulate until `build_meta()` hands them to the worker half.

Not thread-safe: the host's scheduler thread owns it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from connector.messages import LoadSpec, PoolConnectorMetadata, SaveSpec
from connector.settings import PoolConnectorSettings
from connector.lookup import Lookups, LookupState
from metaserver.client import MetaClient
from metaserver.types import BlockHash, BlockLocation, NodeId, NodeRecord

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Hit:
    end: int                                # blocks looked up (from block 0)
    locations: tuple[BlockLocation, ...]    # the longest present prefix from block 0
    nodes: dict[NodeId, NodeRecord]
    start: int = 0                          # the local hit (blocks) the host last asked after


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
        self.hit_blocks = 0   # blocks the index matched (counter)
        self._client = client or settings.meta_client()
        self._lookups = Lookups(self._client, fingerprint, settings.node_id, settings.query_timeout_s,
                                settings.lookup_deadline_s)
        self._asked: dict[str, int] = {}                # request id -> blocks its lookup asked for
        self._hits: dict[str, _Hit] = {}
        self._loading: dict[str, frozenset[int]] = {}   # request id -> cache blocks its load writes
        self._load_failed: set[str] = set()             # requests offered no remote hit again
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []

    def start_lookup(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """A request arrived: start looking its full blocks up now, off this thread."""
        end = (num_tokens - 1) // self.block_size  # its last token is always computed
        if self.consume and end > 0:
            self._lookups.submit(request_id, block_hashes[:end])
            self._asked[request_id] = end

    def num_matched_tokens(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int,
                           num_computed_tokens: int) -> int | None:
        """Tokens after the local hit (`num_computed_tokens`, block-aligned) the pool can load;
        None while the lookup is in flight ("ask again later"). Leaves the request's last
        token to compute (its logits start the output). Never blocks."""
        if not self.consume or request_id in self._load_failed:
            return 0
        bs = self.block_size
        start, end = num_computed_tokens // bs, (num_tokens - 1) // bs
        if end <= start:
            return 0
        hit = self._hits.get(request_id)
        if hit is None or hit.end < end:
            if self._asked.get(request_id, 0) < end:
                self.start_lookup(request_id, block_hashes, num_tokens)
            state, res = self._lookups.poll(request_id)
            if state is LookupState.PENDING:
                return None
            hit = _Hit(end, res.locations, res.nodes) if res is not None else _Hit(end, (), {})
            self.hit_blocks += len(hit.locations)
            self._hits[request_id] = hit
        hit.start = start
        return max(0, len(hit.locations) - start) * bs

    def wait_for_lookups(self, timeout_s: float) -> None:
        """Block until a lookup is answered or `timeout_s` passed (for a host with nothing else
        to do while its requests wait for lookups)."""
        self._lookups.wait(timeout_s)

    def on_alloc(self, request_id: str, block_table: Sequence[int], num_external_tokens: int) -> None:
        """The host allocated the request's blocks (`block_table`: all of them, from block 0)
        for its first `num_external_tokens` external tokens after the local hit: plan their
        load. ValueError if that is more than the lookup found."""
        hit = self._hits.pop(request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        n = num_external_tokens // self.block_size
        first = hit.start
        dests = tuple(block_table[first:first + n])
        locs = hit.locations[first:first + n]
        if len(locs) < n or len(dests) < n:
            raise ValueError(f"{request_id}: {n} external blocks but {len(locs)} hits "
                             f"and {len(dests)} blocks allocated after the local hit")
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
        self._asked.pop(request_id, None)
        self._lookups.forget(request_id)
        self._loading.pop(request_id, None)
        self._load_failed.discard(request_id)

    def counters(self) -> dict[str, float]:
        """connector_hit_blocks and the lookups' counters (lookup_*)."""
        return {"connector_hit_blocks": self.hit_blocks, **self._lookups.counters()}

    def close(self) -> None:
        self._lookups.close()
        self._client.close()
