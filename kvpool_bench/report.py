"""Helpers every benchmark shares: percentiles and the JSON report file."""
from __future__ import annotations

import json
from pathlib import Path

# Goodput's service-level objectives by default (`kvpool bench pd`, `kvpool plan`): a request
# counts when its TTFT and its TPOT (mean gap between tokens after the first) are within them.
TTFT_SLO_S = 4.0
TPOT_SLO_S = 0.15


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank below); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def write_report(path: str, report: dict) -> None:
    """Write the report as JSON (creating folders) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nreport: {out}")
