"""Domain types of the metadata service (what the rest of the code sees instead of protobuf)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType

BlockHash = NewType("BlockHash", bytes)  # chained prefix hash of one full KV block
NodeId = NewType("NodeId", str)          # a node's stable id
Namespace = NewType("Namespace", str)    # a model/layout fingerprint; blocks match only within one


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A registered node: where its pool lives and which namespace its blocks belong to."""

    node_id: NodeId
    session_address: str      # transfer-engine session id ("host:rpc_port")
    buffer_address: int       # virtual address of its registered pool buffer
    capacity_bytes: int       # size of that buffer
    namespace: Namespace      # the node's layout fingerprint
    lease_id: int             # etcd lease its records live under
    lease_ttl_s: int
    draining: bool = False    # no new publishes; not a source any more
    api_url: str = ""         # its engine's OpenAI API (http://host:port), "" when not announced
    # SHA-256 of the registration's session token (metaserver.auth); b"" when unknown
    # (records that came over RPC never carry it).
    session_digest: bytes = field(default=b"", repr=False)
    stage_address: str = ""   # HOST:PORT of its stage service (kvpool.stage); "" = none


class Medium(IntEnum):
    """Where a node holds a block (proto kvpool.v1.Medium)."""
    DRAM = 0   # its pool's registered buffer: other nodes read it one-sidedly
    DISK = 1   # its disk tier (kvpool.disk): only the holder reads it


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One block as its holder publishes it."""

    block_hash: BlockHash
    offset: int        # slot offset from the node's buffer_address, bytes
    size_bytes: int    # bytes to read (slot header + payload)
    generation: int    # slot generation at publish time; the reader validates it
    medium: Medium = Medium.DRAM  # DISK: offset and generation are the disk slot's


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """One copy of a block: a node and the slot on it."""

    block_hash: BlockHash
    node_id: NodeId
    offset: int
    size_bytes: int
    generation: int
    medium: Medium = Medium.DRAM  # DISK: read by its holder; others have it staged first


@dataclass(frozen=True, slots=True)
class QueryResult:
    """What the index holds of a chain: one chosen location per block it offers.

    `locations` is the longest present prefix (from block 0), for every query. A sparse query
    also answers `held`: every block of the chain the index holds, wherever it is. An engine
    needs that because its own cache usually covers the chain's first blocks (a shared system
    prompt that is a local hit every time is never saved or read again, so the pool drops it)
    and it loads the run that starts where its cache stops (`run_from`), which it only learns
    after the lookup was sent.
    """

    locations: tuple[BlockLocation, ...]     # the longest present prefix, in chain order
    nodes: dict[NodeId, NodeRecord]          # every node named in `locations` or `held`
    # Sparse queries: per chain block up to the last one present, its chosen location, or
    # None where the index holds no (usable) copy; begins with `locations`. () for a prefix
    # query (nothing is known past the first gap) and for a sparse one that found nothing.
    held: tuple[BlockLocation | None, ...] = ()

    @property
    def num_matched(self) -> int:
        """Blocks of the present prefix (from block 0)."""
        return len(self.locations)

    @property
    def num_held(self) -> int:
        """Blocks the answer offers anywhere in the chain (the prefix, for a prefix query)."""
        return sum(loc is not None for loc in self.held) if self.held else len(self.locations)

    def run_from(self, start: int) -> tuple[BlockLocation, ...]:
        """The offered blocks from chain block `start` up to the first one not offered: the
        blocks of chain indices start, start+1, ... (consecutive, never across a gap). For a
        prefix answer, what the prefix holds past `start`."""
        if not self.held:
            return self.locations[start:]
        run: list[BlockLocation] = []
        for loc in self.held[start:]:
            if loc is None:
                break
            run.append(loc)
        return tuple(run)


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    namespace: Namespace
    num_blocks: int   # distinct hashes
    num_copies: int   # (hash, node) pairs
    num_disk_copies: int = 0  # of those, in a node's disk tier
    dram_bytes: int = 0       # the DRAM copies' sizes summed
    disk_bytes: int = 0       # the disk copies' sizes summed


@dataclass(frozen=True, slots=True)
class IndexStats:
    num_nodes: int
    num_blocks: int
    num_copies: int
    namespaces: tuple[NamespaceStats, ...]
