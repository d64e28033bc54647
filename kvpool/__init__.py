"""kvpool: each node's share of the global KV pool (DRAM slots over the Mooncake Transfer Engine)."""
from kvpool.config import PoolConfig
from kvpool.layout import parse_size, slot_bytes_for
from kvpool.pool import NodePool, PoolError
from kvpool.stats import PoolStats
from kvpool.reader import ReadHandle, ReadResult
from kvpool.transfer import TransferConfig, TransferEngine, TransferError

__all__ = ["NodePool", "PoolConfig", "PoolError", "PoolStats", "ReadHandle", "ReadResult", "TransferConfig",
           "TransferEngine", "TransferError", "parse_size", "slot_bytes_for"]
