"""The router's Prometheus side: metric families rendered in the text exposition format
(0.0.4), and the watch on forwarded streams that counts the ones ending in an error event.

Where it sits: `Router.metrics` (router/app.py) builds its families (and a subclass's
`extra_metrics`) as `Family` values and renders them here, so none goes out without
`# HELP` and `# TYPE`; `Router._forward` feeds every chunk of a streamed answer to an
`ErrorEvents` and counts the request in `errors_total` if one was seen. docs/METRICS.md
lists every family.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass

PREFIX = "kvpool_router:"
# An error event is a short line; a longer one without a newline is not looked into (it
# would otherwise be kept whole until its newline arrives).
MAX_LINE_BYTES = 1 << 16


class Kind(enum.Enum):
    COUNTER = "counter"   # only goes up while the router lives; the name ends in _total
    GAUGE = "gauge"       # a level


@dataclass(frozen=True, slots=True)
class Family:
    name: str                                      # the full name, PREFIX included
    kind: Kind
    help: str                                      # the `# HELP` text
    samples: tuple[tuple[str, float], ...]         # (labels as `{k="v",...}` or "", value)

    def __post_init__(self) -> None:
        if (self.kind is Kind.COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: a counter's name ends in _total, and only a counter's")


def counter(name: str, help_: str, value: float) -> Family:
    """One unlabelled counter under PREFIX (`name` ends in _total)."""
    return Family(PREFIX + name, Kind.COUNTER, help_, (("", value),))


def render(families: list[Family]) -> str:
    """The exposition text: each family's HELP and TYPE, then its samples."""
    lines: list[str] = []
    for f in families:
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.kind.value}"]
        lines += [f"{f.name}{labels} {value}" for labels, value in f.samples]
    return "\n".join(lines) + "\n"


def label_value(value: str) -> str:
    """A label value as the text format wants it (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ErrorEvents:
    """Watches a server-sent-event stream as it is passed on, chunk by chunk (a chunk may
    end anywhere in an event), for an error event: a `data:` line whose JSON has a non-empty
    `error` member (this engine's and vLLM's current form) or `"object": "error"` (vLLM's older
    one). `seen` stays True once one went by. Not thread safe: one per stream."""

    def __init__(self) -> None:
        self.seen = False
        self._tail = b""   # the last line so far, without its newline yet

    def feed(self, data: bytes) -> None:
        if self.seen:
            return
        buf = self._tail + data if self._tail else data
        head, sep, tail = buf.rpartition(b"\n")
        self._tail = tail if len(tail) <= MAX_LINE_BYTES else b""
        # Token chunks are most of a stream: one substring test each, JSON only for a candidate.
        if not sep or b'"error"' not in head:
            return
        self.seen = any(_is_error_line(line) for line in head.split(b"\n"))

    def close(self) -> None:
        """The stream ended: a last line without its newline counts too."""
        if not self.seen and self._tail:
            self.seen = _is_error_line(self._tail)
        self._tail = b""


def _is_error_line(line: bytes) -> bool:
    line = line.rstrip(b"\r")
    if not line.startswith(b"data:") or b'"error"' not in line:
        return False
    try:
        event = json.loads(line[5:])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(event, dict) and (bool(event.get("error")) or event.get("object") == "error")
