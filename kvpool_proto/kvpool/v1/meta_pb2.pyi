from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAM: _ClassVar[Medium]
    DISK: _ClassVar[Medium]
DRAM: Medium
DISK: Medium

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "session_address", "buffer_address", "capacity_bytes", "layout_fingerprint", "lease_id", "lease_ttl_s", "draining", "num_blocks", "session_digest", "api_url", "stage_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    API_URL_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_address: str
    buffer_address: int
    capacity_bytes: int
    layout_fingerprint: str
    lease_id: int
    lease_ttl_s: int
    draining: bool
    num_blocks: int
    session_digest: bytes
    api_url: str
    stage_address: str
    def __init__(self, node_id: _Optional[str] = ..., session_address: _Optional[str] = ..., buffer_address: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_ttl_s: _Optional[int] = ..., draining: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., session_digest: _Optional[bytes] = ..., api_url: _Optional[str] = ..., stage_address: _Optional[str] = ...) -> None: ...

class BlockRecord(_message.Message):
    __slots__ = ("block_hash", "offset", "size_bytes", "generation", "medium")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    offset: int
    size_bytes: int
    generation: int
    medium: Medium
    def __init__(self, block_hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., generation: _Optional[int] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "session_address", "buffer_address", "capacity_bytes", "layout_fingerprint", "lease_ttl_s", "api_url", "stage_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    API_URL_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_address: str
    buffer_address: int
    capacity_bytes: int
    layout_fingerprint: str
    lease_ttl_s: int
    api_url: str
    stage_address: str
    def __init__(self, node_id: _Optional[str] = ..., session_address: _Optional[str] = ..., buffer_address: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., lease_ttl_s: _Optional[int] = ..., api_url: _Optional[str] = ..., stage_address: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_s", "session_token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_ttl_s: int
    session_token: str
    def __init__(self, lease_id: _Optional[int] = ..., lease_ttl_s: _Optional[int] = ..., session_token: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("node_id", "lease_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_s",)
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: int
    def __init__(self, lease_ttl_s: _Optional[int] = ...) -> None: ...

class UnregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "lease_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class UnregisterNodeResponse(_message.Message):
    __slots__ = ("num_blocks_removed",)
    NUM_BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_removed: int
    def __init__(self, num_blocks_removed: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("node_id", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRecord]
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockRecord, _Mapping]]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("num_published",)
    NUM_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    num_published: int
    def __init__(self, num_published: _Optional[int] = ...) -> None: ...

class UnpublishRequest(_message.Message):
    __slots__ = ("node_id", "block_hashes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpublishResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class QueryPrefixRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "requester_node_id", "sparse")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    requester_node_id: str
    sparse: bool
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., requester_node_id: _Optional[str] = ..., sparse: _Optional[bool] = ...) -> None: ...

class QueryPrefixResponse(_message.Message):
    __slots__ = ("num_matched", "nodes", "node_index", "offsets", "sizes_bytes", "generations", "chain_index", "media")
    NUM_MATCHED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    num_matched: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    node_index: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes_bytes: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    chain_index: _containers.RepeatedScalarFieldContainer[int]
    media: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_matched: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., node_index: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes_bytes: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., chain_index: _Optional[_Iterable[int]] = ..., media: _Optional[_Iterable[int]] = ...) -> None: ...

class QueryPrefixBatchRequest(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[QueryPrefixRequest]
    def __init__(self, queries: _Optional[_Iterable[_Union[QueryPrefixRequest, _Mapping]]] = ...) -> None: ...

class QueryPrefixBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[QueryPrefixResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[QueryPrefixResponse, _Mapping]]] = ...) -> None: ...

class ReportFailedReadRequest(_message.Message):
    __slots__ = ("reporter_node_id", "source_node_id", "block_hashes")
    REPORTER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    reporter_node_id: str
    source_node_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reporter_node_id: _Optional[str] = ..., source_node_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReportFailedReadResponse(_message.Message):
    __slots__ = ("num_removed", "source_suspect")
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SUSPECT_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    source_suspect: bool
    def __init__(self, num_removed: _Optional[int] = ..., source_suspect: _Optional[bool] = ...) -> None: ...

class WatchIndexRequest(_message.Message):
    __slots__ = ("namespace", "epoch", "after_seq", "watcher_node_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    WATCHER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    epoch: str
    after_seq: int
    watcher_node_id: str
    def __init__(self, namespace: _Optional[str] = ..., epoch: _Optional[str] = ..., after_seq: _Optional[int] = ..., watcher_node_id: _Optional[str] = ...) -> None: ...

class IndexEvent(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "current", "nodes", "block_nodes", "blocks", "removed_block_nodes", "removed_hashes", "removed_nodes", "suspect_nodes", "suspect_for_s", "trusted_nodes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCK_NODES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_NODES_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_NODES_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FOR_S_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_NODES_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    current: bool
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    block_nodes: _containers.RepeatedScalarFieldContainer[str]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRecord]
    removed_block_nodes: _containers.RepeatedScalarFieldContainer[str]
    removed_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    removed_nodes: _containers.RepeatedScalarFieldContainer[str]
    suspect_nodes: _containers.RepeatedScalarFieldContainer[str]
    suspect_for_s: _containers.RepeatedScalarFieldContainer[float]
    trusted_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., current: _Optional[bool] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., block_nodes: _Optional[_Iterable[str]] = ..., blocks: _Optional[_Iterable[_Union[BlockRecord, _Mapping]]] = ..., removed_block_nodes: _Optional[_Iterable[str]] = ..., removed_hashes: _Optional[_Iterable[bytes]] = ..., removed_nodes: _Optional[_Iterable[str]] = ..., suspect_nodes: _Optional[_Iterable[str]] = ..., suspect_for_s: _Optional[_Iterable[float]] = ..., trusted_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class HashList(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "node_id", "by_namespace", "all")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BY_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: HashList
    node_id: str
    by_namespace: bool
    all: bool
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Union[HashList, _Mapping]] = ..., node_id: _Optional[str] = ..., by_namespace: _Optional[bool] = ..., all: _Optional[bool] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UndrainResponse(_message.Message):
    __slots__ = ("was_draining",)
    WAS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    was_draining: bool
    def __init__(self, was_draining: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "num_blocks", "num_copies", "num_disk_copies", "dram_bytes", "disk_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_COPIES_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    num_blocks: int
    num_copies: int
    num_disk_copies: int
    dram_bytes: int
    disk_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_copies: _Optional[int] = ..., num_disk_copies: _Optional[int] = ..., dram_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_nodes", "num_blocks", "num_copies", "namespaces", "queries", "query_blocks", "query_hit_blocks", "published_blocks", "etcd_healthy", "pending_writes", "replica_id")
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERY_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ETCD_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    num_nodes: int
    num_blocks: int
    num_copies: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    queries: int
    query_blocks: int
    query_hit_blocks: int
    published_blocks: int
    etcd_healthy: bool
    pending_writes: int
    replica_id: str
    def __init__(self, num_nodes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_copies: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., queries: _Optional[int] = ..., query_blocks: _Optional[int] = ..., query_hit_blocks: _Optional[int] = ..., published_blocks: _Optional[int] = ..., etcd_healthy: _Optional[bool] = ..., pending_writes: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ("namespace", "offset", "size_bytes", "generation", "medium")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    offset: int
    size_bytes: int
    generation: int
    medium: Medium
    def __init__(self, namespace: _Optional[str] = ..., offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., generation: _Optional[int] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...
