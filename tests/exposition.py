"""A strict parser of the Prometheus text exposition format (0.0.4) for the metrics tests
(prometheus_client is not a dependency). Stricter than Prometheus itself where our rules
are: every family has `# HELP` and `# TYPE` before its first sample, its samples are one
group, a counter's name ends in `_total`, and no sample is outside a declared family."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(\{{.*\}})? (\S+)$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\[\\"n])*)"\s*(,|$)')
_TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
# The sample names a family of each type may have (suffixes of the family's name).
_SUFFIXES = {"counter": ("",), "gauge": ("",), "untyped": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count")}

Labels = tuple[tuple[str, str], ...]


@dataclass
class Family:
    name: str
    help: str | None = None
    type: str | None = None
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)   # (sample name, labels) -> value


class ExpositionError(AssertionError):
    """The text breaks the format (or one of our rules); the message names the line."""


def parse(text: str) -> dict[str, Family]:
    """The families of `text`, by name; ExpositionError at the first line that breaks a rule."""
    families: dict[str, Family] = {}
    current: Family | None = None   # the family whose lines are being read (its samples must be contiguous)
    done: set[str] = set()          # families whose group of lines has ended
    if not text.endswith("\n"):
        raise ExpositionError("the exposition must end with a newline")
    for n, line in enumerate(text[:-1].split("\n"), 1):
        where = f"line {n}: {line!r}"
        if not line:
            raise ExpositionError(f"{where}: empty line")
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a plain comment
            _, what, name = parts[:3]
            rest = parts[3] if len(parts) > 3 else ""
            if not re.fullmatch(_NAME, name):
                raise ExpositionError(f"{where}: bad metric name")
            if name in done:
                raise ExpositionError(f"{where}: {name}'s lines are not one group")
            if current is not None and current.name != name:
                done.add(current.name)
            fam = families.setdefault(name, Family(name))
            current = fam
            if fam.samples:
                raise ExpositionError(f"{where}: {what} after {name}'s samples")
            if what == "HELP":
                if fam.help is not None or not rest.strip():
                    raise ExpositionError(f"{where}: a second or empty HELP")
                fam.help = rest
            else:
                if fam.type is not None or rest not in _TYPES:
                    raise ExpositionError(f"{where}: a second TYPE, or an unknown type")
                fam.type = rest
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ExpositionError(f"{where}: not a sample line")
        sample, labels, value = m.group(1), _labels(m.group(2), where), _value(m.group(3), where)
        if current is None or not sample.startswith(current.name) \
                or sample[len(current.name):] not in _SUFFIXES.get(current.type or "", ()):
            raise ExpositionError(f"{where}: a sample outside the family before it (declared with HELP and TYPE)")
        if current.help is None or current.type is None:
            raise ExpositionError(f"{where}: {current.name} has no HELP or no TYPE before its samples")
        if (sample, labels) in current.samples:
            raise ExpositionError(f"{where}: a duplicate sample")
        current.samples[(sample, labels)] = value
    for fam in families.values():
        _check(fam)
    return families


def _check(fam: Family) -> None:
    if fam.help is None or fam.type is None:
        raise ExpositionError(f"{fam.name}: no HELP or no TYPE")
    if not fam.samples:
        raise ExpositionError(f"{fam.name}: a family without samples")
    if (fam.type == "counter") != fam.name.endswith("_total"):
        raise ExpositionError(f"{fam.name}: a counter's name ends in _total, and only a counter's")
    if fam.type == "counter" and any(v < 0 or math.isnan(v) for v in fam.samples.values()):
        raise ExpositionError(f"{fam.name}: a negative counter")
    if fam.type == "histogram":
        series: dict[Labels, list[tuple[float, float]]] = {}
        for (sample, labels), v in fam.samples.items():
            if sample.endswith("_bucket"):
                le = dict(labels)["le"]
                rest = tuple(kv for kv in labels if kv[0] != "le")
                series.setdefault(rest, []).append((float(le), v))
        for rest, buckets in series.items():
            buckets.sort()
            counts = [c for _, c in buckets]
            if buckets[-1][0] != math.inf or counts != sorted(counts) \
                    or fam.samples.get((fam.name + "_count", rest)) != counts[-1]:
                raise ExpositionError(f"{fam.name}{dict(rest)}: buckets not cumulative up to +Inf == _count")


def _labels(text: str | None, where: str) -> Labels:
    if not text or text == "{}":
        return ()
    body, out, pos = text[1:-1], [], 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise ExpositionError(f"{where}: bad labels")
        out.append((m.group(1), m.group(2)))
        pos = m.end()
    if len({k for k, _ in out}) != len(out):
        raise ExpositionError(f"{where}: a label given twice")
    return tuple(sorted(out))


def _value(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ExpositionError(f"{where}: bad value") from None


def counters(families: dict[str, Family]) -> dict[tuple[str, Labels], float]:
    """Every counter sample, by (name, labels)."""
    return {k: v for f in families.values() if f.type == "counter" for k, v in f.samples.items()}
