"""Configuration of a node's pool: one frozen dataclass, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.transfer import TransferConfig


@dataclass(frozen=True)
class PoolConfig:
    node_id: str                         # stable across restarts of this node
    pool_size_bytes: int                 # DRAM buffer shared with the cluster
    block_bytes: int                     # payload of one KV block (all layers, K and V)
    layout_fingerprint: str              # namespace of the blocks (model/layout)
    metaserver: str = ""                 # HOST:PORT[,HOST:PORT]; "" = not published (local only)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    lease_ttl_s: int = 10
    publish_batch: int = 256             # records per Publish RPC
    publish_interval_s: float = 0.005    # the publisher flushes at least this often
    evict_batch: int = 16                # LRU slots freed (and unpublished in one RPC) at a time
    read_timeout_s: float = 10.0         # a read that has not finished by then fails
    max_read_blocks: int = 65536         # read-buffer slots at most (remote blocks in flight at once)
    api_url: str = ""                    # the engine's API, announced with the registration (routers)
    disk_dir: str = ""                   # the disk tier's directory (kvpool.disk); off unless this and
    disk_size_bytes: int = 0             # its size are both set
    # Evicted blocks waiting for the disk writer at most (more are dropped): a bound in bytes,
    # since evictions come in bursts of a prompt's blocks (a 2,048-token prompt of SmolLM2 fp32
    # is 128 blocks, 94 MB) that the writer drains within tens of ms; 0 blocks = from the bytes.
    disk_queue_bytes: int = 128 << 20
    disk_queue_blocks: int = 0
    disk_save_on_close: bool = True      # close() writes the blocks still in DRAM to disk (warm restart)
    disk_save_timeout_s: float = 30.0    # ... for this long at most

    def __post_init__(self) -> None:
        if not self.node_id or "/" in self.node_id:
            raise ValueError("node_id must be non-empty and contain no '/'")
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {self.block_bytes}")
        from kvpool.layout import slot_bytes_for

        if self.pool_size_bytes < slot_bytes_for(self.block_bytes):
            raise ValueError(f"pool_size_bytes {self.pool_size_bytes} cannot hold one {self.block_bytes}-byte block")
        if not self.layout_fingerprint:
            raise ValueError("layout_fingerprint is required")
        if self.publish_batch < 1 or self.evict_batch < 1 or self.max_read_blocks < 1:
            raise ValueError("publish_batch, evict_batch and max_read_blocks must be >= 1")
        if self.read_timeout_s <= 0 or self.publish_interval_s <= 0:
            raise ValueError("read_timeout_s and publish_interval_s must be > 0")
        if self.disk_size_bytes < 0 or self.disk_queue_blocks < 0 or self.disk_queue_bytes < 1:
            raise ValueError("disk_size_bytes and disk_queue_blocks must be >= 0, disk_queue_bytes >= 1")

    @property
    def disk_staging_blocks(self) -> int:
        """Evicted blocks the disk tier stages for its writer at most."""
        from kvpool.disk_file import disk_slot_bytes

        return self.disk_queue_blocks or max(8, self.disk_queue_bytes // disk_slot_bytes(self.block_bytes))

    @property
    def disk_enabled(self) -> bool:
        """A disk tier was asked for (both its directory and its size are set)."""
        return bool(self.disk_dir) and self.disk_size_bytes > 0
