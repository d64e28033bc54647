"""Prometheus metrics of the engine, rendered in the text exposition format by hand."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        i = next((k for k, b in enumerate(_BUCKETS) if v <= b), len(_BUCKETS))
        self.counts[i] += 1
        self.total += v
        self.n += 1

    def render(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(_BUCKETS, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """Updated from the engine thread, read by the HTTP thread; guarded by a lock."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self._lock = threading.Lock()
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.counters = {"requests_finished": 0, "prompt_tokens": 0, "generation_tokens": 0,
                         "prefix_cache_hit_tokens": 0, "remote_kv_hit_tokens": 0}
        self.gauges = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                       "prefix_cache_hit_rate": 0.0}
        self._first: dict[str, float] = {}

    def on_output(self, out: RequestOutput) -> None:
        with self._lock:
            now = time.monotonic()
            self.counters["generation_tokens"] += 1
            if len(out.token_ids) == 1 and out.ttft_s is not None:
                self.ttft.observe(out.ttft_s)
                self._first[out.request_id] = now
                self.counters["prompt_tokens"] += len(out.prompt_token_ids)
                self.counters["prefix_cache_hit_tokens"] += out.num_cached_tokens
                self.counters["remote_kv_hit_tokens"] += out.num_external_tokens
            if out.finished:
                self.counters["requests_finished"] += 1
                first = self._first.pop(out.request_id, None)
                if first is not None and len(out.token_ids) > 1:
                    self.tpot.observe((now - first) / (len(out.token_ids) - 1))
                if out.ttft_s is not None and first is not None:
                    self.e2e.observe(out.ttft_s + (now - first))

    def on_step(self, engine: LLMEngine) -> None:
        with self._lock:
            self.gauges["num_requests_running"] = engine.scheduler.num_running
            self.gauges["num_requests_waiting"] = engine.scheduler.num_waiting
            self.gauges["kv_cache_usage_perc"] = engine.block_pool.usage()
            self.gauges["prefix_cache_hit_rate"] = engine.prefix_cache_hit_rate()

    def render(self, engine_stats: dict[str, float], process_stats: dict[str, int] | None = None) -> str:
        """The exposition text; `engine_stats` are the engine's counters (`LLMEngine.stats()`),
        `process_stats` the process's memory (`engine.server.memory.memory_stats()`)."""
        p = "kvpool:"
        lines: list[str] = []
        with self._lock:
            for k, v in self.gauges.items():
                lines += [f"# TYPE {p}{k} gauge", f'{p}{k}{{model_name="{self.model}"}} {v}']
            for k, v in self.counters.items():
                lines += [f"# TYPE {p}{k}_total counter", f'{p}{k}_total{{model_name="{self.model}"}} {v}']
            for prefix, values in (("engine_", engine_stats), ("process_", process_stats or {})):
                for k, v in values.items():
                    lines += [f"# TYPE {p}{prefix}{k} gauge", f'{p}{prefix}{k}{{model_name="{self.model}"}} {v}']
            lines += self.ttft.render(f"{p}time_to_first_token_seconds", "Time to first token")
            lines += self.tpot.render(f"{p}time_per_output_token_seconds", "Time per output token after the first")
            lines += self.e2e.render(f"{p}e2e_request_latency_seconds", "Arrival to last token")
        return "\n".join(lines) + "\n"
