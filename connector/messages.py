"""What the pool connector's scheduler half hands its worker half each step: plain values
(request ids, block ids, block hashes, locations), no engine types, so any host can carry
them (our engine's scheduler output, vLLM's `KVConnectorMetadata`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_connector.base import KVConnectorMetadata
from metaserver.types import BlockHash, BlockLocation, NodeId, NodeRecord


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    block_ids: tuple[int, ...]              # destination blocks in the paged cache, chain order
    locations: tuple[BlockLocation, ...]    # where each block is read from (same order)
    nodes: dict[NodeId, NodeRecord]         # every node named in `locations`


@dataclass(frozen=True, slots=True)
class SaveSpec:
    request_id: str
    block_ids: tuple[int, ...]              # cache blocks that became full (computed) this step
    block_hashes: tuple[BlockHash, ...]     # their chained hashes (same order)


@dataclass(frozen=True, slots=True)
class SendSpec:
    """A finished request's full prompt blocks (and its tail), handed to a remote decode
    (`connector.handoff`): the worker half puts any not in the pool yet, then reports where
    each one is."""

    request_id: str
    block_ids: tuple[int, ...]              # its cache blocks from block 0 (held until the send is reported)
    block_hashes: tuple[BlockHash, ...]
    tail_tokens: int = 0                    # the last block is the prompt's partial one, this many tokens


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)   # reads to start this step
    saves: list[SaveSpec] = field(default_factory=list)   # blocks to copy into the pool after the step
    writes: list[int] = field(default_factory=list)       # cache blocks the step writes (saves of them must stop)
    sends: list[SendSpec] = field(default_factory=list)   # finished requests handed to a remote decode
    touches: list[BlockHash] = field(default_factory=list)  # blocks used as local hits (this pool's LRU)
