"""The timeline of a `kvpool bench chaos` run as one figure, from its JSON report: the fault
events as shaded spans (two faults at once darker, quorum losses and partitions marked),
and per window of `--window-s` seconds the hit rate, TTFT p50 / p99, the failed attempts,
and each process's RSS. `python -m kvpool_bench.chaos_plot REPORT.json [OUT.png]` draws it
for a report written earlier."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpool_bench.report import pct


def process_names(sample: dict) -> list[str]:
    """The process names in one of the report's RSS samples (its other keys are not RSS)."""
    return [k for k in sample if k not in ("t_s", "pids", "etcd")]


def windows(requests: list[dict], window_s: float) -> list[dict]:
    """Per window (by start time): hit rate, TTFT p50 / p99 of the answered, failed attempts."""
    end = max((r["start_s"] for r in requests), default=0.0)
    out = []
    lo = 0.0
    while lo <= end:
        w = [r for r in requests if lo <= r["start_s"] < lo + window_s]
        ok = [r for r in w if r["answered"]]
        prompt = sum(r["prompt_tokens"] for r in ok)
        out.append({"t_s": lo + window_s / 2, "hit_rate": sum(r["hit_tokens"] for r in ok) / prompt if prompt else None,
                    "ttft_p50": pct([r["ttft_s"] for r in ok], 50) if ok else None,
                    "ttft_p99": pct([r["ttft_s"] for r in ok], 99) if ok else None,
                    "failed_attempts": sum(r["attempts"] - r["answered"] for r in w)})
        lo += window_s
    return out


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    w = windows(report["requests"], float(report["args"].get("window_s", 20.0)))
    fig, axes = plt.subplots(4, 1, figsize=(14, 11), sharex=True)
    for ax in axes:
        for f in s["faults"]:
            ax.axvspan(f["at_s"], f["healed_s"], color="tab:red", alpha=0.25 if f["double"] else 0.12, lw=0)
        for name, (lo, hi) in s["phases"].items():
            if name != "chaos":
                ax.axvspan(lo, hi, color="tab:green", alpha=0.05, lw=0)
    t = [x["t_s"] for x in w]
    axes[0].plot(t, [x["hit_rate"] for x in w], color="tab:blue")
    axes[0].set_ylabel("hit rate")
    axes[0].set_ylim(0, 1)
    for f in s["faults"]:
        marks = [m for m, on in (("Q", f["quorum_loss"]), ("P", any(x.startswith("partition") for x in f["faults"])))
                 if on]
        if marks:
            axes[0].text(f["at_s"], 0.02, "".join(marks), fontsize=6, color="tab:red")
    axes[1].plot(t, [x["ttft_p50"] for x in w], label="p50")
    axes[1].plot(t, [x["ttft_p99"] for x in w], label="p99")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend(loc="upper right")
    axes[2].bar(t, [x["failed_attempts"] for x in w], width=float(report["args"].get("window_s", 20.0)) * 0.8,
                color="tab:orange")
    axes[2].set_ylabel("failed attempts")
    samples = report.get("rss_samples", [])
    names = process_names(samples[0]) if samples else []
    for n in names:
        axes[3].plot([x["t_s"] for x in samples], [x[n] / 2 ** 20 for x in samples], label=n, lw=0.8)
    axes[3].set_ylabel("RSS (MiB)")
    axes[3].set_yscale("log")
    axes[3].legend(loc="upper left", ncol=5, fontsize=7)
    axes[3].set_xlabel("seconds from the start of the workload (shaded: faults, darker: two at once; "
                       "Q quorum lost, P partition)")
    faults = [x for f in s["faults"] for x in f["faults"]]
    fig.suptitle(f"kvpool bench chaos, seed {report['seed']}: {len(s['faults'])} events, {len(faults)} faults, "
                 f"{s['requests']} requests, {s['wrong']} wrong, {s['failed']} failed; verdict {s['verdict']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m kvpool_bench.chaos_plot REPORT.json [OUT.png]", file=sys.stderr)
        return 2
    report_path = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else report_path.with_name("timeline.png")
    print(plot(json.loads(report_path.read_text()), out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
