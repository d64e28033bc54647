"""The pool connector's scheduler half: prefix lookups, pending loads, save planning.

Host-independent: it takes plain values (request id, block hashes, token counts, block ids)
and never sees a host's request or scheduler-output classes, so our engine's
`MooncakeConnector` and a vLLM plug-in wrap the same logic.

Lookup: when a request arrives (`start_lookup`, the host's `on_new_request`) or is first
asked about, its chain of full blocks is looked up in the node-local view of the index
(`metaserver.view`, kept in step by a WatchIndex stream: a local walk, no RPC). While the
view is not current (starting, or its stream silent), the lookup goes off the host's thread
instead, batched with the other lookups in flight (`connector.lookup`); until that answer
is in, `num_matched_tokens` says "ask again later" (None), and past the lookup deadline the
request goes on with its local hit only. The answer is remembered per request, so the host
may ask again, after any local hit, at no cost. A failed lookup is a miss (the request
computes locally).

What is offered: the longest run of blocks the index holds starting where the host's own
cache stops (the block `num_computed_tokens` reaches, vLLM's semantics), whatever the index
holds before it. So lookups are sparse (every block of the chain the index holds, not the
prefix from block 0): they start before the local hit is known, and the pool often lacks
the chain's first blocks exactly because they are a local hit everywhere (a shared system
prompt is never computed, saved or read again, so the pool's LRU drops it), while it still
holds the blocks behind them. A load is that run: chain blocks start, start+1, ... into the
request's cache blocks start, start+1, ..., never across a gap.

Recency: the pool's LRU sees its saves and local reads, but not the uses that matter most
for a hot prefix: a block that is a local hit in every engine's own cache is never computed,
saved or read again. So a request's local hit refreshes the pool when it is first scheduled
(`plan_save`): its blocks are touched in this node's pool (`touches`: moved to the LRU's
end where held) and those the index held nowhere at lookup time are saved again from the
request's own cache blocks (re-offered). A block another node reads one-sidedly does not
touch its owner's LRU (the owner learns nothing of the read), but the reader now holds it in
its cache and, while it keeps using it, re-offers it once the owner dropped it. Chosen over
readers reporting uses to the owner or the index (a new channel, RPCs per use) because it
costs nothing while the pool holds the block and one copy when it did not.

A request whose load failed is offered no remote hit again (a host that sends it back to
admission, as vLLM's `recompute` policy does, would otherwise be offered the same failing
blocks forever). Loads and saves accumulate until `build_meta()` hands them to the worker
half.

P/D (`connector.handoff`): a request that comes with a producer's transfer params takes its
hit from them instead of a lookup (the blocks are read straight from the producer's slots);
a producer's request asking for a remote decode keeps its blocks at its end
(`finish_request`) while the worker half makes sure each full prompt block is in the pool
and reports where (a send).

Not thread-safe: the host's scheduler thread owns it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from connector import handoff
from connector.lookup import Lookups, LookupState
from connector.messages import LoadSpec, PoolConnectorMetadata, SaveSpec, SendSpec
from connector.prefetch import Prefetcher
from connector.save_policy import SavePolicy
from connector.settings import PoolConnectorSettings
from metaserver.client import MetaClient
from metaserver.types import BlockHash, BlockLocation, Medium, QueryResult
from metaserver.view import IndexView

log = logging.getLogger(__name__)


class FailedReads:
    """A reader's short negative cache: the sources and blocks whose reads just failed.

    A source all of whose blocks in one load failed (dead, frozen, unreachable) is suspect for
    `suspect_s`: no lookup answer offers a block on it meanwhile. A single block that failed
    while others from its source arrived (evicted or overwritten there) is avoided alone. So
    after a node dies, this reader pays one failed read for it, not one per request until the
    node's lease expires in the index."""

    def __init__(self, suspect_s: float) -> None:
        self.suspect_s = suspect_s
        self._nodes: dict[str, float] = {}                # node id -> suspect until (monotonic)
        self._blocks: dict[tuple[str, bytes, int], float] = {}  # (node, hash, generation) -> until
        self.skipped_blocks = 0                           # blocks not offered because of it (counter)

    def record(self, locations: Sequence[BlockLocation], failed: Sequence[int]) -> list[tuple[str, list[bytes]]]:
        """Remember the failed reads of one load (`failed`: indexes into `locations`); returns
        what to tell the metaserver: (source, []) for a source none of whose blocks arrived,
        (source, hashes) for single blocks that failed on a source that answered."""
        until = time.monotonic() + self.suspect_s
        per_node: dict[str, list[int]] = {}
        for i, loc in enumerate(locations):
            per_node.setdefault(loc.node_id, []).append(i)
        bad = set(failed)
        reports: list[tuple[str, list[bytes]]] = []
        for node, idx in per_node.items():
            failed_here = sorted(bad.intersection(idx))
            if len(failed_here) == len(idx):
                self._nodes[node] = until
                reports.append((node, []))
                log.warning("reads from node %s failed: not offering its blocks for %.0f s", node, self.suspect_s)
            elif failed_here:
                for i in failed_here:
                    loc = locations[i]
                    self._blocks[(loc.node_id, loc.block_hash, loc.generation)] = until
                reports.append((node, [locations[i].block_hash for i in failed_here]))
        return reports

    def usable(self, locations: Sequence[BlockLocation]) -> int:
        """How many leading locations may be offered."""
        if not self._nodes and not self._blocks:
            return len(locations)
        now = time.monotonic()
        self._nodes = {n: t for n, t in self._nodes.items() if t > now}
        self._blocks = {k: t for k, t in self._blocks.items() if t > now}
        for i, loc in enumerate(locations):
            if loc.node_id in self._nodes or (loc.node_id, loc.block_hash, loc.generation) in self._blocks:
                self.skipped_blocks += len(locations) - i
                return i
        return len(locations)

    def counters(self) -> dict[str, float]:
        return {"connector_suspect_nodes": len(self._nodes), "connector_avoided_blocks": self.skipped_blocks}


class HandOff(NamedTuple):
    """What a finished request hands to a remote decode (`PoolScheduler.finish_request`)."""

    full_blocks: int   # its full prompt blocks from block 0
    tail_tokens: int   # prompt tokens of the partial block after them (0: none handed off)

    def __bool__(self) -> bool:
        return bool(self.full_blocks or self.tail_tokens)


@dataclass(slots=True)
class _Hit:
    """A request's lookup answer, and what was last offered from it."""

    end: int                                # blocks looked up (from block 0)
    answer: QueryResult                     # what the index holds of them (sparse: anywhere in the chain)
    stop: int                               # chain block from which nothing is offered (a read just failed there)
    start: int = 0                          # the local hit (blocks) the host last asked after
    offered: tuple[BlockLocation, ...] = ()  # what it was offered then: chain blocks start, start+1, ...


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
        self.hit_blocks = 0   # blocks the index offered, anywhere in the chains looked up (counter)
        self._client = client or settings.meta_client()
        self._lookups = Lookups(self._client, fingerprint, settings.node_id, settings.query_timeout_s,
                                settings.lookup_deadline_s)
        self._view = IndexView(self._client, fingerprint, settings.node_id, settings.view_stale_s) \
            if consume and settings.lookup_view else None
        self.view_answers = 0  # lookups answered by the view (counter)
        # Other nodes' DISK blocks in an offered run: staged by their holders from now on
        # (`connector.prefetch`), so the load usually finds them in DRAM.
        self._prefetch = Prefetcher(settings.read_timeout_s / 2) if consume else None
        self._asked: dict[str, int] = {}                # request id -> blocks its lookup asked for
        self._hits: dict[str, _Hit] = {}
        self._loading: dict[str, LoadSpec] = {}         # request id -> its load in flight
        self._avoid = FailedReads(settings.suspect_s)   # sources and blocks whose reads just failed
        self._load_failed: set[str] = set()             # requests offered no remote hit again
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        self._sends: list[SendSpec] = []
        self._writes: list[int] = []
        # request id -> blocks up to which its saves are planned. A block filled by accepted
        # speculative drafts had no hash when its step was planned (its tokens were not known
        # yet); it is planned at the request's next step, from here.
        self._planned: dict[str, int] = {}
        self.handoff_loads = 0       # requests whose hit came from a producer's transfer params (counter)
        self.handoff_sends = 0       # requests handed to a remote decode (counter)
        self.handoff_bad_params = 0  # transfer params that could not be read (looked up instead; counter)
        self._save_policy = SavePolicy(settings.save_policy, settings.save_seen_blocks)
        # request id -> (its local hit in blocks, chain blocks below it the index held nowhere),
        # from its last lookup answer; refreshed in the pool when it is first scheduled.
        self._refresh: dict[str, tuple[int, tuple[int, ...]]] = {}
        # request id -> (the chain blocks a vLLM producer put into the pool for it, until when
        # to wait for them to reach the index) (`connector.handoff`).
        self._expect: dict[str, tuple[int, float]] = {}
        # request id -> the hand-off block after its full prompt blocks, and the tokens loaded
        # from it (`handoff.consumer_tail`): the chain looked up is one block longer.
        self._tails: dict[str, tuple[BlockHash, int]] = {}
        self._touches: list[BlockHash] = []
        self.touched_blocks = 0    # local-hit blocks touched in this node's pool (counter)
        self.reoffered_blocks = 0  # local-hit blocks saved again: the index held them nowhere (counter)

    def _chain(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> list[bytes]:
        """The blocks a request's lookup names: its full blocks before its last token, then its
        hand-off tail if it has one."""
        chain = list(block_hashes[:(num_tokens - 1) // self.block_size])
        tail = self._tails.get(request_id)
        return chain + [tail[0]] if tail is not None else chain

    def start_lookup(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int,
                     transfer_params: dict | None = None, prompt_tokens: Sequence[int] | None = None) -> None:
        """A request arrived: start looking its full blocks up now, off this thread (or take
        them from a producer's `transfer_params`, with the tail of `prompt_tokens`)."""
        if not self.consume:
            return
        if handoff.is_remote_prefill(transfer_params):
            assert transfer_params is not None
            try:
                tail = handoff.consumer_tail(transfer_params, self.fingerprint, block_hashes, num_tokens,
                                             self.block_size, prompt_tokens)
            except ValueError as err:
                tail = None
                log.warning("%s: the hand-off's last block is not used (%s)", request_id, err)
            if tail is not None:
                self._tails[request_id] = tail
        chain = self._chain(request_id, block_hashes, num_tokens)
        end = len(chain)  # its last token is always computed
        if end <= 0:
            return
        if handoff.is_remote_prefill(transfer_params) and handoff.names_blocks_by_count(transfer_params or {}):
            assert transfer_params is not None
            try:  # a vLLM producer: its blocks reach the index a moment after its answer
                declared_tail = "kvpool_tail_tokens" in transfer_params and request_id in self._tails
                want = min(handoff.expected_blocks(transfer_params, self.fingerprint) + declared_tail, end)
            except ValueError as err:
                self.handoff_bad_params += 1
                log.warning("%s: transfer params not used (%s); looking the prompt up instead", request_id, err)
            else:
                if want:
                    self.handoff_loads += 1
                    self._expect[request_id] = (want, time.monotonic() + self.settings.handoff_wait_s)
        elif handoff.is_remote_prefill(transfer_params):
            assert transfer_params is not None
            try:
                locations, nodes = handoff.consumer_hit(transfer_params, self.fingerprint, chain)
            except ValueError as err:
                self.handoff_bad_params += 1
                log.warning("%s: transfer params not used (%s); looking the prompt up instead", request_id, err)
            else:
                self.handoff_loads += 1
                self.hit_blocks += len(locations)
                self._hits[request_id] = _Hit(end, QueryResult(locations, nodes), end)
                return
        res = self._view.query(chain, sparse=True) if self._view is not None else None
        if res is not None:  # answered at once, on this thread, with no RPC
            self.view_answers += 1
            self.hit_blocks += res.num_held
            self._hits[request_id] = _Hit(end, res, end)
            return
        self._lookups.submit(request_id, chain)
        self._asked[request_id] = end

    def num_matched_tokens(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int,
                           num_computed_tokens: int) -> int | None:
        """Tokens after the local hit (`num_computed_tokens`, block-aligned) the pool can load:
        the run of blocks the index holds from there, whatever it holds before; None while
        the lookup is in flight ("ask again later"). Leaves the request's last token to
        compute (its logits start the output): a run that ends with a hand-off tail loads
        only its tokens before that one. Never blocks."""
        if not self.consume or request_id in self._load_failed:
            return 0
        bs = self.block_size
        chain = self._chain(request_id, block_hashes, num_tokens)
        start, end = num_computed_tokens // bs, len(chain)
        if end <= start:
            return 0
        hit = self._hits.get(request_id)
        if (hit is None or hit.end < end) and self._asked.get(request_id, 0) < end:
            self.start_lookup(request_id, block_hashes, num_tokens)
            hit = self._hits.get(request_id)
        if hit is None or hit.end < end:
            state, res = self._lookups.poll(request_id)
            if state is LookupState.PENDING:
                return None
            hit = _Hit(end, res if res is not None else QueryResult((), {}), end)
            self.hit_blocks += hit.answer.num_held
            self._hits[request_id] = hit
        run = hit.answer.run_from(start)[:max(0, min(end, hit.stop) - start)]
        assert all(loc.block_hash == chain[start + j] for j, loc in enumerate(run)), "a run has no gap"
        usable = self._avoid.usable(run)  # the run, cut at a source or block that just failed
        if usable < len(run):
            hit.stop = start + usable  # never offered to this request again (nor counted again)
            run = run[:usable]
        expect = self._expect.get(request_id)
        if expect is not None:
            want, until = expect
            # Not cut by a failed read (that sets hit.stop), short of the producer's blocks, in time:
            if hit.stop == end and start + len(run) < want and time.monotonic() < until:
                # A vLLM producer's blocks are not all in the index yet: look again next time.
                self._hits.pop(request_id, None)
                self._asked.pop(request_id, None)
                self.hit_blocks -= hit.answer.num_held
                return None
            del self._expect[request_id]
        hit.start, hit.offered = start, run
        if self._prefetch is not None and run:
            self._prefetch_disk(run, hit.answer.nodes)
        held = hit.answer.held
        if self.produce and start and (held or not hit.answer.locations):  # a sparse answer (or nothing held)
            self._refresh[request_id] = (start, tuple(j for j in range(start) if j >= len(held) or held[j] is None))
        tail = self._tails.get(request_id)
        if tail is not None and run and start + len(run) == end:
            return (len(run) - 1) * bs + tail[1]  # the tail block holds the last token: not that one
        return len(run) * bs

    def _prefetch_disk(self, run: Sequence[BlockLocation], nodes: dict) -> None:
        """Ask the holders of other nodes' DISK copies in `run` to stage them now (never
        blocks: a request the prefetcher has no room for is dropped)."""
        assert self._prefetch is not None
        by_node: dict[str, list[bytes]] = {}
        for loc in run:
            if loc.medium == Medium.DISK and loc.node_id != self.settings.node_id:
                by_node.setdefault(loc.node_id, []).append(bytes(loc.block_hash))
        for node_id, hashes in by_node.items():
            node = nodes.get(node_id)
            if node is not None and node.stage_address:
                self._prefetch.offer(node.stage_address, hashes)

    def wait_for_lookups(self, timeout_s: float) -> None:
        """Block until a lookup is answered or `timeout_s` passed (for a host with nothing else
        to do while its requests wait for lookups)."""
        self._lookups.wait(timeout_s)

    def on_alloc(self, request_id: str, block_table: Sequence[int], num_external_tokens: int) -> None:
        """The host allocated the request's blocks (`block_table`: all of them, from block 0)
        for its first `num_external_tokens` external tokens after the local hit: plan their
        load, the first blocks of the run last offered (`num_matched_tokens`): chain block
        start + j into block_table[start + j]. ValueError if that is more than was offered."""
        hit = self._hits.pop(request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        n = -(-num_external_tokens // self.block_size)  # the last one a tail's part (num_matched_tokens)
        first = hit.start
        dests = tuple(block_table[first:first + n])
        locs = hit.offered[:n]
        if len(locs) < n or len(dests) < n:
            raise ValueError(f"{request_id}: {n} external blocks but {len(locs)} offered "
                             f"and {len(dests)} blocks allocated after the local hit")
        nodes = hit.answer.nodes
        spec = LoadSpec(request_id, dests, locs,
                        {loc.node_id: nodes[loc.node_id] for loc in locs if loc.node_id in nodes})
        self._loading[request_id] = spec
        self._loads.append(spec)

    def on_worker_report(self, finished_loads: Iterable[str], invalid_block_ids: set[int]) -> None:
        """What the worker half reported: loads that finished, cache blocks that failed. A
        request with a failed block is offered no remote hit again, and the failed reads feed
        the negative cache (`FailedReads`) that every later lookup answer is cut by, and the
        metaserver hears of them (off this thread), so other readers are not offered them."""
        if invalid_block_ids:
            for rid, spec in self._loading.items():
                failed = [i for i, b in enumerate(spec.block_ids) if b in invalid_block_ids]
                if failed:
                    self._load_failed.add(rid)
                    for source, hashes in self._avoid.record(spec.locations, failed):
                        self._lookups.report_failed_read(source, hashes)
        for rid in finished_loads:
            self._loading.pop(rid, None)

    def plan_save(self, request_id: str, num_computed_tokens: int, num_new_tokens: int, block_table: Sequence[int],
                  block_hashes: Sequence[bytes]) -> None:
        """The request computes `num_new_tokens` after `num_computed_tokens` this step: save
        the blocks that become full (those with a hash and a cache block) that the save policy
        (`connector.save_policy`) picks."""
        if not self.produce:
            return
        bs = self.block_size
        written = num_computed_tokens // bs
        # Every block the step writes for it (the last one possibly partial): a queued save of
        # any of them (the host reused the block) must not copy it afterwards.
        self._writes.extend(block_table[written:-(-(num_computed_tokens + num_new_tokens) // bs)])
        if request_id not in self._planned:
            self._refresh_local_hit(request_id, block_table, block_hashes)
        first = min(written, self._planned.get(request_id, written))
        last = min((num_computed_tokens + num_new_tokens) // bs, len(block_hashes), len(block_table))
        self._planned[request_id] = max(last, first)
        if last > first:
            keep = self._save_policy.select(block_hashes[first:last])
            if keep:
                self._saves.append(SaveSpec(request_id, tuple(block_table[first + i] for i in keep),
                                            tuple(BlockHash(block_hashes[first + i]) for i in keep)))

    def _refresh_local_hit(self, request_id: str, block_table: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """The request's first step: touch its local-hit blocks in the pool and save again
        those the index held nowhere (see the module docstring, Recency)."""
        start, lacking = self._refresh.pop(request_id, (0, ()))
        start = min(start, len(block_table), len(block_hashes))
        if not start:
            return
        self._touches.extend(BlockHash(h) for h in block_hashes[:start])
        self.touched_blocks += start
        lacking = tuple(j for j in lacking if j < start)
        if lacking:
            self.reoffered_blocks += len(lacking)
            self._saves.append(SaveSpec(request_id, tuple(block_table[j] for j in lacking),
                                        tuple(BlockHash(block_hashes[j]) for j in lacking)))

    def finish_request(self, request_id: str, transfer_params: dict | None, block_table: Sequence[int],
                       block_hashes: Sequence[bytes], num_prompt_tokens: int, num_computed_tokens: int,
                       prompt_tokens: Sequence[int] | None = None) -> HandOff:
        """The request ended. A nonzero `HandOff` (the full prompt blocks sent, the tokens of
        the tail after them) if its blocks must stay: it asks for a remote decode, so the
        worker half sends those blocks (into the pool, then names them) first. Only computed
        blocks are sent (a request aborted in its prefill has blocks allocated whose KV was
        never written); the tail (`connector.handoff`) needs `prompt_tokens`."""
        self.forget(request_id)
        if not self.produce or not handoff.wants_remote_decode(transfer_params):
            return HandOff(0, 0)
        bs = self.block_size
        n = min(min(num_prompt_tokens, num_computed_tokens) // bs, len(block_hashes), len(block_table))
        ids, hashes = list(block_table[:n]), [BlockHash(h) for h in block_hashes[:n]]
        tail = handoff.producer_tail(num_prompt_tokens, bs)
        if (not tail or prompt_tokens is None or num_computed_tokens < num_prompt_tokens
                or n != num_prompt_tokens // bs or len(block_table) <= n):
            tail = 0
        else:
            ids.append(block_table[n])
            hashes.append(handoff.tail_hash(self.fingerprint, request_id, hashes[-1] if n else None,
                                            prompt_tokens[n * bs:num_prompt_tokens]))
        if not ids:
            return HandOff(0, 0)
        self.handoff_sends += 1
        self._sends.append(SendSpec(request_id, tuple(ids), tuple(hashes), tail))
        return HandOff(n, tail)

    def build_meta(self) -> PoolConnectorMetadata:
        """This step's loads, saves and sends for the worker half; starts a new step."""
        meta = PoolConnectorMetadata(self._loads, self._saves, self._writes, self._sends, self._touches)
        self._loads, self._saves, self._writes, self._sends, self._touches = [], [], [], [], []
        return meta

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is remembered about it."""
        self._hits.pop(request_id, None)
        self._planned.pop(request_id, None)
        self._asked.pop(request_id, None)
        self._lookups.forget(request_id)
        self._loading.pop(request_id, None)
        self._load_failed.discard(request_id)
        self._refresh.pop(request_id, None)
        self._expect.pop(request_id, None)
        self._tails.pop(request_id, None)

    def counters(self) -> dict[str, float]:
        """connector_hit_blocks and the lookups' counters (lookup_*)."""
        view = {} if self._view is None else {
            "lookup_view_answers": self.view_answers, "lookup_view_current": int(self._view.current()),
            "lookup_view_snapshots": self._view.snapshots, "lookup_view_resumes": self._view.resumes,
            "lookup_view_copies": self._view.num_copies()}
        return {"connector_hit_blocks": self.hit_blocks, "connector_saves_skipped": self._save_policy.skipped,
                "connector_handoff_loads": self.handoff_loads, "connector_handoff_sends": self.handoff_sends,
                "connector_handoff_bad_params": self.handoff_bad_params,
                "connector_touched_blocks": self.touched_blocks, "connector_reoffered_blocks": self.reoffered_blocks,
                **self._lookups.counters(), **view, **self._avoid.counters(),
                **(self._prefetch.counters() if self._prefetch is not None else {})}

    def close(self) -> None:
        if self._view is not None:
            self._view.close()
        if self._prefetch is not None:
            self._prefetch.close()
        self._lookups.close()
        self._client.close()
