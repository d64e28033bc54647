"""A reader node without an engine: the pool connector's two halves, driven as a host drives
them, one request at a time (tests and `kvpool bench lookup` count failed reads with it).

The cache is a plain buffer of `num_blocks` slots with header room (our engine's layout);
a "request" is a chain of block hashes whose blocks are all looked up and loaded.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from connector.cache_layout import SlottedCache
from connector.pool_scheduler import PoolScheduler
from connector.pool_worker import PoolWorker
from connector.settings import PoolConnectorSettings
from kvpool.layout import HEADER_BYTES


class PoolReader:
    def __init__(self, metaserver: str, node_id: str, namespace: str, block_bytes: int, num_blocks: int,
                 block_size: int = 4, **extra: object) -> None:
        """`extra`: more `kv_connector_extra_config` keys (e.g. lookup_view=False)."""
        config = {"metaserver": metaserver, "node_id": node_id, "pool_size": "1MiB", "lookup_deadline_s": 5,
                  "transfer_timeout_s": 2, "progress_timeout_s": 1, "read_timeout_s": 5, **extra}
        self.settings = PoolConnectorSettings.from_extra(lambda k, d=None: config.get(k, d), 30.0)
        self.block_size = block_size
        self.scheduler = PoolScheduler(self.settings, namespace, block_size, consume=True, produce=False)
        self.worker = PoolWorker(self.settings, namespace, block_bytes)
        slot = block_bytes + HEADER_BYTES
        self.cache = np.zeros(num_blocks * slot, dtype=np.uint8)
        self.worker.register_cache(SlottedCache(self.cache.ctypes.data, slot, HEADER_BYTES), num_blocks)
        self.num_blocks = num_blocks
        self.failed_loads = 0   # requests whose load had a failed block
        self._n = 0

    def offered(self, chain: Sequence[bytes], rid: str = "peek", timeout_s: float = 30.0) -> int:
        """Tokens a lookup of `chain` offers now (nothing loaded; `rid` other than "peek" is
        left for `request` to load)."""
        ps, num_tokens = self.scheduler, len(chain) * self.block_size + 1
        ps.start_lookup(rid, chain, num_tokens)
        deadline = time.monotonic() + timeout_s
        while (n := ps.num_matched_tokens(rid, chain, num_tokens, 0)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no lookup answer for {rid} within {timeout_s} s")
            ps.wait_for_lookups(0.01)
        if rid == "peek":
            ps.forget(rid)
        return n

    def request(self, chain: Sequence[bytes]) -> int:
        """Look `chain` up and load what is offered, as the host would; returns the tokens offered."""
        assert len(chain) <= self.num_blocks
        self._n += 1
        rid, ps = f"r{self._n}", self.scheduler
        offered = self.offered(chain, rid)
        if offered:
            ps.on_alloc(rid, list(range(len(chain))), offered)
            self.worker.start_loads(ps.build_meta().loads)
            self.worker.wait_for_loads([rid], 15)
            done, errors = self.worker.finished_loads(), self.worker.take_load_errors()
            self.failed_loads += bool(errors)
            ps.on_worker_report(done, errors)
        ps.forget(rid)
        return offered

    def reports(self) -> float:
        """Failed reads this reader told the metaserver of."""
        return self.scheduler.counters()["lookup_failed_read_reports"]

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
