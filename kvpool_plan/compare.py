"""Per request, the simulator's prediction beside a real run (`kvpool plan compare`).

    kvpool plan --trace T ... --json sim.json
    kvpool bench cross-node --workload trace --trace T ... --out real.json
    kvpool plan compare --sim-report sim.json --real-report real.json [--config pool-on] [--run 0]

Joins the two by request id (`t<i>`: the i-th row of the replayed window, as both name
them) and prints TTFT p50 / p99 predicted and measured over the requests both hold, the
distribution of predicted / measured TTFT, the same split by whether the real request hit
the pool, how often the two agree on a request's hit tokens, and the requests the model
misses most. It reads reports only; nothing is run.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence

from kvpool_bench.report import pct


def sim_rows(requests: Sequence) -> list[dict]:
    """A replay's requests (`kvpool_plan.sim.SimRequest`) as the report's per-request rows,
    named as `kvpool bench cross-node` names a trace's requests."""
    out = []
    for r in requests:
        out.append({"rid": f"t{r.idx}", "node": r.node, "prompt_tokens": r.num_tokens,
                    "output_tokens": r.output_tokens, "local_hit_blocks": r.local_blocks,
                    "pool_hit_blocks": r.pool_blocks,
                    "computed_tokens": r.computed_tokens, "start_s": r.arrival_s,
                    "ttft_s": r.first_token_s - r.arrival_s, "e2e_s": r.end_s - r.arrival_s,
                    "load_s": r.load_end_s - r.load_start_s, "failed_blocks": r.failed_blocks})
    return out


def _dist(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": min(xs), "p10": pct(list(xs), 10), "p50": pct(list(xs), 50),
            "p90": pct(list(xs), 90), "max": max(xs)}


def compare(sim: Sequence[dict], real: Sequence[dict], worst: int = 5) -> dict:
    """`sim`: `sim_rows`; `real`: a cross-node report's rows of one config (failed requests
    left out). Requests joined by `rid`."""
    real_ok = {r["rid"]: r for r in real if not r.get("error")}
    by_sim = {r["rid"]: r for r in sim}
    both = [(by_sim[k], real_ok[k]) for k in by_sim if k in real_ok]
    out: dict = {"sim_requests": len(sim), "real_requests": len(real), "real_errors": len(real) - len(real_ok),
                 "joined": len(both)}
    if not both:
        return out
    pred = [s["ttft_s"] for s, _ in both]
    meas = [r["ttft_s"] for _, r in both]
    ratio = [s["ttft_s"] / r["ttft_s"] for s, r in both if r["ttft_s"] > 0]
    out.update({"ttft_p50_sim_s": pct(pred, 50), "ttft_p50_real_s": pct(meas, 50),
                "ttft_p99_sim_s": pct(pred, 99), "ttft_p99_real_s": pct(meas, 99), "ttft_ratio": _dist(ratio)})
    groups: dict[str, list[float]] = {"real pool hit": [], "no real pool hit": []}
    for s, r in both:
        if r["ttft_s"] > 0:
            groups["real pool hit" if r.get("remote_hit_tokens", 0) else "no real pool hit"].append(
                s["ttft_s"] / r["ttft_s"])
    out["ttft_ratio_by_group"] = {k: _dist(v) for k, v in groups.items()}
    same = 0
    for s, r in both:
        bs_tokens = s["prompt_tokens"] - s["computed_tokens"]
        same += bs_tokens == r.get("local_hit_tokens", 0) + r.get("remote_hit_tokens", 0)
    out["same_hit_tokens"] = same / len(both)
    misses = sorted(both, key=lambda sr: abs(_log_ratio(sr[0]["ttft_s"], sr[1]["ttft_s"])), reverse=True)
    out["worst"] = [{"rid": s["rid"], "ttft_sim_s": s["ttft_s"], "ttft_real_s": r["ttft_s"],
                     "hit_sim_tokens": s["prompt_tokens"] - s["computed_tokens"],
                     "hit_real_tokens": r.get("local_hit_tokens", 0) + r.get("remote_hit_tokens", 0)}
                    for s, r in misses[:worst]]
    return out


def _log_ratio(a: float, b: float) -> float:
    return math.log(a / b) if a > 0 and b > 0 else math.inf


def load_reports(sim_path: str, real_path: str, config: str = "", run: int = 0) -> tuple[list[dict], list[dict], str]:
    """The sim report's `run`-th run's requests and the real report's rows of `config` (default:
    pool-on if there, else its only config); ValueError (one line) when they cannot be read."""
    docs = []
    for path in (sim_path, real_path):
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except OSError as err:
            raise ValueError(f"{path}: {err.strerror or err}") from None
        except ValueError as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
    sim, real = docs
    runs = sim.get("runs") if isinstance(sim, dict) else None
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{sim_path}: not a `kvpool plan --json` report")
    if not 0 <= run < len(runs) or "request_rows" not in runs[run]:
        raise ValueError(f"{sim_path}: no run {run} with per-request rows (written by `kvpool plan --json`)")
    reqs = real.get("requests") if isinstance(real, dict) else None
    if not isinstance(reqs, dict) or not reqs:
        raise ValueError(f"{real_path}: not a `kvpool bench cross-node` report (no per-request rows)")
    if not config:
        config = "pool-on" if "pool-on" in reqs else (next(iter(reqs)) if len(reqs) == 1 else "")
        if not config:
            raise ValueError(f"{real_path} holds configs {', '.join(reqs)}: name one with --config")
    if config not in reqs:
        raise ValueError(f"{real_path}: no config {config!r} (it holds {', '.join(reqs)})")
    return runs[run]["request_rows"], reqs[config], config


def _d(d: dict) -> str:
    if not d.get("n"):
        return "no requests"
    return (f"n {d['n']}: min {d['min']:.2f}, p10 {d['p10']:.2f}, p50 {d['p50']:.2f}, p90 {d['p90']:.2f}, "
            f"max {d['max']:.2f}")


def report(c: dict, config: str = "") -> str:
    lines = [f"{c['joined']} requests joined (simulated {c['sim_requests']}, real {c['real_requests']} "
             f"of which {c['real_errors']} failed){f', real config {config}' if config else ''}"]
    if not c["joined"]:
        return lines[0]
    lines += [
        f"TTFT p50  simulated {c['ttft_p50_sim_s']:.3f} s, measured {c['ttft_p50_real_s']:.3f} s "
        f"({c['ttft_p50_sim_s'] / c['ttft_p50_real_s'] - 1:+.0%})" if c["ttft_p50_real_s"] else "",
        f"TTFT p99  simulated {c['ttft_p99_sim_s']:.3f} s, measured {c['ttft_p99_real_s']:.3f} s",
        f"simulated / measured TTFT per request: {_d(c['ttft_ratio'])}",
    ]
    for k, v in c["ttft_ratio_by_group"].items():
        lines.append(f"  {k + ':':18s} {_d(v)}")
    lines.append(f"same hit tokens as measured: {c['same_hit_tokens']:.1%} of requests")
    lines.append("furthest off (TTFT simulated / measured, hit tokens simulated / measured):")
    for w in c["worst"]:
        lines.append(f"  {w['rid']:>8}  {w['ttft_sim_s']:.3f} / {w['ttft_real_s']:.3f} s  "
                     f"hits {w['hit_sim_tokens']} / {w['hit_real_tokens']}")
    return "\n".join(x for x in lines if x)
