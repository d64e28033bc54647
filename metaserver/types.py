"""Domain types of the metadata service (what the rest of the code sees instead of protobuf)."""
from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One block as its holder publishes it."""

    block_hash: BlockHash
    offset: int        # slot offset from the node's buffer_address, bytes
    size_bytes: int    # bytes to read (slot header + payload)
    generation: int    # slot generation at publish time; the reader validates it


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """One copy of a block: a node and the slot on it."""

    block_hash: BlockHash
    node_id: NodeId
    offset: int
    size_bytes: int
    generation: int


@dataclass(frozen=True, slots=True)
class QueryResult:
    """The longest present prefix of a chain: one chosen location per matched block."""

    locations: tuple[BlockLocation, ...]     # in chain order; len() == number of matched blocks
    nodes: dict[NodeId, NodeRecord]          # every node named in `locations`

    @property
    def num_matched(self) -> int:
        return len(self.locations)


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    namespace: Namespace
    num_blocks: int   # distinct hashes
    num_copies: int   # (hash, node) pairs


@dataclass(frozen=True, slots=True)
class IndexStats:
    num_nodes: int
    num_blocks: int
    num_copies: int
    namespaces: tuple[NamespaceStats, ...]
