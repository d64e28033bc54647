"""A model profile: what a request costs on one node, for `kvpool plan`.

A small JSON file (keys below; any key starting with `_` is a comment, e.g. `_sources`):

- `block_size`: tokens per KV block (the engine's).
- `kv_bytes_per_token`: KV bytes of one token, all layers, K and V (a block is
  `block_size` times that).
- `prefill_tok_per_s`: [[tokens, tokens/s], ...] measured prefill rates of one prompt of
  that many tokens (a prefill at a time); linear in between, clamped outside.
- `prefill_overhead_s`: fixed cost of a prefill pass however few tokens it computes.
- `decode_tok_per_s`: [[batch, output tokens/s of the whole batch], ...]: a decode step at
  batch b takes b / rate(b) seconds; linear in between, clamped outside.
- `link_bytes_per_s`, `link_latency_s`: a pull of B bytes from other nodes' pools costs
  latency + B / bandwidth (the reader's link).
- `local_copy_bytes_per_s`: a load from the node's own pool (a memcpy).
- `disk_read_bytes_per_s`, `disk_read_latency_s`: a read from a disk tier (`kvpool plan
  --disk`): a block costs latency + its bytes / the rate, blocks one after another (the
  pool reads its disk blocks in turn, `kvpool.tier_reads`); another node's disk block is
  read so by its holder, then pulled over the link. Defaults: 1e9 B/s (the order of this
  project's VM's measured tier reads, docs/BENCHMARKS.md "Disk tier") and 0 s; a profile
  states its own in `_sources`.

`kvpool plan calibrate` measures these on a machine with the real engine
(`kvpool_plan.calibrate`). The shipped profiles' figures are read from docs/BENCHMARKS.md and
its history docs/journal/benchmarks-history.md (this machine) and from published figures (a
GPU deployment), each named in the file.
"""
from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def _interp(points: tuple[tuple[float, float], ...], x: float) -> float:
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect_left(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ModelProfile:
    name: str
    block_size: int
    kv_bytes_per_token: int
    prefill_tok_per_s: tuple[tuple[float, float], ...]
    decode_tok_per_s: tuple[tuple[float, float], ...]
    link_bytes_per_s: float
    link_latency_s: float = 0.0
    local_copy_bytes_per_s: float = 1e10
    prefill_overhead_s: float = 0.0
    disk_read_bytes_per_s: float = 1e9
    disk_read_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("block_size and kv_bytes_per_token must be >= 1")
        for key in ("prefill_tok_per_s", "decode_tok_per_s"):
            pts = getattr(self, key)
            if not pts or any(len(p) != 2 or p[0] <= 0 or p[1] <= 0 for p in pts) \
                    or any(a[0] >= b[0] for a, b in zip(pts, pts[1:])):
                raise ValueError(f"{key} must be [[x, rate], ...] with x > 0 increasing and rate > 0")
        if self.link_bytes_per_s <= 0 or self.local_copy_bytes_per_s <= 0:
            raise ValueError("link_bytes_per_s and local_copy_bytes_per_s must be > 0")
        if self.link_latency_s < 0 or self.prefill_overhead_s < 0:
            raise ValueError("link_latency_s and prefill_overhead_s must be >= 0")
        if not self.disk_read_bytes_per_s > 0 or not self.disk_read_latency_s >= 0:
            raise ValueError("disk_read_bytes_per_s must be > 0 and disk_read_latency_s >= 0")

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prefill_s(self, tokens: int) -> float:
        """One prompt's prefill computing `tokens` tokens (at least its last one)."""
        tokens = max(1, tokens)
        return self.prefill_overhead_s + tokens / _interp(self.prefill_tok_per_s, tokens)

    def decode_step_s(self, batch: int) -> float:
        batch = max(1, batch)
        return batch / _interp(self.decode_tok_per_s, batch)

    def pull_s(self, remote_bytes: int, local_bytes: int = 0) -> float:
        """Loading `remote_bytes` from other nodes' pools and `local_bytes` from its own."""
        t = local_bytes / self.local_copy_bytes_per_s
        if remote_bytes:
            t += self.link_latency_s + remote_bytes / self.link_bytes_per_s
        return t

    def disk_read_s(self, nbytes: int, blocks: int) -> float:
        """Reading `blocks` blocks (`nbytes` in all) from a disk tier, one after another."""
        if not blocks:
            return 0.0
        return blocks * self.disk_read_latency_s + nbytes / self.disk_read_bytes_per_s


def load_profile(path: str | Path) -> ModelProfile:
    """A profile from a JSON file, or a shipped one by name (`cpu-smollm2-135m`);
    ValueError (one line) when it cannot be read or is not valid."""
    p = Path(path)
    if not p.exists() and (PROFILES_DIR / f"{path}.json").exists():
        p = PROFILES_DIR / f"{path}.json"
    try:
        raw = json.loads(p.read_text())
    except OSError as err:
        raise ValueError(f"model profile {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"model profile {path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model profile {path}: not a JSON object")
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    fields.setdefault("name", p.stem)
    try:
        for key in ("prefill_tok_per_s", "decode_tok_per_s"):
            if key in fields:
                fields[key] = tuple(tuple(float(x) for x in pt) for pt in fields[key])
        return ModelProfile(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"model profile {path}: {err}") from None
