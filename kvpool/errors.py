"""The node pool's exception types (kvpool.pool re-exports them)."""
from __future__ import annotations


class PoolError(Exception):
    """Bad use of the pool (sizes, unregistered memory, unknown nodes)."""
