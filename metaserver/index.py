"""The in-memory block index: namespace -> block hash -> the nodes holding it.

Where it sits: every QueryPrefix is answered from here and never waits for etcd. Changes
arrive from this replica's RPCs and from the etcd watch (other replicas, lease expiry);
every method is idempotent so that a change seen twice is harmless.

With a `feed` (metaserver.feed), every change is also appended there, for WatchIndex
streams; a node-local read view (metaserver.view) is a BlockIndex without one.

Not thread-safe: the metaserver calls it holding its service lock.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import cast

from metaserver.feed import IndexFeed, Kind
from metaserver.types import (BlockHash, BlockLocation, BlockRecord, IndexStats, Medium, Namespace,
                              NamespaceStats, NodeId, NodeRecord, QueryResult)


class BlockIndex:
    def __init__(self, feed: IndexFeed | None = None) -> None:
        self.feed = feed
        self.nodes: dict[NodeId, NodeRecord] = {}
        # namespace -> hash -> node -> location
        self._blocks: dict[Namespace, dict[BlockHash, dict[NodeId, BlockLocation]]] = {}
        self._node_hashes: dict[NodeId, set[BlockHash]] = {}
        # Blocks handed out as a read source since start: spreads reads across holders.
        self._source_load: dict[NodeId, int] = {}
        # Nodes a reader could not read from: not offered until this (monotonic) time.
        self._suspect: dict[NodeId, float] = {}

    # ---- nodes ----------------------------------------------------------------------

    def upsert_node(self, node: NodeRecord) -> list[BlockHash]:
        """Add or replace a node record; returns blocks dropped because the node's
        namespace or buffer changed or it started draining (its old slots are meaningless)."""
        old = self.nodes.get(node.node_id)
        dropped: list[BlockHash] = []
        if old is not None and (old.namespace != node.namespace or old.buffer_address != node.buffer_address
                                or old.session_address != node.session_address
                                or (node.draining and not old.draining)):
            dropped = self.remove_node_blocks(node.node_id)
            if self.feed is not None and old.namespace != node.namespace:
                self.feed.append(old.namespace, Kind.NODE_GONE, node.node_id)
        self.nodes[node.node_id] = node
        if self.feed is not None and node != old:
            self.feed.append(node.namespace, Kind.NODE, node.node_id, node)
        self._node_hashes.setdefault(node.node_id, set())
        self._source_load.setdefault(node.node_id, 0)
        return dropped

    def remove_node(self, node_id: NodeId) -> list[BlockHash]:
        """Forget a node and every block it held; returns those blocks."""
        dropped = self.remove_node_blocks(node_id)
        node = self.nodes.pop(node_id, None)
        if self.feed is not None and node is not None:
            self.feed.append(node.namespace, Kind.NODE_GONE, node_id)
        self._node_hashes.pop(node_id, None)
        self._source_load.pop(node_id, None)
        self._suspect.pop(node_id, None)
        return dropped

    def mark_suspect(self, node_id: NodeId, for_s: float) -> bool:
        """No query offers the node's blocks for `for_s` seconds (or until `clear_suspect`);
        its entries stay, so a node that was only frozen is a source again at once when it
        answers. False if the node is unknown."""
        if node_id not in self.nodes:
            return False
        self._suspect[node_id] = time.monotonic() + for_s
        if self.feed is not None:
            self.feed.append(self.nodes[node_id].namespace, Kind.SUSPECT, node_id, for_s)
        return True

    def clear_suspect(self, node_id: NodeId) -> bool:
        """The node showed it is alive (a keepalive): offer its blocks again. True if it was suspect."""
        was = self._suspect.pop(node_id, None) is not None
        if was and self.feed is not None and node_id in self.nodes:
            self.feed.append(self.nodes[node_id].namespace, Kind.TRUST, node_id)
        return was

    def suspects(self) -> list[NodeId]:
        """Nodes suspect now (expired marks are dropped)."""
        now = time.monotonic()
        self._suspect = {n: t for n, t in self._suspect.items() if t > now}
        return sorted(self._suspect)

    # ---- blocks ---------------------------------------------------------------------

    def add_block(self, node_id: NodeId, rec: BlockRecord) -> bool:
        """Record that `node_id` holds `rec`; False (and no change) if the node is unknown."""
        node = self.nodes.get(node_id)
        if node is None:
            return False
        loc = BlockLocation(rec.block_hash, node_id, rec.offset, rec.size_bytes, rec.generation, rec.medium)
        holders = self._blocks.setdefault(node.namespace, {}).setdefault(rec.block_hash, {})
        if self.feed is not None and holders.get(node_id) != loc:  # a change seen twice is sent once
            self.feed.append(node.namespace, Kind.ADD, node_id, rec)
        holders[node_id] = loc
        self._node_hashes[node_id].add(rec.block_hash)
        return True

    def remove_block(self, node_id: NodeId, block_hash: BlockHash) -> bool:
        """Drop one copy; True if it was present."""
        node = self.nodes.get(node_id)
        hashes = self._node_hashes.get(node_id)
        if node is None or hashes is None or block_hash not in hashes:
            return False
        hashes.discard(block_hash)
        if self.feed is not None:
            self.feed.append(node.namespace, Kind.REMOVE, node_id, block_hash)
        ns_map = self._blocks.get(node.namespace, {})
        holders = ns_map.get(block_hash)
        if holders is not None:
            holders.pop(node_id, None)
            if not holders:
                del ns_map[block_hash]
                if not ns_map:
                    self._blocks.pop(node.namespace, None)
        return True

    def remove_node_blocks(self, node_id: NodeId) -> list[BlockHash]:
        hashes = list(self._node_hashes.get(node_id, ()))
        for h in hashes:
            self.remove_block(node_id, h)
        return hashes

    def remove_hashes(self, namespace: Namespace, hashes: Iterable[BlockHash]) -> list[tuple[NodeId, BlockHash]]:
        """Drop every copy of `hashes` in `namespace`; returns the (node, hash) pairs dropped,
        each once (a hash given twice is dropped once)."""
        ns_map = self._blocks.get(namespace, {})
        dropped = [(node_id, h) for h in dict.fromkeys(hashes) for node_id in list(ns_map.get(h, ()))]
        for node_id, h in dropped:
            self.remove_block(node_id, h)
        return dropped

    def remove_namespace(self, namespace: Namespace) -> list[tuple[NodeId, BlockHash]]:
        return self.remove_hashes(namespace, list(self._blocks.get(namespace, {})))

    def remove_all(self) -> list[tuple[NodeId, BlockHash]]:
        dropped = [(node_id, h) for node_id, hashes in self._node_hashes.items() for h in hashes]
        for node_id in list(self._node_hashes):
            self.remove_node_blocks(node_id)
        return dropped

    # ---- lookups --------------------------------------------------------------------

    def knows_namespace(self, namespace: Namespace) -> bool:
        return namespace in self._blocks or any(n.namespace == namespace for n in self.nodes.values())

    def query(self, namespace: Namespace, chain: Sequence[BlockHash], requester: NodeId | None = None,
              sparse: bool = False) -> QueryResult:
        """The longest prefix of `chain` present in `namespace`, one location per block; with
        `sparse`, also every other block of `chain` present (`QueryResult.held`).

        A block is served from the requester's own copy when it has one (in DRAM or on its
        disk); otherwise from the DRAM holder that has been handed out least so far; failing
        that, from a holder of a DISK copy that stages (the reader asks it to promote the
        block into DRAM first: not in registered memory, a disk copy is never read one-sidedly) (ties: the previous block's source, so
        chains stay on one node and batch well). Suspect nodes (`mark_suspect`) are not
        offered: a block held only by them ends the match, as a missing block does (sparse:
        it is a gap). Side effect: the chosen sources' load counters grow (sparse: for every
        block offered, including those the requester's own cache may make unneeded; the
        counters only spread reads, so the skew is harmless).

        Cost: one C-level pass over the chain's hashes, then one step per block offered; a
        sparse query offers at most len(chain) blocks, so it costs the same order as a
        prefix query of a chain that is fully present.
        """
        ns_map = self._blocks.get(namespace)
        nodes: dict[NodeId, NodeRecord] = {}
        if ns_map is None:
            return QueryResult((), nodes)
        # The holders of the chain's blocks in one C-level pass (a prefix query cuts it at the
        # first missing one): this walk is every lookup's cost (in the metaserver and in every
        # node's view).
        found = list(map(ns_map.get, chain))
        if not sparse and None in found:
            del found[found.index(None):]
        load = self._source_load
        suspect = self.suspects() if self._suspect else ()
        held: list[BlockLocation | None] = []
        append = held.append
        prev: NodeId | None = None
        for holders in found:
            if holders is None:
                append(None)
                continue
            if suspect:
                holders = {n: loc for n, loc in holders.items() if n not in suspect}
                if not holders:
                    if not sparse:
                        break
                    append(None)
                    continue
            if len(holders) == 1:  # the common case, kept short
                ((chosen, loc),) = holders.items()
                if loc.medium and chosen != requester and not self.nodes[chosen].stage_address:
                    if not sparse:  # another node's disk, which it does not stage: unreadable
                        break
                    append(None)
                    continue
            elif requester in holders:
                chosen, loc = requester, holders[requester]  # type: ignore[index]
            else:
                # DRAM copies, else DISK copies whose holder stages them (kvpool.stage).
                sources = ([n for n, c in holders.items() if not c.medium]
                           or [n for n in holders if self.nodes[n].stage_address])
                if not sources:
                    if not sparse:
                        break
                    append(None)
                    continue
                chosen = min(sources, key=lambda n: (load[n], n != prev, n))
                loc = holders[chosen]
            if chosen != requester:
                load[chosen] += 1
            append(loc)
            if chosen != prev:
                nodes[chosen] = self.nodes[chosen]
                prev = chosen
        while held and held[-1] is None:
            held.pop()
        prefix = held.index(None) if None in held else len(held)  # a prefix query has no gap: the loop broke
        return QueryResult(cast(tuple[BlockLocation, ...], tuple(held[:prefix])), nodes,
                           tuple(held) if sparse else ())

    def prefix_by_node(self, namespace: Namespace, chain: Sequence[BlockHash]) -> tuple[int, dict[NodeId, int]]:
        """How much of `chain` the pool holds: the longest present prefix (blocks, any holders)
        and, per node, the blocks it holds itself from block 0 on (what a request routed to it
        would hit without a pull). Suspect nodes count as holding nothing. No side effects."""
        ns_map = self._blocks.get(namespace)
        if ns_map is None:
            return 0, {}
        suspect = self.suspects() if self._suspect else ()
        runs: dict[NodeId, int] = {}
        alive: set[NodeId] | None = None  # nodes holding every block so far
        matched = 0
        for h in chain:
            holders = ns_map.get(h)
            if holders is None:
                break
            keys = holders.keys() - suspect if suspect else holders.keys()
            if not keys:
                break
            if alive is None:
                alive = set(keys)
            else:
                for gone in alive - keys:
                    runs[gone] = matched
                alive &= keys
            matched += 1
        for n in alive or ():
            runs[n] = matched
        return matched, {n: k for n, k in runs.items() if k}

    def present(self, namespace: Namespace, chain: Sequence[BlockHash]) -> list[bool]:
        """Per block of `chain`, whether some node that is not suspect holds it (anywhere in
        the chain: a router predicts the run a node pulls from where its own cache stops) in
        a copy another node can have: in DRAM, or on a disk its holder stages from."""
        ns_map = self._blocks.get(namespace)
        if ns_map is None:
            return [False] * len(chain)
        suspect = self.suspects() if self._suspect else ()
        nodes = self.nodes
        out = []
        for h in chain:
            holders = ns_map.get(h)
            out.append(bool(holders) and any(n not in suspect and (not loc.medium or nodes[n].stage_address)
                                             for n, loc in holders.items()))
        return out

    def disk(self, namespace: Namespace, chain: Sequence[BlockHash]) -> tuple[list[bool], dict[NodeId, set[int]]]:
        """Where `chain` sits on disk (a router prices a disk read): per block, whether every
        copy `present` counts is a DISK one (a pull stages it from a disk); and per node,
        the chain indices of the blocks its own copy of is on its disk tier. No side effects."""
        ns_map = self._blocks.get(namespace)
        if ns_map is None:
            return [False] * len(chain), {}
        suspect = self.suspects() if self._suspect else ()
        nodes = self.nodes
        only: list[bool] = []
        per_node: dict[NodeId, set[int]] = {}
        for i, h in enumerate(chain):
            holders = ns_map.get(h) or {}
            usable = [loc.medium for n, loc in holders.items()
                      if n not in suspect and (not loc.medium or nodes[n].stage_address)]
            only.append(bool(usable) and all(usable))
            for n, loc in holders.items():
                if loc.medium:
                    per_node.setdefault(n, set()).add(i)
        return only, per_node

    def namespace_state(self, namespace: Namespace) -> tuple[list[NodeRecord], list[BlockLocation],
                                                            dict[NodeId, float]]:
        """The namespace's nodes, every copy of its blocks, and its suspect nodes (seconds left):
        a WatchIndex snapshot."""
        now = time.monotonic()
        nodes = [n for n in self.nodes.values() if n.namespace == namespace]
        blocks = [loc for holders in self._blocks.get(namespace, {}).values() for loc in holders.values()]
        suspects = {n: t - now for n, t in self._suspect.items()
                    if t > now and n in self.nodes and self.nodes[n].namespace == namespace}
        return nodes, blocks, suspects

    def num_blocks_of(self, node_id: NodeId) -> int:
        return len(self._node_hashes.get(node_id, ()))

    def num_copies(self) -> int:
        """`stats().num_copies` without walking every copy (a node's blocks are one namespace's)."""
        return sum(len(hashes) for hashes in self._node_hashes.values())

    @staticmethod
    def _namespace_stats(ns: Namespace, blocks: dict[BlockHash, dict[NodeId, BlockLocation]]) -> NamespaceStats:
        copies = [loc for holders in blocks.values() for loc in holders.values()]
        disk = [loc for loc in copies if loc.medium == Medium.DISK]
        return NamespaceStats(ns, len(blocks), len(copies), len(disk),
                              dram_bytes=sum(loc.size_bytes for loc in copies) - sum(loc.size_bytes for loc in disk),
                              disk_bytes=sum(loc.size_bytes for loc in disk))

    def stats(self) -> IndexStats:
        per_ns = tuple(self._namespace_stats(ns, m) for ns, m in sorted(self._blocks.items()))
        return IndexStats(
            num_nodes=len(self.nodes),
            num_blocks=sum(s.num_blocks for s in per_ns),
            num_copies=sum(s.num_copies for s in per_ns),
            namespaces=per_ns,
        )
