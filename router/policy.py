"""Routing policies: which node serves a request.

- `round-robin`: the nodes in turn.
- `least-loaded`: the node with the fewest requests (running + waiting); ties in turn.
- `prefix`: the node where the request's first token comes soonest, in prefill tokens. For
  each node it predicts the tokens the request computes there: the prompt, less the blocks
  the node holds itself from block 0 (a local hit, free), less `pull_value` of each block
  of the run the pool holds from there, whatever it lacks before, as the connector loads
  (a pull costs a little, a recompute all), plus `disk_cost` tokens for each of those
  blocks read from a disk tier: one of the node's own held on its disk only, or one of the
  run held on disks only (staged by its holder first). To that it adds the node's queue: the
  predicted compute of this router's requests there still waiting for their first token,
  and `load_weight` tokens for each request there already generating (they share its steps)
  or sent by someone else. It takes the cheapest (ties: least loaded, then in turn).
  What a node holds comes from two sources, the larger wins: the global index (a node-local
  view of it, `metaserver.view`, when the router has `--metaserver`: exact for the pools),
  and the router's own record of the chains it sent to each node, an LRU of the node's KV
  cache size (what the node's local prefix cache holds when the pool is off).

Not thread-safe: called on the router's event loop.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from metaserver.view import IndexView
from router.backends import Backend
from router.chain import Chain

POLICIES = ("round-robin", "least-loaded", "prefix")

# Prefill tokens one block read from a disk tier costs: a SmolLM2-135M block (737,280 bytes)
# read and validated at the tier's measured 913 MB/s (docs/BENCHMARKS.md, "Disk tier":
# tier_read) takes 0.81 ms, the time this CPU prefills ~0.65 tokens in (fp32, 690-880 tok/s,
# docs/BENCHMARKS.md "Offline prefill"). Far cheaper than a recompute (16 tokens a block),
# not free: a DRAM copy wins over a disk one when all else is equal.
DISK_COST = 0.65


@dataclass(frozen=True, slots=True)
class Choice:
    node: Backend
    predicted_hit_tokens: int = 0    # prompt tokens the node will not compute (local or pulled)
    compute_tokens: int = 0          # tokens it will compute (a pulled block counts 1 - pull_value)


class Policy:
    name = ""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, nodes: Sequence[Backend], chain: Chain | None) -> Choice:
        """A node among `nodes` (up, not yet tried for this request; never empty)."""
        raise NotImplementedError

    def routed(self, node: Backend, chain: Chain | None) -> None:
        """The request with `chain` was sent to `node` (its prefix will be there)."""

    def forget(self, node: Backend) -> None:
        """`node` left (a node coming back under its URL starts with an empty cache)."""

    def _in_turn(self, nodes: Sequence[Backend]) -> Backend:
        return nodes[next(self._turn) % len(nodes)]

    def _least_loaded(self, nodes: Sequence[Backend]) -> Backend:
        least = min(n.load for n in nodes)
        return self._in_turn([n for n in nodes if n.load == least])


class RoundRobin(Policy):
    name = "round-robin"

    def choose(self, nodes: Sequence[Backend], chain: Chain | None) -> Choice:
        return Choice(self._in_turn(nodes))


class LeastLoaded(Policy):
    name = "least-loaded"

    def choose(self, nodes: Sequence[Backend], chain: Chain | None) -> Choice:
        return Choice(self._least_loaded(nodes))


class RouteTable:
    """Per node, the block hashes the router sent it most recently, up to its cache's size:
    an LRU model of each node's local prefix cache."""

    def __init__(self, default_capacity: int = 65536) -> None:
        self.default_capacity = default_capacity
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, node: Backend, hashes: Sequence[bytes]) -> None:
        held = self._held.setdefault(node.url, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        cap = node.cache_blocks or self.default_capacity
        while len(held) > cap:
            held.popitem(last=False)

    def forget(self, node: Backend) -> None:
        self._held.pop(node.url, None)

    def prefix(self, node: Backend, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` recorded for `node`."""
        held = self._held.get(node.url)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


class Prefix(Policy):
    name = "prefix"

    def __init__(self, block_size: int, view: IndexView | None = None, load_weight: float = 32.0,
                 pull_value: float = 0.9, disk_cost: float = DISK_COST) -> None:
        """`load_weight`: prefill tokens one generating request on a node is worth (the time it
        adds to the steps a new prompt's prefill shares); `pull_value`: the share of a
        recompute a pulled token saves (0..1); `disk_cost`: prefill tokens one block read
        from a disk tier costs on top (>= 0)."""
        super().__init__()
        if load_weight < 0 or not 0 <= pull_value <= 1 or disk_cost < 0:
            raise ValueError(f"need load_weight >= 0, 0 <= pull_value <= 1 and disk_cost >= 0, got {load_weight}, "
                             f"{pull_value}, {disk_cost}")
        self.block_size = block_size
        self.view = view
        self.load_weight = load_weight
        self.pull_value = pull_value
        self.disk_cost = disk_cost
        self.table = RouteTable()
        self.view_answers = 0   # choices made with the index's answer (counter)

    def choose(self, nodes: Sequence[Backend], chain: Chain | None) -> Choice:
        if chain is None or not chain.hashes:
            return Choice(self._least_loaded(nodes))
        # The last prompt token is always computed: at most (num_tokens - 1) // bs blocks hit.
        hashes = chain.hashes[:(chain.num_tokens - 1) // self.block_size]
        by_node: dict = {}
        present: list[bool] = []
        disk_only: list[bool] = []            # per block: its only usable copies are on disks
        on_disk: dict[str, set[int]] = {}     # per node: blocks its own copy of is on its disk
        got = self.view.prefix_by_node(hashes) if self.view is not None else None
        if got is not None:
            self.view_answers += 1
            by_node = got[1]
            present = self.view.present(hashes) or []  # type: ignore[union-attr]
            if self.disk_cost:
                disk_only, on_disk = self.view.disk(hashes) or ([], {})  # type: ignore[union-attr]
        costs: list[tuple[float, Choice]] = []
        for n in nodes:
            cached = self.table.prefix(n, hashes)  # in the node's own KV cache: no read at all
            local = max(by_node.get(n.node_id, 0) if n.node_id else 0, cached)
            # As the connector loads: the run the pool holds from where the node's own blocks
            # stop, whatever it lacks before (a hot first block is often in no pool).
            pulled = run_from(present, local)
            compute = chain.num_tokens - (local + self.pull_value * pulled) * self.block_size
            if self.disk_cost and (disk_only or on_disk):
                mine = on_disk.get(n.node_id, ()) if n.node_id else ()
                reads = sum(cached <= i < local for i in mine) + sum(disk_only[local:local + pulled])
                compute += self.disk_cost * reads
            queue = n.prefilling + self.load_weight * (n.decoding + n.external)
            costs.append((compute + queue, Choice(n, (local + pulled) * self.block_size, round(compute))))
        low = min(c for c, _ in costs)
        tied = [ch for c, ch in costs if c == low]
        least = min(ch.node.load for ch in tied)
        tied = [ch for ch in tied if ch.node.load == least]
        return tied[next(self._turn) % len(tied)]

    def routed(self, node: Backend, chain: Chain | None) -> None:
        if chain is not None:
            self.table.record(node, chain.hashes)

    def forget(self, node: Backend) -> None:
        self.table.forget(node)


def run_from(present: Sequence[bool], start: int) -> int:
    """Consecutive True entries of `present` from index `start`."""
    n = 0
    for p in present[start:]:
        if not p:
            break
        n += 1
    return n


def make_policy(name: str, block_size: int = 0, view: IndexView | None = None, load_weight: float = 32.0,
                pull_value: float = 0.9, disk_cost: float | None = None) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return Prefix(block_size, view, load_weight, pull_value, DISK_COST if disk_cost is None else disk_cost)
    raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
