"""A discrete-event replay of a Mooncake-format trace over N simulated nodes (`kvpool plan`).

What decides hits is the project's own code, imported:
- the block index: `metaserver.index.BlockIndex` (one for the cluster, as the metaserver's):
  pools publish their puts and unpublish their evictions into it; a request's load is its
  sparse `query` (the requester's own copy first, other holders spread by load);
- a pool's eviction: `kvpool_plan.eviction.PoolLRU`, NodePool's policy without its memory,
  and with `SimConfig.disk_bytes` its disk tier and the hand-off to it
  (`kvpool_plan.eviction.DiskLRU`, `TieredPool`; tests run a real NodePool beside them);
- routing: `router.policy` (round-robin, least-loaded, prefix) on `router.backends.Backend`
  objects whose counters move as the router's do (`router.app`), the prefix policy reading
  the simulated index through the same calls as the router's index view;
- what a request loads, as the connector does (`connector.pool_scheduler`): its local hit
  (the longest prefix held in its node's KV cache, an LRU of `--kv-cache` bytes), then
  `QueryResult.run_from` that block (the run the index holds from there, never across a
  gap), never the block holding the prompt's last token; the newly computed full blocks are
  saved into the node's pool (write-through, prompt at the first token, output at the
  end); a local hit touches its blocks in the node's pool, and those the index held nowhere
  are saved again (the "Recency" rule).
- the oracles: `kvpool_bench.workloads.lru_hits` / `belady_hits` over the same chains (the
  infinite one is LRU with no limit), for the capacity of all caches and pools together.

Prompts: each hash id of the trace becomes `tokens_per_hash_id` tokens, as `kvpool bench
cross-node` maps them (`workloads.mooncake_trace`), cut at `max_prompt_tokens`. The block
ending at token t is named by the hash id holding t and t's offset in it (a hash id names
its chunk together with everything before it, so this is the chained hash's identity,
without hashing tokens; `tests/plan` checks it against the token-level oracle). Output
blocks are new to every request (a model's output is not in the trace).

Loads are asynchronous, as both real engines' (`SimConfig.async_loads`, on by default):
- the index is looked up at arrival (the connector's `on_new_request`); the request joins
  its node's queue;
- at the first step boundary after arrival (at once on an idle node: where the engine's
  scheduler first considers it), its local hit is read from the node's KV cache and, if the
  arrival's lookup holds a run after it, the load is issued (the step's `begin_step`): the
  request leaves the queue (WAITING_FOR_REMOTE_KVS) while the node keeps stepping the
  others. A block that left its pool since the lookup is a failed read (with disk tiers:
  its holder has it in neither tier, or another node's DRAM copy left DRAM): the hit ends
  there and the rest is recomputed;
- when the load has finished it goes back into the queue in its arrival place, so it is
  prefilled (only the tokens no tier held) at the first step boundary after the load, if
  nothing that arrived before it waits;
- a request the connector offered nothing is prefilled from the queue as before, its local
  hit read when its prefill starts.
With `async_loads=False`, the first version's model: the lookup and the load are made when
the prefill starts, inside the engine step that prefills.

Simplifications (each a place where the real cluster may differ):
- a node runs engine steps one after another; a step prefills at most one prompt (the next
  queued, first come first served), whole (no chunked prefill, no batch of prompts), and
  gives every request already generating there one token: it costs the prompt's prefill
  (by the tokens it computes; its load too with `async_loads=False`) plus the decode step
  at that batch. So prefills stall decodes and decodes slow prefills, as in a mixed batch;
  TPOT is (end - first token) / (output tokens - 1);
- a load is `latency + bytes / link rate` of the reader's link (own-pool blocks at the
  memcpy rate, disk blocks as below), parallel sources sharing that link; a node's loads
  run one after another (one starts when the one before it has finished), so loads that
  overlap share the link as a whole without modelling their interleaving; a failed read
  costs no time;
- the local hit of a loading request is kept while it loads (the engine has allocated its
  blocks), but a node's KV cache is otherwise an LRU of blocks with nothing pinned (running
  requests' blocks can be evicted from it while they decode; the engine would keep them);
- the disk tier (`SimConfig.disk_bytes` per node, under the node's pool; none without a
  pool), as NodePool runs it (`kvpool_plan.eviction`): blocks evicted from DRAM go to the
  disk and are published as DISK; a block in DRAM is published as DRAM (also when a disk
  copy exists); the disk evicts its LRU block for each write and unpublishes it unless DRAM
  holds it; a node with a disk tier stages (its registration names a stage service), so the
  index offers its DISK copies to other readers when no DRAM copy exists, and the prefix
  policy prices disk reads (`router.policy.DISK_COST`) from the same index. A load reads the
  node's own blocks from DRAM, else from its disk (promoted into DRAM: a put, with its
  evictions); another node's DISK copy is staged by its holder (promoted there, published
  as DRAM) and pulled. Its cost: each disk block `disk_read_latency_s + bytes /
  disk_read_bytes_per_s` of the profile, one after another, added to the load (another
  node's on top of its pull over the link). Simplified: the disk writer keeps up (an evicted
  block is on disk before the next eviction; the real tier writes on its own threads and
  drops offers when its staging buffers are full) and costs no time; the connector's
  prefetch of other nodes' disk blocks (staged at lookup) is not modelled apart from the
  load (staged when the load reads them); a holder's disk, like its link, serves its
  readers without contention; slot generations are not modelled (a block is read from
  whichever tier holds it when the load is issued, the tiers decided before the load's
  promotions move anything); no warm restart, no disk errors.

TTFT = queueing (earlier prompts, the step under way) + load + the wait for the step
boundary after it + prefill (+ the decode step it shares); the report states per-tier hits
in prompt tokens, as `kvpool bench cross-node` counts them (own DRAM pool, own disk, other
nodes' DRAM, other nodes' disks apart).
"""
from __future__ import annotations

import heapq
import itertools
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.disk_file import disk_slot_bytes
from kvpool.layout import slot_bytes_for
from kvpool_bench.report import TPOT_SLO_S, TTFT_SLO_S, pct
from kvpool_bench.workloads import belady_hits, lru_hits
from kvpool_plan.eviction import Change, DiskLRU, PoolLRU, TieredPool
from kvpool_plan.profile import ModelProfile
from metaserver.index import BlockIndex
from metaserver.types import BlockHash, BlockLocation, BlockRecord, Medium, Namespace, NodeId, NodeRecord
from router.backends import Backend
from router.chain import Chain
from router.policy import Choice, Policy, make_policy

NAMESPACE = Namespace("plan")
EVICT_BATCH = 16  # kvpool.config.PoolConfig.evict_batch's default


@dataclass(slots=True)
class SimRequest:
    idx: int
    arrival_s: float
    num_tokens: int                 # prompt tokens
    output_tokens: int
    hashes: tuple                   # the prompt's full blocks, chained from block 0
    out_hashes: tuple = ()          # full blocks its output fills (new to every request)
    # filled in by the replay
    node: int = -1
    choice: Choice | None = None
    local_blocks: int = 0           # in the node's KV cache
    own_pool_blocks: int = 0        # read from the node's own pool's DRAM
    remote_blocks: int = 0          # pulled from other nodes' DRAM
    own_disk_blocks: int = 0        # read from the node's own disk tier (and promoted)
    remote_disk_blocks: int = 0     # staged by other nodes from their disks, then pulled
    computed_tokens: int = 0
    start_s: float = 0.0
    first_token_s: float = 0.0
    end_s: float = 0.0
    tpot_s: float = 0.0             # (end - first token) / (output tokens - 1)
    left: int = 0                   # output tokens still to generate
    # asynchronous loads (SimConfig.async_loads)
    lookup: object = None           # the index's QueryResult at arrival (None: nothing to look up)
    considered: bool = False        # the node's scheduler has read its hits (its load issued, if any)
    loaded: bool = False            # its load has finished: prefill only what no tier held
    load_start_s: float = 0.0       # its load on the node's link (after the loads before it)
    load_end_s: float = 0.0
    failed_blocks: int = 0          # blocks the lookup offered that had left their pool by the load

    @property
    def pool_blocks(self) -> int:
        """Blocks loaded from any pool tier (not the node's KV cache)."""
        return self.own_pool_blocks + self.own_disk_blocks + self.remote_blocks + self.remote_disk_blocks


def build_requests(rows: Sequence[dict], block_size: int, tokens_per_hash_id: int = 16, max_prompt_tokens: int = 0,
                   max_output_tokens: int = 0, time_scale: float = 1.0) -> list[SimRequest]:
    """The trace's rows as requests (see the module docstring); `max_*` 0 = no limit."""
    if block_size < 1 or tokens_per_hash_id < 1 or max_prompt_tokens < 0 or max_output_tokens < 0 or time_scale < 0:
        raise ValueError("block size and tokens per hash id must be >= 1, limits and the time scale >= 0")
    out_ids = itertools.count(-1, -1)  # output blocks: negative names, never equal to a prompt's
    tpi = tokens_per_hash_id
    reqs = []
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids) \
                or not isinstance(row["timestamp"], (int, float)) or not isinstance(row["output_length"], (int, float)):
            raise ValueError(f"trace row {i + 1}: hash_ids must be a list of integers >= 0, timestamp and "
                             "output_length numbers")
        n = len(ids) * tpi
        if max_prompt_tokens:
            n = min(n, max_prompt_tokens)
        if n < 1:
            raise ValueError(f"trace row {i + 1}: no hash ids")
        hashes = []
        for j in range(n // block_size):
            t = (j + 1) * block_size - 1   # the block's last token
            hashes.append(ids[t // tpi] * tpi + t % tpi)
        out = max(1, int(row["output_length"]))
        if max_output_tokens:
            out = min(out, max_output_tokens)
        # the engine computes the prompt and the output but its last token
        full = (n + out - 1) // block_size
        reqs.append(SimRequest(i, row["timestamp"] / 1000.0 * time_scale, n, out, tuple(hashes),
                               tuple(next(out_ids) for _ in range(full - len(hashes)))))
    return reqs


class IndexAdapter:
    """The calls `router.policy.Prefix` makes on `metaserver.view.IndexView`, answered by the
    simulated cluster's index."""

    def __init__(self, index: BlockIndex, namespace: Namespace = NAMESPACE) -> None:
        self.index = index
        self.namespace = namespace

    def prefix_by_node(self, chain: Sequence[bytes]) -> tuple[int, dict[NodeId, int]]:
        return self.index.prefix_by_node(self.namespace, chain)

    def present(self, chain: Sequence[bytes]) -> list[bool]:
        return self.index.present(self.namespace, chain)

    def disk(self, chain: Sequence[bytes]) -> tuple[list[bool], dict[NodeId, set[int]]]:
        return self.index.disk(self.namespace, [BlockHash(h) for h in chain])


@dataclass
class SimConfig:
    nodes: int
    kv_cache_bytes: int
    pool_bytes: int
    policy: str
    profile: ModelProfile
    evict_batch: int = EVICT_BATCH
    async_loads: bool = True        # False: the load inside the prefill's step (the first version)
    disk_bytes: int = 0             # each node's disk tier (0: none; none without a pool either)

    def __post_init__(self) -> None:
        bb = self.profile.block_bytes
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.kv_cache_bytes < bb:
            raise ValueError(f"--kv-cache {self.kv_cache_bytes} B holds no {bb}-byte block")
        if self.pool_bytes < 0:
            raise ValueError("--pool must be >= 0")
        if self.disk_bytes < 0:
            raise ValueError("--disk must be >= 0")

    @property
    def kv_blocks(self) -> int:
        return self.kv_cache_bytes // self.profile.block_bytes

    @property
    def pool_slots(self) -> int:
        """Slots of one node's pool (0: the pool is off), as NodePool sizes them."""
        return self.pool_bytes // slot_bytes_for(self.profile.block_bytes)

    @property
    def disk_slots(self) -> int:
        """Slots of one node's disk tier, as DiskTier sizes them (0: no tier; a tier sits
        under a pool, so none when the pool is off)."""
        if not self.pool_slots:
            return 0
        return self.disk_bytes // disk_slot_bytes(self.profile.block_bytes)


class SimNode:
    def __init__(self, i: int, cfg: SimConfig) -> None:
        self.i = i
        self.node_id = NodeId(f"n{i}")
        self.backend = Backend(f"sim://{self.node_id}", node_id=self.node_id, cache_blocks=cfg.kv_blocks)
        self.kv: OrderedDict = OrderedDict()
        self.kv_cap = cfg.kv_blocks
        self.pool = PoolLRU(cfg.pool_slots, cfg.evict_batch) if cfg.pool_slots else None
        self.disk = DiskLRU(cfg.disk_slots) if cfg.disk_slots else None
        self.tiers = TieredPool(self.pool, self.disk) if self.pool is not None else None
        self.queue: deque[SimRequest] = deque()     # waiting for their prefill
        self.decoding: list[SimRequest] = []         # generating
        self.busy = False                            # a step is under way
        self.prefill: SimRequest | None = None       # the step's prefill
        self.batch: list[SimRequest] = []            # the step's decode batch
        self.link_free_s = 0.0                       # when the loads issued so far have finished

    def kv_prefix(self, hashes: Sequence) -> int:
        kv = self.kv
        n = 0
        for h in hashes:
            if h not in kv:
                break
            n += 1
        return n

    def kv_insert(self, hashes: Sequence) -> None:
        kv = self.kv
        for h in hashes:
            kv[h] = None
            kv.move_to_end(h)
        while len(kv) > self.kv_cap:
            kv.popitem(last=False)


@dataclass
class SimResult:
    requests: list[SimRequest]
    config: SimConfig
    link_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    pool_evictions: int = 0
    pool_puts: int = 0
    end_s: float = 0.0
    disk_writes: int = 0
    disk_evictions: int = 0


_ARRIVE, _STEP_DONE, _LOAD_DONE = 0, 1, 2


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.profile = cfg.profile
        self.bs = cfg.profile.block_size
        self.index = BlockIndex()
        self.nodes = [SimNode(i, cfg) for i in range(cfg.nodes)]
        self._by_id = {n.node_id: n for n in self.nodes}
        self.record_size = slot_bytes_for(cfg.profile.block_bytes)
        for n in self.nodes:
            # a pool with a disk tier serves stage requests (NodePool.start): the index offers
            # its DISK copies to other readers only then
            stage = f"sim://{n.node_id}/stage" if n.disk is not None else ""
            self.index.upsert_node(NodeRecord(n.node_id, "", 0, cfg.pool_bytes, NAMESPACE, 0, 0,
                                              stage_address=stage))
        self.policy: Policy = make_policy(cfg.policy, self.bs, IndexAdapter(self.index))  # type: ignore[arg-type]
        self.link_bytes: dict[tuple[str, str], int] = {}
        self._events: list[tuple[float, int, int, SimNode | None, SimRequest]] = []
        self._seq = itertools.count()
        self._pending: deque[SimRequest] = deque()  # closed loop: requests not sent yet
        self._now = 0.0

    # ---- the pools --------------------------------------------------------------------

    def _save(self, node: SimNode, hashes: Sequence) -> None:
        """Write-through: each block into the node's pool, published; evictions unpublished
        (and handed to its disk tier, if it has one)."""
        tiers = node.tiers
        if tiers is None:
            return
        for h in hashes:
            self._apply(node, tiers.put(h)[1])

    def _apply(self, node: SimNode, changes: list[Change]) -> None:
        """The index changes a node's pool made, in its order (its publishes and unpublishes)."""
        index, nid, size = self.index, node.node_id, self.record_size
        for h, medium in changes:
            if medium is None:
                index.remove_block(nid, h)  # type: ignore[arg-type]
            else:
                index.add_block(nid, BlockRecord(BlockHash(h), 0, size, 0, medium))  # type: ignore[arg-type]

    def _source(self, node: SimNode, loc: BlockLocation) -> Medium | None:
        """The tier a load reads `loc`'s block from now; None: a failed read. The node's own
        copy: from DRAM, else from its disk (`NodePool.get`); another node's DRAM copy: from
        its DRAM only (one-sided, validated); its DISK copy: from its DRAM if the block is
        back there, else from its disk (`TierReads.stage`)."""
        holder = self._by_id[loc.node_id].tiers
        if holder is None:
            return None
        h = loc.block_hash
        if h in holder.dram:
            return Medium.DRAM
        if holder.disk is not None and h in holder.disk and (loc.node_id == node.node_id or loc.medium):
            return Medium.DISK
        return None

    # ---- the event loop ---------------------------------------------------------------

    def _push(self, t: float, kind: int, node: SimNode | None, req: SimRequest) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, node, req))

    def run(self, requests: Sequence[SimRequest], concurrency: int = 0) -> SimResult:
        """Arrivals at the requests' times; with `concurrency`, a closed loop instead (as
        `kvpool bench cross-node` without --time-scale): that many requests in flight, in
        trace order, the next sent when one ends."""
        if concurrency:
            self._pending = deque(requests)
            for _ in range(min(concurrency, len(requests))):
                self._release(0.0)
        else:
            for r in requests:
                self._push(r.arrival_s, _ARRIVE, None, r)
        now = 0.0
        events = self._events
        while events:
            now, _, kind, node, req = heapq.heappop(events)
            self._now = now
            if kind == _ARRIVE:
                assert req is not None
                self._arrive(now, req)
            elif kind == _LOAD_DONE:
                assert node is not None and req is not None
                self._load_done(now, node, req)
            else:
                assert node is not None
                self._step_done(now, node)
        pools = [n.pool for n in self.nodes if n.pool is not None]
        disks = [n.disk for n in self.nodes if n.disk is not None]
        return SimResult(list(requests), self.cfg, self.link_bytes, sum(p.evictions for p in pools),
                         sum(p.puts for p in pools), now, sum(d.writes for d in disks),
                         sum(d.evictions for d in disks))

    def _release(self, now: float) -> None:
        req = self._pending.popleft()
        req.arrival_s = now
        self._push(now, _ARRIVE, None, req)

    def _arrive(self, now: float, req: SimRequest) -> None:
        chain = Chain(req.hashes, req.num_tokens)  # type: ignore[arg-type]
        backends = [n.backend for n in self.nodes]
        choice = self.policy.choose(backends, chain)
        b = choice.node
        b.in_flight += 1
        b.prefilling += choice.compute_tokens
        b.requests += 1
        self.policy.routed(b, chain)
        req.choice = choice
        node = self._by_id[NodeId(b.node_id)]
        req.node = node.i
        if self.cfg.async_loads:
            # the connector's lookup at arrival (`on_new_request`); a failed read if a block
            # leaves its pool before the load reads it
            end = (req.num_tokens - 1) // self.bs
            if end:
                req.lookup = self.index.query(NAMESPACE, req.hashes[:end], requester=node.node_id, sparse=True)
        node.queue.append(req)
        if not node.busy:
            self._step(now, node)

    def _step(self, now: float, node: SimNode) -> None:
        """The node's next engine step: the next queued prompt's load and prefill (if one
        waits) and a token for each request generating there; idle if there is neither."""
        if self.cfg.async_loads:
            self._issue_loads(now, node)
        if not node.queue and not node.decoding:
            node.busy = False
            return
        node.busy = True
        dur = 0.0
        node.prefill = None
        if node.queue:
            node.prefill = node.queue.popleft()
            if self.cfg.async_loads:
                dur += self._prefill(now, node, node.prefill)
            else:
                dur += self._load_and_prefill(now, node, node.prefill)
        node.batch = list(node.decoding)
        if node.batch:
            dur += self.profile.decode_step_s(len(node.batch))
        self._push(now + dur, _STEP_DONE, node, None)

    def _step_done(self, now: float, node: SimNode) -> None:
        if node.batch:
            for r in node.batch:
                r.left -= 1
                if not r.left:
                    self._finish(now, node, r)
            node.decoding = [r for r in node.decoding if r.left]
        if node.prefill is not None:
            self._first_token(now, node, node.prefill)
        self._step(now, node)

    def _load_and_prefill(self, now: float, node: SimNode, req: SimRequest) -> float:
        """Look `req` up as the connector does, count its hits and pulls; its load and
        prefill time."""
        bs = self.bs
        end = (req.num_tokens - 1) // bs  # the block holding the last token is always computed
        chain = req.hashes[:end]
        local = node.kv_prefix(chain)
        run: tuple = ()
        if end > local:
            res = self.index.query(NAMESPACE, chain, requester=node.node_id, sparse=True)
            run = res.run_from(local)
            if local:
                self._refresh(node, chain[:local], res.held)
        # (a prompt whose every block that can hit is a local hit refreshes nothing: the
        # connector's num_matched_tokens returns before it plans the refresh)
        req.start_s = now
        return self._book_run(node, req, local, run) + self.profile.prefill_s(req.computed_tokens)

    def _book_run(self, node: SimNode, req: SimRequest, local: int, run: Sequence) -> float:
        """Count `req`'s hits per tier (`local` blocks in the node's KV cache, then `run`, each
        block read where `_source` finds it: every one readable), book the pulled bytes on
        their links, make the reads' changes to the pools; returns the load's time."""
        bb = self.profile.block_bytes
        links = self.link_bytes
        me = node.node_id
        own_dram: list = []
        own_disk: list = []
        staged: dict[NodeId, list] = {}  # per holder, its disk blocks it stages (in run order)
        remote = 0
        # Every tier decided before a promotion moves any block. (A block gone since the lookup
        # counts as a DRAM read, as before there was a disk: with --sync-loads the Recency saves
        # made between lookup and load can evict one; async loads cut the run there instead.)
        for loc in run:
            on_disk = self._source(node, loc) == Medium.DISK
            if loc.node_id == me:
                (own_disk if on_disk else own_dram).append(loc.block_hash)
                continue
            key = (loc.node_id, me)
            links[key] = links.get(key, 0) + bb
            if on_disk:
                staged.setdefault(loc.node_id, []).append(loc.block_hash)
            else:
                remote += 1
        self._read_tiers(node, own_dram, own_disk, staged)
        remote_disk = sum(len(hs) for hs in staged.values())
        req.local_blocks, req.own_pool_blocks, req.remote_blocks = local, len(own_dram), remote
        req.own_disk_blocks, req.remote_disk_blocks = len(own_disk), remote_disk
        req.computed_tokens = req.num_tokens - (local + req.pool_blocks) * self.bs
        disk = len(own_disk) + remote_disk
        return self.profile.pull_s((remote + remote_disk) * bb, len(own_dram) * bb) + \
            self.profile.disk_read_s(disk * bb, disk)

    def _read_tiers(self, node: SimNode, own_dram: list, own_disk: list, staged: dict[NodeId, list]) -> None:
        """A load's reads' changes to the pools, in `NodePool.get`'s order: the node's DRAM
        blocks at once (to its LRU's end), then its disk blocks (promoted into its DRAM),
        then other nodes' disk blocks (each holder promotes them, in turn); a one-sided read of
        another node's DRAM changes nothing there."""
        tiers = node.tiers
        if tiers is not None:
            tiers.touch(own_dram)
            for h in own_disk:
                self._apply(node, tiers.read_own(h)[1])
        for nid, hashes in staged.items():
            holder = self._by_id[nid]
            assert holder.tiers is not None
            for h in hashes:
                self._apply(holder, holder.tiers.stage(h)[1])

    def _issue_loads(self, now: float, node: SimNode) -> None:
        """At a step boundary, the scheduler's first look at each request queued since the
        last: its local hit, then the run the arrival's lookup holds after it; a request with
        such a run leaves the queue while its load runs (WAITING_FOR_REMOTE_KVS)."""
        if all(r.considered for r in node.queue):
            return
        bs = self.bs
        keep: deque[SimRequest] = deque()
        for req in node.queue:
            if req.considered:
                keep.append(req)
                continue
            req.considered = True
            end = (req.num_tokens - 1) // bs
            chain = req.hashes[:end]
            local = node.kv_prefix(chain)
            run: tuple = ()
            res = req.lookup
            if end > local and res is not None:
                run = res.run_from(local)  # type: ignore[attr-defined]
                if local:
                    self._refresh(node, chain[:local], res.held)  # type: ignore[attr-defined]
            # the load reads each block from its source; one gone since the lookup fails, and
            # the hit ends there (vLLM's recompute policy recomputes from the first failed block)
            ok = 0
            for loc in run:
                if self._source(node, loc) is None:
                    break
                ok += 1
            req.failed_blocks = len(run) - ok
            run = run[:ok]
            if not run:
                keep.append(req)  # nothing to load: prefilled from the queue, its local hit read then
                continue
            load_s = self._book_run(node, req, local, run)
            # the node's loads one after another: overlapping loads share its link
            req.load_start_s = max(now, node.link_free_s)
            req.load_end_s = node.link_free_s = req.load_start_s + load_s
            self._push(req.load_end_s, _LOAD_DONE, node, req)
        node.queue = keep

    def _load_done(self, now: float, node: SimNode, req: SimRequest) -> None:
        """The load has finished: back into the queue in its arrival place (vLLM keeps a
        waiting request's place), prefilled from the next step boundary."""
        req.loaded = True
        q = node.queue
        at = len(q)
        while at and (q[at - 1].arrival_s, q[at - 1].idx) > (req.arrival_s, req.idx):
            at -= 1
        q.insert(at, req)
        if not node.busy:
            self._step(now, node)

    def _prefill(self, now: float, node: SimNode, req: SimRequest) -> float:
        """The prefill's time of `req` (async loads): after its load, the tokens no tier held;
        else its local hit, read now (the connector offered it nothing)."""
        req.start_s = now
        if not req.loaded:
            end = (req.num_tokens - 1) // self.bs
            req.local_blocks = node.kv_prefix(req.hashes[:end])
            req.own_pool_blocks = req.remote_blocks = req.own_disk_blocks = req.remote_disk_blocks = 0
            req.computed_tokens = req.num_tokens - req.local_blocks * self.bs
        return self.profile.prefill_s(req.computed_tokens)

    def _refresh(self, node: SimNode, hashes: Sequence, held: Sequence) -> None:
        """The connector's Recency rule: a local hit touches its blocks in the node's pool (in
        DRAM, else on its disk: `NodePool.touch`) and saves again those the index held nowhere
        at lookup time."""
        if node.tiers is None:
            return
        node.tiers.touch(hashes)
        lacking = [h for j, h in enumerate(hashes) if j >= len(held) or held[j] is None]
        if lacking:
            self._save(node, lacking)

    def _first_token(self, now: float, node: SimNode, req: SimRequest) -> None:
        req.first_token_s = now
        full = req.hashes  # every full prompt block is in the node's cache now
        node.kv_insert(full)
        done = req.local_blocks + req.pool_blocks
        self._save(node, full[done:])
        b = node.backend
        assert req.choice is not None
        b.prefilling -= req.choice.compute_tokens
        b.decoding += 1
        b.predicted_hit_tokens += req.choice.predicted_hit_tokens
        if req.output_tokens > 1:
            req.left = req.output_tokens - 1
            node.decoding.append(req)
        else:
            self._finish(now, node, req)

    def _finish(self, now: float, node: SimNode, req: SimRequest) -> None:
        req.end_s = now
        if req.output_tokens > 1:
            req.tpot_s = (now - req.first_token_s) / (req.output_tokens - 1)
        if req.out_hashes:
            node.kv_insert(req.out_hashes)
            self._save(node, req.out_hashes)
        b = node.backend
        b.in_flight -= 1
        b.decoding -= 1
        if self._pending:
            self._release(now)


def simulate(requests: Sequence[SimRequest], cfg: SimConfig, concurrency: int = 0) -> SimResult:
    """Replay `requests` (fresh ones: the replay fills them in) on a new simulated cluster;
    `concurrency`: a closed loop of that many requests in flight (`Simulator.run`)."""
    return Simulator(cfg).run(requests, concurrency)


# ---- the report ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """As `kvpool bench` computes percentiles (`kvpool_bench.report.pct`); 0 for no values."""
    return pct(list(values), q) if values else 0.0


def oracles(requests: Sequence[SimRequest], block_size: int, capacity_blocks: int) -> dict[str, float]:
    """Hit rates (of prompt tokens) of a shared cache: infinite, and LRU / Belady of
    `capacity_blocks` blocks (`kvpool_bench.workloads`)."""
    refs = [r.hashes[:(r.num_tokens - 1) // block_size] for r in requests]
    puts = [r.hashes + r.out_hashes for r in requests]
    total = sum(r.num_tokens for r in requests) or 1
    out = {"infinite": sum(lru_hits(refs, puts, sys.maxsize)) * block_size / total}
    cap = max(1, capacity_blocks)
    out["lru"] = sum(lru_hits(refs, puts, cap)) * block_size / total
    out["belady"] = sum(belady_hits(refs, puts, cap)) * block_size / total
    return out


def summarize(res: SimResult, with_oracles: bool = True, ttft_slo_s: float = TTFT_SLO_S,
              tpot_slo_s: float = TPOT_SLO_S) -> dict:
    """The replay's report. Hits in prompt tokens per tier: `hit_local_tokens` (the node's KV
    cache), `hit_own_pool_tokens` (its own pool's DRAM), `hit_remote_tokens` (other nodes'
    DRAM), `hit_own_disk_tokens` / `hit_remote_disk_tokens` (its own / other nodes' disk
    tiers); `hit_rate` counts them all, `hit_rate_pool` every pool tier, and `hit_rate_*`
    each. `capacity_blocks` (the oracles') is every KV cache, pool and disk tier together.
    `goodput_rps`: the requests within both `ttft_slo_s` and `tpot_slo_s` (`slo_met`) per
    second of simulated time."""
    reqs = res.requests
    cfg = res.config
    bs = cfg.profile.block_size
    prompt = sum(r.num_tokens for r in reqs) or 1
    local = sum(r.local_blocks for r in reqs) * bs
    own = sum(r.own_pool_blocks for r in reqs) * bs
    remote = sum(r.remote_blocks for r in reqs) * bs
    own_disk = sum(r.own_disk_blocks for r in reqs) * bs
    remote_disk = sum(r.remote_disk_blocks for r in reqs) * bs
    pool = own + remote + own_disk + remote_disk
    ttft = [r.first_token_s - r.arrival_s for r in reqs]
    tpot = [r.tpot_s for r in reqs if r.output_tokens > 1]
    # goodput as `kvpool bench pd` counts it: requests within both objectives, per second
    # (of the simulated time; a one-token answer has no TPOT and meets that objective)
    good = sum(t <= ttft_slo_s and r.tpot_s <= tpot_slo_s for t, r in zip(ttft, reqs, strict=True))
    # queueing: the wait for the prefill's step, the load itself left out (as it was
    # when the load was part of that step)
    queue = [r.start_s - r.arrival_s - (r.load_end_s - r.load_start_s) for r in reqs]
    loads = [r.load_end_s - r.arrival_s for r in reqs if r.loaded]
    failed = sum(r.failed_blocks for r in reqs) * bs
    into: dict[str, int] = {}
    out_of: dict[str, int] = {}
    for (src, dst), b in res.link_bytes.items():
        into[dst] = into.get(dst, 0) + b
        out_of[src] = out_of.get(src, 0) + b
    capacity = cfg.nodes * (cfg.kv_blocks + cfg.pool_slots + cfg.disk_slots)
    s = {
        "nodes": cfg.nodes, "policy": cfg.policy, "profile": cfg.profile.name, "requests": len(reqs),
        "kv_cache_blocks_per_node": cfg.kv_blocks, "pool_slots_per_node": cfg.pool_slots,
        "disk_slots_per_node": cfg.disk_slots, "capacity_blocks": capacity,
        "prompt_tokens": prompt, "hit_local_tokens": local, "hit_own_pool_tokens": own,
        "hit_remote_tokens": remote, "hit_own_disk_tokens": own_disk, "hit_remote_disk_tokens": remote_disk,
        "computed_tokens": prompt - local - pool,
        "hit_rate": (local + pool) / prompt, "hit_rate_local": local / prompt,
        "hit_rate_pool": pool / prompt, "hit_rate_own_pool": own / prompt, "hit_rate_remote": remote / prompt,
        "hit_rate_own_disk": own_disk / prompt, "hit_rate_remote_disk": remote_disk / prompt,
        "hit_rate_disk": (own_disk + remote_disk) / prompt,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "queue_p50_s": percentile(queue, 50), "queue_p99_s": percentile(queue, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s, "slo_met": good,
        "goodput_rps": good / res.end_s if res.end_s > 0 else 0.0,
        "async_loads": cfg.async_loads, "loads": len(loads),
        "load_done_p50_s": percentile(loads, 50), "load_done_p99_s": percentile(loads, 99),
        "failed_read_tokens": failed,
        "bytes_moved": sum(res.link_bytes.values()), "links_used": len(res.link_bytes),
        "link_bytes_max": max(res.link_bytes.values(), default=0),
        "node_in_bytes_max": max(into.values(), default=0), "node_out_bytes_max": max(out_of.values(), default=0),
        "pool_puts": res.pool_puts, "pool_evictions": res.pool_evictions, "simulated_s": res.end_s,
        "disk_writes": res.disk_writes, "disk_evictions": res.disk_evictions,
        "requests_per_node": [n for n in (sum(1 for r in reqs if r.node == i) for i in range(cfg.nodes))],
        "link_bytes": {f"{a}->{b}": v for (a, b), v in sorted(res.link_bytes.items())},
    }
    if with_oracles:
        o = oracles(reqs, bs, capacity)
        s.update({"oracle_infinite": o["infinite"], "oracle_lru": o["lru"], "oracle_belady": o["belady"]})
    return s
