"""Prometheus metrics of the engine, rendered in the text exposition format (0.0.4) by hand.

Where it sits: the engine loop (`AsyncEngine`) feeds `Metrics.on_output` / `on_step`; the
HTTP /metrics handler calls `Metrics.render` with `LLMEngine.stats()` and the process's
memory figures. Every family goes out with `# HELP` and `# TYPE` before its samples.

`LLMEngine.stats()` is a flat dict merged from the scheduler, the block pool, the
speculator and both halves of the KV connector; whether each key is a counter (only goes
up: exposed as `kvpool:engine_<key>_total`, TYPE counter) or a level (`kvpool:engine_<key>`,
TYPE gauge) is decided here, in `ENGINE_STATS`, and nowhere else. A key missing from it
still goes out (TYPE untyped, with a HELP saying so) and is logged once; the tests fail on
it (tests/engine/test_metrics_exposition.py), so a new statistic gets classified when it
is added. docs/METRICS.md lists every family.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

log = logging.getLogger(__name__)

PREFIX = "kvpool:"
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Kind(enum.Enum):
    COUNTER = "counter"   # only goes up while the process lives; the family name ends in _total
    GAUGE = "gauge"       # a level, or a ratio of counters: goes up and down
    UNTYPED = "untyped"   # a statistic nobody classified (a bug: see ENGINE_STATS)


@dataclass(frozen=True, slots=True)
class Stat:
    kind: Kind
    help: str   # the family's `# HELP` text: what it counts, and in which unit


def _counter(help_: str) -> Stat:
    return Stat(Kind.COUNTER, help_)


def _gauge(help_: str) -> Stat:
    return Stat(Kind.GAUGE, help_)


# Every key `LLMEngine.stats()` can return, with where it comes from. Counters are summed
# over the connector's two halves by the engine, so a counter here must be one in each half.
ENGINE_STATS: dict[str, Stat] = {
    # the scheduler and the block pool (LLMEngine.stats)
    "prefill_tokens": _counter("Prompt tokens computed by the model (not hit in a cache)"),
    "local_hit_tokens": _counter("Prompt tokens hit in this node's prefix cache"),
    "remote_hit_tokens": _counter("Prompt tokens whose KV was loaded from the pool and validated"),
    "failed_load_blocks": _counter("Blocks whose load from the pool failed (recomputed)"),
    "num_preemptions": _counter("Requests preempted (their KV freed, recomputed when resumed)"),
    "num_requests_loading": _gauge("Requests waiting for their KV to load from the pool"),
    "kv_cache_blocks": _gauge("Blocks in the KV cache"),
    # the speculator (engine.spec_decode.Speculator.stats)
    "spec_proposed_tokens": _counter("Draft tokens proposed for verification"),
    "spec_accepted_tokens": _counter("Draft tokens accepted by verification"),
    "spec_verify_steps": _counter("Request steps that verified drafts"),
    "spec_batch_off_steps": _counter("Steps that proposed no drafts because the batch was too large"),
    "spec_acceptance_rate": _gauge("Accepted over proposed draft tokens since start"),
    "spec_mean_accepted_length": _gauge("Tokens per verify step since start (1 + accepted drafts)"),
    # the connector's scheduler half (connector.pool_scheduler.PoolScheduler.counters)
    "connector_hit_blocks": _counter("Blocks the pool index offered for this node's requests (anywhere in a chain)"),
    "connector_saves_skipped": _counter("Blocks not saved: computed here for the first time (selective policy)"),
    "connector_touched_blocks": _counter("Local-hit blocks marked used in this node's pool (its LRU)"),
    "connector_reoffered_blocks": _counter("Local-hit blocks saved again: the index held them nowhere"),
    "connector_handoff_loads": _counter("Requests whose hit came from a producer's transfer params (P/D)"),
    "connector_handoff_sends": _counter("Requests handed to a remote decode node (P/D)"),
    "connector_handoff_bad_params": _counter("Transfer params that could not be read (looked up instead)"),
    "connector_prefetch_requests": _counter("Stage requests sent ahead of a load for other nodes' disk blocks (prefetch on lookup)"),
    "connector_prefetch_blocks": _counter("Other nodes' disk blocks asked to be staged ahead of their load (prefetch on lookup)"),
    "connector_prefetch_staged": _counter("Prefetched disk blocks their holder staged into its DRAM"),
    "connector_prefetch_failed": _counter("Prefetched disk blocks not staged (the holder could not, or did not answer in time)"),
    "connector_prefetch_dropped": _counter("Prefetch stage requests dropped: the prefetch queue was full"),
    "connector_suspect_nodes": _gauge("Nodes whose reads just failed, not offered as a source for now"),
    "connector_avoided_blocks": _counter("Blocks not offered because their source just failed a read"),
    "lookup_queries": _counter("Prefix lookups sent to the metaserver"),
    "lookup_batches": _counter("Lookup RPCs (each carries a batch of lookups)"),
    "lookup_query_errors": _counter("Lookups answered with no hit because their RPC failed"),
    "lookup_deadline_misses": _counter("Lookups the engine stopped waiting for (past the lookup deadline)"),
    "lookup_breaker_skips": _counter("Lookups answered with no hit by the open circuit breaker, without an RPC"),
    "lookup_breaker_opens": _counter("Times the lookup circuit breaker opened"),
    "lookup_breaker_closes": _counter("Times the lookup circuit breaker closed again"),
    "lookup_breaker_open": _gauge("1 while the lookup circuit breaker is open"),
    "lookup_failed_read_reports": _counter("Failed reads reported to the metaserver"),
    "lookup_view_answers": _counter("Lookups answered by the node-local index view"),
    "lookup_view_current": _gauge("1 while the node-local index view is complete and current"),
    "lookup_view_snapshots": _counter("Index snapshots the view received"),
    "lookup_view_resumes": _counter("View reconnects that replayed changes instead of a snapshot"),
    "lookup_view_copies": _gauge("Block copies (a block on a node) the node-local index view holds"),
    # the connector's worker half (connector.pool_worker.PoolWorker.counters, with its saver)
    "connector_loaded_blocks": _counter("Blocks loaded from the pool and validated"),
    "connector_failed_blocks": _counter("Blocks whose load failed (recomputed)"),
    "connector_saved_blocks": _counter("Blocks saved into this node's pool"),
    "connector_sent_blocks": _counter("Blocks named to a remote decode node (P/D sends)"),
    "connector_loads": _counter("Loads finished (delivered or failed)"),
    "connector_load_seconds": _counter("Seconds from issue to finish of the finished loads, summed"),
    "connector_saves_queued": _counter("Blocks handed to the asynchronous save copier"),
    "connector_saves_copied": _counter("Blocks the save copier put into the pool (new there)"),
    "connector_saves_dropped_behind": _counter("Blocks not saved: the copier had its maximum waiting"),
    "connector_saves_dropped_reused": _counter("Blocks not saved: the engine reused the cache block first"),
    "connector_fence_waits": _counter("Steps that waited for a save copy of a block they write"),
    "connector_saves_pending": _gauge("Blocks waiting for (or in) the save copier"),
    # the node's pool (kvpool.stats.PoolStats and the pool's levels)
    "pool_puts": _counter("Blocks written into pool slots"),
    "pool_evictions": _counter("Pool slots freed by LRU eviction"),
    "pool_bytes_read": _counter("Payload bytes delivered by pool reads"),
    "pool_failed_reads": _counter("Block reads that failed or did not validate"),
    "pool_quarantined_slots": _counter("Read-buffer slots lost to failed transfers (never reused: bytes may still land)"),
    "pool_remote_hit_blocks": _counter("Blocks read from other nodes' pools and validated"),
    "pool_local_hit_blocks": _counter("Blocks read from this node's own pool"),
    "pool_published": _counter("Block records acknowledged by the metaserver"),
    "pool_unpublished": _counter("Block records withdrawn from the metaserver (evicted slots)"),
    "pool_blocks": _gauge("Blocks held in this node's pool"),
    "pool_slots": _gauge("Slots in this node's pool"),
    "pool_publishing": _gauge("1 while blocks put are not yet sent to the metaserver"),
    # the pool's disk tier (kvpool.disk; all 0 without one)
    "pool_disk_enabled": _gauge("1 while this node's disk tier is on (0 after an I/O error turned it off)"),
    "pool_disk_blocks": _gauge("Blocks held in this node's disk tier"),
    "pool_held_blocks": _gauge("Blocks this node's pool holds, in DRAM or only on its disk tier (as indexed)"),
    "pool_disk_slots": _gauge("Slots in this node's disk tier (0 without one)"),
    "pool_disk_writes": _counter("Blocks written to the disk tier (evicted from DRAM)"),
    "pool_disk_hits": _counter("Blocks read from the disk tier and validated"),
    "pool_disk_failed_reads": _counter("Disk tier reads that did not validate (torn, stale or foreign slots)"),
    "pool_disk_evictions": _counter("Disk tier slots reused by LRU eviction"),
    "pool_disk_errors": _counter("Disk tier I/O errors (each turns the tier off)"),
    "pool_disk_dropped_writes": _counter("Evicted blocks not written to disk: the writer's queue was full"),
    "pool_disk_staged": _counter("Disk tier blocks promoted into DRAM for other nodes' reads"),
}

# `engine.server.memory.memory_stats()`: levels, exposed as `kvpool:process_<key>`.
PROCESS_STATS: dict[str, Stat] = {
    "rss_bytes": _gauge("Resident set size of the server process"),
    "malloc_in_use_bytes": _gauge("Bytes glibc malloc has handed out and not had back"),
    "malloc_free_bytes": _gauge("Free bytes glibc malloc keeps in its arenas"),
}

# The server's own series (from the outputs the engine loop delivers, and its state).
OWN_COUNTERS: dict[str, str] = {
    "requests_finished": "Requests finished (any finish reason)",
    "prompt_tokens": "Prompt tokens of the requests that produced a first token",
    "generation_tokens": "Tokens generated",
    "prefix_cache_hit_tokens": "Prompt tokens hit in this node's prefix cache, per request",
    "remote_kv_hit_tokens": "Prompt tokens loaded from the pool, per request",
}
OWN_GAUGES: dict[str, str] = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting to be scheduled",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0 to 1)",
    "prefix_cache_hit_rate": "Prompt tokens hit over tokens looked up in the prefix cache, since start",
}


def family_name(prefix: str, key: str, kind: Kind) -> str:
    """`kvpool:<prefix><key>`, with `_total` for a counter (Prometheus' naming rule)."""
    return f"{PREFIX}{prefix}{key}" + ("_total" if kind is Kind.COUNTER else "")


class Histogram:
    """Cumulative buckets of observed seconds. Not thread safe: `Metrics` holds its lock."""

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        i = next((k for k, b in enumerate(_BUCKETS) if v <= b), len(_BUCKETS))
        self.counts[i] += 1
        self.total += v
        self.n += 1

    def render(self, name: str, help_: str, labels: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(_BUCKETS, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {acc}')
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {self.n}', f"{name}_sum{{{labels}}} {self.total}",
                f"{name}_count{{{labels}}} {self.n}"]
        return out


@dataclass(slots=True)
class _Live:
    first_at: float   # monotonic time of the request's first token
    tokens: int       # tokens generated so far (counted into generation_tokens)


class Metrics:
    """Updated from the engine thread, read by the HTTP thread; every method takes the lock."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self._lock = threading.Lock()
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.counters: dict[str, float] = dict.fromkeys(OWN_COUNTERS, 0)
        self.gauges: dict[str, float] = dict.fromkeys(OWN_GAUGES, 0)
        self._live: dict[str, _Live] = {}
        self._warned: set[str] = set()   # unclassified stats already logged

    def on_output(self, out: RequestOutput) -> None:
        """Count one output of a request (it carries all of its tokens so far)."""
        with self._lock:
            now = time.monotonic()
            live = self._live.get(out.request_id)
            # A speculative step can add several tokens to one output: count what is new.
            self.counters["generation_tokens"] += max(0, len(out.token_ids) - (live.tokens if live else 0))
            if live is None and out.token_ids:
                live = self._live[out.request_id] = _Live(now, 0)
                if out.ttft_s is not None:
                    self.ttft.observe(out.ttft_s)
                self.counters["prompt_tokens"] += len(out.prompt_token_ids)
                self.counters["prefix_cache_hit_tokens"] += out.num_cached_tokens
                self.counters["remote_kv_hit_tokens"] += out.num_external_tokens
            if live is not None:
                live.tokens = len(out.token_ids)
            if out.finished:
                self.counters["requests_finished"] += 1
                self._live.pop(out.request_id, None)
                if live is not None and len(out.token_ids) > 1:
                    self.tpot.observe((now - live.first_at) / (len(out.token_ids) - 1))
                if live is not None and out.ttft_s is not None:
                    self.e2e.observe(out.ttft_s + (now - live.first_at))

    def forget(self, request_id: str) -> None:
        """Drop what is kept of a request that ends without a finished output (an abort)."""
        with self._lock:
            self._live.pop(request_id, None)

    def on_step(self, engine: LLMEngine) -> None:
        with self._lock:
            self.gauges["num_requests_running"] = engine.scheduler.num_running
            self.gauges["num_requests_waiting"] = engine.scheduler.num_waiting
            self.gauges["kv_cache_usage_perc"] = engine.block_pool.usage()
            self.gauges["prefix_cache_hit_rate"] = engine.prefix_cache_hit_rate()

    def render(self, engine_stats: dict[str, float], process_stats: dict[str, int] | None = None) -> str:
        """The exposition text; `engine_stats` are `LLMEngine.stats()`, `process_stats` the
        process's memory (`engine.server.memory.memory_stats()`). Every sample carries the
        model_name label."""
        labels = f'model_name="{_escape(self.model)}"'
        lines: list[str] = []
        with self._lock:
            for key, help_ in OWN_GAUGES.items():
                lines += _family(family_name("", key, Kind.GAUGE), Kind.GAUGE, help_, labels, self.gauges[key])
            for key, help_ in OWN_COUNTERS.items():
                lines += _family(family_name("", key, Kind.COUNTER), Kind.COUNTER, help_, labels, self.counters[key])
            for prefix, values, table in (("engine_", engine_stats, ENGINE_STATS),
                                          ("process_", process_stats or {}, PROCESS_STATS)):
                for key, value in values.items():
                    stat = table.get(key) or self._unclassified(prefix + key)
                    lines += _family(family_name(prefix, key, stat.kind), stat.kind, stat.help, labels, value)
            lines += self.ttft.render(f"{PREFIX}time_to_first_token_seconds", "Arrival to first token", labels)
            lines += self.tpot.render(f"{PREFIX}time_per_output_token_seconds",
                                      "Mean time per output token after the first, per request", labels)
            lines += self.e2e.render(f"{PREFIX}e2e_request_latency_seconds", "Arrival to last token", labels)
        return "\n".join(lines) + "\n"

    def _unclassified(self, name: str) -> Stat:
        # Going out untyped keeps the number visible; the log and the tests make it a bug to fix.
        if name not in self._warned:
            self._warned.add(name)
            log.warning("statistic %s is not classified in engine.server.metrics; exposed untyped", name)
        return Stat(Kind.UNTYPED, "Not classified: add it to ENGINE_STATS or PROCESS_STATS in "
                                  "engine/server/metrics.py")


def _family(name: str, kind: Kind, help_: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind.value}", f"{name}{{{labels}}} {value}"]


def _escape(value: str) -> str:
    """A label value as the text format wants it (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
