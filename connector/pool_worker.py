"""The pool connector's worker half: the node pool, loads into the cache, saves out of it.

Host-independent: it sees the host's KV cache as one registered region and a
`connector.cache_layout` saying where each block's bytes lie in it (contiguous with header
room, or one slice per layer), and takes plain load and save specs (`connector.messages`).

Loads are `NodePool.get` reads: each block lands whole in the pool's read buffer, is
validated there and copied into its cache block (one copy per contiguous block, or one per
layer slice), so a failed transfer never writes into the cache.
Completion is polled in `finished_loads()` or awaited in `wait_for_loads()` (woken by the
read's progress callback, no sleep loop); blocks that
failed validation come out of `take_load_errors()` for the host to recompute. Saves copy
newly computed full blocks into the pool on a saver thread (`connector.saver`), off the
host's step; `begin_step` fences the blocks a step writes before its forward pass. Their
publication is batched and asynchronous.

Sends (P/D, `connector.handoff`): a finished request's full prompt blocks (and its tail) are put into the
pool (behind the saves already queued, never dropped for being behind), and once the last
one is in, the request is reported in `finished_sends()` with the transfer params naming
where the pool holds them (`take_sent_params()`); until then the host holds its blocks.

Not thread-safe: the host's worker thread owns it (the pool's own threads, and the saver
thread at the end of a send, call back only into a `threading.Event` and a locked dict).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from connector import handoff
from connector.cache_layout import CacheLayout
from connector.messages import LoadSpec, PoolConnectorMetadata, SaveSpec, SendSpec
from connector.saver import Saver
from connector.settings import PoolConnectorSettings
from kvpool.config import PoolConfig
from kvpool.pool import NodePool, PoolError
from kvpool.reader import ReadHandle

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    loaded_blocks: int = 0      # blocks delivered and validated
    failed_blocks: int = 0      # blocks whose load failed (recomputed)
    saved_blocks: int = 0       # new blocks put into the local pool
    sent_blocks: int = 0        # blocks named to a remote decode (P/D sends)
    loads: int = 0              # loads finished (delivered or failed)
    load_seconds: float = 0.0   # their time from issue to finish, summed (the transfer's part of a TTFT)


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    not_before: float                  # issue time (debug_load_delay_s after the start)
    handle: ReadHandle | None = None   # None until issued
    issued_at: float = 0.0             # when the read was issued (monotonic)


class PoolWorker:
    def __init__(self, settings: PoolConnectorSettings, fingerprint: str, block_bytes: int) -> None:
        """Start this node's pool: register it with the transfer engine and the metaserver.
        Raises what the pool raises (PoolError, TransferError, MetaError, ValueError)."""
        self.settings = settings
        self.block_bytes = block_bytes
        self.stats = TransferStats()
        cfg = PoolConfig(node_id=settings.node_id, pool_size_bytes=settings.pool_size_bytes, block_bytes=block_bytes,
                         layout_fingerprint=fingerprint, metaserver=settings.metaserver, transfer=settings.transfer,
                         lease_ttl_s=settings.lease_ttl_s, read_timeout_s=settings.read_timeout_s,
                         api_url=settings.api_url, disk_dir=settings.disk_dir,
                         disk_size_bytes=settings.disk_size_bytes)
        self._client = settings.meta_client()
        pool = None
        try:
            pool = NodePool(cfg, self._client)
            pool.start()
        except BaseException:
            if pool is not None:
                pool.close()
            self._client.close()
            raise
        self.pool: NodePool | None = pool
        self._saver = Saver(pool.put, block_bytes, settings.save_queue_blocks) if settings.async_saves else None
        self._layout: CacheLayout | None = None
        self._device_memory: Any = None   # connector.device_memory.CudaMemory for a cache on a GPU
        self._loads: dict[str, _Load] = {}
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()
        self._progress = threading.Event()   # set by the pool's threads when a read batch finishes
        self._sending: set[str] = set()      # sends whose blocks are not all in the pool yet
        self._sent_lock = threading.Lock()
        self._sent: dict[str, dict] = {}     # finished sends -> their transfer params (not reported yet)
        self._reported: dict[str, dict] = {}  # reported by finished_sends, params not taken yet

    def register_cache(self, layout: CacheLayout, num_blocks: int, tensors: Sequence[Any] = ()) -> None:
        """The host's KV cache of `num_blocks` blocks, where `layout` says (loads copy into
        them, saves copy out of them; the transfer engine never writes there). The pool's
        read buffer gets a slot per cache block, so every load in flight fits. `tensors`: the
        cache's tensors; on CUDA, loads are copied host-to-device and saves staged
        device-to-host on their own stream (`connector.device_memory`)."""
        assert self.pool is not None
        self.pool.size_read_buffer(num_blocks)
        self._layout = layout
        if tensors and getattr(tensors[0], "is_cuda", False):
            from connector.device_memory import CudaMemory, CudaStaging  # torch, on CUDA hosts only

            memory = self._device_memory = CudaMemory(tensors)
            pinned = memory.pin(self.pool.host_regions())
            self.pool.use_caller_memory(memory)
            if self._saver is not None:
                self._saver.use_staging(CudaStaging(memory, self.block_bytes, self.settings.save_queue_blocks))
            log.info("kvpool: the KV cache is on %s: loads copied host-to-device (%d MiB of the pool pinned), "
                     "saves staged on a copy stream", memory.device, pinned >> 20)

    # ---- loads ----------------------------------------------------------------------

    def start_loads(self, loads: Iterable[LoadSpec]) -> None:
        now = time.monotonic()
        for spec in loads:
            self._loads[spec.request_id] = _Load(spec, now + self.settings.debug_load_delay_s)
        self._issue_due(now)

    def _issue_due(self, now: float) -> float | None:
        """Issue the loads whose time has come; returns the earliest time one is still due."""
        assert self.pool is not None
        next_due = None
        for rid, load in list(self._loads.items()):
            if load.handle is not None:
                continue
            if now < load.not_before:
                next_due = load.not_before if next_due is None else min(next_due, load.not_before)
                continue
            spec = load.spec
            layout = self._layout
            assert layout is not None, "register_cache() before loads"
            try:
                load.handle = self.pool.get(spec.locations, spec.nodes, [layout.payload(b) for b in spec.block_ids],
                                            on_progress=self._progress.set)
            except PoolError as err:
                log.warning("load for %s rejected: %s", rid, err)
                self._finish_load(rid, spec, failed=range(len(spec.block_ids)))
                continue
            load.issued_at = now
            log.debug("load %s: %d blocks issued", rid, len(spec.block_ids))
        return next_due

    def _finish_load(self, rid: str, spec: LoadSpec, failed: Iterable[int]) -> None:
        bad = [spec.block_ids[i] for i in failed]
        log.debug("load %s: %d blocks done, %d failed", rid, len(spec.block_ids), len(bad))
        self._load_errors.update(bad)
        self.stats.failed_blocks += len(bad)
        self.stats.loaded_blocks += len(spec.block_ids) - len(bad)
        load = self._loads[rid]
        if load.issued_at:
            self.stats.loads += 1
            self.stats.load_seconds += time.monotonic() - load.issued_at
        self._recved.add(rid)
        del self._loads[rid]

    def _collect(self) -> None:
        """Move every load whose read has settled to the finished set."""
        for rid, load in list(self._loads.items()):
            if load.handle is not None and load.handle.done():
                assert load.handle.result is not None
                self._finish_load(rid, load.spec, failed=load.handle.result.failed)

    def wait_for_loads(self, request_ids: Iterable[str], timeout_s: float) -> None:
        """Block until none of `request_ids` is still loading, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        ids = set(request_ids)
        while True:
            self._progress.clear()  # before the check: a batch finishing after it sets it again
            now = time.monotonic()
            next_due = self._issue_due(now)
            self._collect()
            if (ids.isdisjoint(self._loads) and ids.isdisjoint(self._sending)) or now >= deadline:
                return
            self._progress.wait(min(deadline, next_due or deadline) - now)

    def finished_loads(self) -> set[str]:
        """Request ids whose load finished (delivered or failed) since the last call."""
        self._issue_due(time.monotonic())
        self._collect()
        recved, self._recved = self._recved, set()
        return recved

    def take_load_errors(self) -> set[int]:
        """Cache block ids whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves ----------------------------------------------------------------------

    def begin_step(self, meta: PoolConnectorMetadata) -> None:
        """Before the step's forward pass: no save copies out of a block this step writes
        (its computed blocks, its loads' destinations) any more; then its loads start."""
        if self._saver is not None:
            self._saver.fence(itertools.chain(meta.writes, *(spec.block_ids for spec in meta.loads)))
        if meta.touches and self.pool is not None:
            self.pool.touch(meta.touches)
        self.start_loads(meta.loads)
        self.send(meta.sends)

    def save(self, saves: Sequence[SaveSpec]) -> None:
        """Copy the blocks into the pool: on the saver thread (`connector.saver`), or here
        with `async_saves` off. Publication is batched and asynchronous either way."""
        self._put(((b, h) for spec in saves for b, h in zip(spec.block_ids, spec.block_hashes)))

    def _put(self, blocks: Iterable[tuple[int, bytes]], force: bool = False) -> None:
        """(cache block, hash) pairs into the pool: queued on the saver (`force`: never
        dropped for being behind), or copied here without one."""
        assert self.pool is not None and self._layout is not None
        layout = self._layout
        if self._saver is not None:
            self._saver.enqueue(((b, h, layout.payload(b)) for b, h in blocks), force=force)
            return
        for b, h in blocks:
            if self.pool.put(h, layout.payload(b), self.block_bytes):
                self.stats.saved_blocks += 1

    # ---- sends (P/D) ------------------------------------------------------------------

    def send(self, sends: Sequence[SendSpec]) -> None:
        """Put each send's blocks into the pool (those not there yet), then name them."""
        for spec in sends:
            self._sending.add(spec.request_id)
            self._put(zip(spec.block_ids, spec.block_hashes), force=True)
            if self._saver is not None:
                self._saver.after(lambda spec=spec: self._sent_now(spec))
            else:
                self._sent_now(spec)

    def _sent_now(self, spec: SendSpec) -> None:
        """Every block of `spec` was put (on the saver thread, or the host's): name where."""
        pool = self.pool
        if pool is None:
            return
        records = pool.locate(spec.block_hashes)
        if len(records) < len(spec.block_hashes):
            log.warning("%s: %d of %d prompt blocks could not be put into the pool; the decode node computes "
                        "the rest", spec.request_id, len(spec.block_hashes) - len(records), len(spec.block_hashes))
        whole = len(records) == len(spec.block_hashes)
        with self._sent_lock:
            self._sent[spec.request_id] = handoff.producer_params(pool.node_record(), records, spec.request_id,
                                                                  spec.tail_tokens if whole else 0)
            self.stats.sent_blocks += len(records)
        self._progress.set()

    def finished_sends(self) -> set[str]:
        """Requests whose send finished since the last call (their params: `take_sent_params`)."""
        with self._sent_lock:
            done = self._sending.intersection(self._sent)
            self._reported.update((rid, self._sent.pop(rid)) for rid in done)
        self._sending -= done
        return done

    def take_sent_params(self) -> dict[str, dict]:
        """The transfer params of the sends `finished_sends` reported since the last call."""
        reported, self._reported = self._reported, {}
        return reported

    # ---- lifecycle ------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """This half's counters (connector_*) and the node pool's (pool_*)."""
        out: dict[str, float] = {f"connector_{k}": v for k, v in asdict(self.stats).items()}
        if self._saver is not None:
            saver = self._saver.stats
            out["connector_saved_blocks"] += saver.saves_copied
            out.update({f"connector_{k}": v for k, v in asdict(saver).items()},
                       connector_saves_pending=self._saver.pending())
        if self.pool is not None:
            ps, pool = self.pool.stats, self.pool
            out.update(pool_puts=ps.puts, pool_evictions=ps.evictions, pool_bytes_read=ps.bytes_read,
                       pool_failed_reads=ps.failed_reads, pool_quarantined_slots=ps.quarantined_slots,
                       pool_remote_hit_blocks=ps.remote_hits,
                       pool_local_hit_blocks=ps.local_hits, pool_published=ps.published,
                       pool_unpublished=ps.unpublished, pool_blocks=len(pool), pool_slots=pool.num_slots,
                       pool_held_blocks=pool.num_held(),
                       pool_disk_slots=pool.disk.num_slots if pool.disk is not None else 0,
                       pool_publishing=int(pool.publishing),
                       **{f"pool_{k}": int(v) for k, v in asdict(ps).items() if k.startswith("disk_")})
        return out

    def close(self) -> None:
        """Let reads in flight settle, close the pool. Idempotent."""
        if self.pool is None:
            return
        if self._saver is not None:
            self._saver.close()
        for load in self._loads.values():
            if load.handle is not None:
                load.handle.wait()
        if self._device_memory is not None:  # before the pool frees the pinned memory
            self._device_memory.unpin()
        self.pool.close()
        self.pool = None
        self._client.close()
