"""Where a forward pass's time goes, by operation (`kvpool bench engine --ops`).

The model calls `mark(name)` after each operation when a timer is set on it
(`LlamaModel.op_timer`; None, the default, costs one attribute test per mark): the time since
the previous mark is booked to `name`. On CPU every operation has finished when it returns,
so wall time is the operation's time; on CUDA the marks would time the launches (the bench
profiles CPU runs). Not thread-safe: the engine thread owns the model.
"""
from __future__ import annotations

import time
from collections import defaultdict


class OpTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._last = time.perf_counter()

    def start(self) -> None:
        """A pass begins: nothing before it is booked."""
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self.calls[name] += 1
        self._last = now

    def table(self, wall_s: float) -> str:
        """Each operation's seconds and share of `wall_s` (the rest: scheduling, sampling, I/O)."""
        total = sum(self.seconds.values())
        rows = [f"{'operation':28} {'seconds':>9} {'share':>7}"]
        for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            rows.append(f"{name:28} {s:9.2f} {s / wall_s:7.1%}")
        rows.append(f"{'outside the forward passes':28} {wall_s - total:9.2f} {(wall_s - total) / wall_s:7.1%}")
        return "\n".join(rows)
