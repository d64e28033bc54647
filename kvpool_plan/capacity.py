"""`kvpool plan capacity`: the prefix hit rate a shared cache of each size reaches on a trace,
the analysis of the Mooncake FAST'25 paper's Figure 9 ("quantitative analysis of prefix cache
hit rates with varying cache capacities").

    kvpool plan capacity --trace A.jsonl,B.jsonl [--capacities 1e4,1e5,1e6,3e6,1e7,5e7,1e8]
        [--mark 3e6] [--all] [--json OUT] [--plot OUT.png]

As the paper's figure does, it considers only the sequence of requests (no compute time, no
replicas): requests in trace order through one cache of C tokens, each looking up the
longest prefix of its hash ids the cache holds, then putting all of its ids. A trace's hash
id names a block of `block_tokens` tokens (512 in Mooncake's traces) with everything before
it, so a capacity of C tokens holds C // block_tokens ids. The hit rate is of prompt tokens (a
hit id counts its tokens, the last cut at the request's input length). Per capacity: LRU (`kvpool_bench.workloads.lru_hits`) and Belady's rule
(`belady_hits`); the infinite cache's rate is the theoretical maximum, and `--mark` says
what fraction of it a cache of that size reaches (the paper marks 3M tokens, one node's
DRAM for LLaMA3-70B). `--all` adds the traces together, merged by arrival time with their
ids kept apart, as the paper's "All" line.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from kvpool_bench.workloads import belady_hits, lru_hits

DEFAULT_CAPACITIES = (1e4, 1e5, 1e6, 2e6, 3e6, 4e6, 5e6, 8e6, 1e7, 5e7, 1e8, 1e9)  # the paper's points and 3M


def _ids(rows: Sequence[dict]) -> list[list[int]]:
    out = []
    for i, row in enumerate(rows):
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            raise ValueError(f"row {i + 1}: hash_ids must be a list of integers")
        out.append(ids)
    return out


def merge(traces: Sequence[Sequence[dict]]) -> list[dict]:
    """The traces as one, by arrival time (stable: a trace's own order is kept), each trace's
    ids moved to a range of their own (two traces' id 7 are different blocks)."""
    rows = []
    offset = 0
    for t, trace in enumerate(traces):
        ids = _ids(trace)
        top = max((h for r in ids for h in r), default=-1) + 1
        rows.extend((r.get("timestamp", 0), t, j, {**r, "hash_ids": [h + offset for h in rid]})
                    for j, (r, rid) in enumerate(zip(trace, ids, strict=True)))
        offset += top
    rows.sort(key=lambda x: x[:3])
    return [r for *_, r in rows]


def curve(rows: Sequence[dict], capacities_tokens: Sequence[float], block_tokens: int = 512,
          belady: bool = True) -> dict:
    """Hit rates of a cache of each capacity, and of an infinite one: prompt tokens hit (a hit
    id's `block_tokens`, the last one cut at the request's `input_length`) over all prompt
    tokens."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    ids = _ids(rows)
    lengths = [int(r.get("input_length") or len(i) * block_tokens) for r, i in zip(rows, ids, strict=True)]
    total = sum(lengths) or 1

    def rate(hits: Sequence[int]) -> float:
        return sum(min(h * block_tokens, n) for h, n in zip(hits, lengths, strict=True)) / total

    points = []
    for c in capacities_tokens:
        blocks = max(1, int(c // block_tokens))
        p = {"capacity_tokens": c, "capacity_blocks": blocks, "lru": rate(lru_hits(ids, ids, blocks))}
        if belady:
            p["belady"] = rate(belady_hits(ids, ids, blocks))
        points.append(p)
    return {"requests": len(ids), "prompt_tokens": total, "blocks": sum(len(r) for r in ids),
            "unique_blocks": len({h for r in ids for h in r}), "infinite": rate(lru_hits(ids, ids, sys.maxsize)),
            "points": points}


def at_mark(c: dict, mark_tokens: float, block_tokens: int = 512) -> dict:
    """The LRU (and Belady) hit rate at `mark_tokens` as a fraction of the infinite cache's."""
    blocks = max(1, int(mark_tokens // block_tokens))
    p = next((p for p in c["points"] if p["capacity_blocks"] == blocks), None)
    if p is None:
        raise ValueError(f"the mark {mark_tokens:g} tokens is not among the capacities")
    inf = c["infinite"] or 1.0
    return {k: p[k] / inf for k in ("lru", "belady") if k in p}


def table(curves: dict[str, dict]) -> str:
    """One row per capacity, an LRU and a Belady column per trace (hit rates in %)."""
    names = list(curves)
    head = f"{'capacity (tokens)':>18} " + " ".join(f"{n[:16] + ' LRU':>21} {'Belady':>7}" for n in names)
    lines = [head]
    for i, p in enumerate(next(iter(curves.values()))["points"]):
        cells = []
        for n in names:
            q = curves[n]["points"][i]
            cells.append(f"{100 * q['lru']:20.1f}% " + (f"{100 * q['belady']:6.1f}%" if "belady" in q else f"{'-':>7}"))
        lines.append(f"{p['capacity_tokens']:18,.0f} " + " ".join(cells))
    lines.append(f"{'infinite':>18} " + " ".join(f"{100 * curves[n]['infinite']:20.1f}% {'':>7}" for n in names))
    return "\n".join(lines)


def plot(curves: dict[str, dict], out: str, mark_tokens: float = 0.0, reference: dict | None = None) -> str:
    """Hit rate against capacity (log scale), one LRU line per trace, Belady dotted, the
    mark as a dashed line, as the paper's Figure 9 draws it; `reference` ({"curves": {name:
    [[tokens, rate], ...]}, "label": ...}): published points drawn as crosses beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colors = {}
    for name, c in curves.items():
        xs = [p["capacity_tokens"] for p in c["points"]]
        line, = ax.plot(xs, [p["lru"] for p in c["points"]], marker="o", ms=3, label=f"{name} (LRU)")
        colors[name] = line.get_color()
        if all("belady" in p for p in c["points"]):
            ax.plot(xs, [p["belady"] for p in c["points"]], ls=":", color=line.get_color(), lw=1)
        ax.axhline(c["infinite"], color=line.get_color(), lw=0.5, alpha=0.5)
    for name, pts in (reference or {}).get("curves", {}).items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], ls="--", marker="x", ms=4, lw=0.8,
                color=colors.get(name, "gray"), label=f"{name} ({reference.get('label', 'reference')})")
    if mark_tokens:
        ax.axvline(mark_tokens, color="gray", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (of prompt tokens)")
    ax.set_ylim(0, max(0.1, max(c["infinite"] for c in curves.values()) * 1.15))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
