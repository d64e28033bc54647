"""The engine's /metrics as Prometheus reads it: every family has HELP and TYPE before its
samples, every statistic `LLMEngine.stats()` can return is classified (counter or gauge) in
`engine.server.metrics.ENGINE_STATS`, counters end in `_total` and never go down, and the
served node with the pool and speculation on exposes exactly the classified families."""
from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from connector.pool_scheduler import PoolScheduler
from connector.pool_worker import PoolWorker, TransferStats
from connector.saver import Saver
from connector.settings import PoolConnectorSettings
from engine.request import SamplingParams
from engine.server.memory import memory_stats
from engine.server.metrics import ENGINE_STATS, OWN_COUNTERS, OWN_GAUGES, PROCESS_STATS, Kind, Metrics, family_name
from kvpool.stats import PoolStats
from kvpool_harness.engine_node import EngineProcess
from kvpool_harness.processes import MetaserverProcess
from tests.conftest import wait_for
from tests.engine.conftest import make_engine
from tests.engine.test_spec_decode import NGRAM, copy_prompts
from tests.exposition import ExpositionError, Family, counters, parse

HISTOGRAMS = ("kvpool:time_to_first_token_seconds", "kvpool:time_per_output_token_seconds",
              "kvpool:e2e_request_latency_seconds")


def expected_families() -> dict[str, str]:
    """Every family a node with the pool and speculation on exposes, with its type."""
    out = {family_name("", k, Kind.GAUGE): "gauge" for k in OWN_GAUGES}
    out.update({family_name("", k, Kind.COUNTER): "counter" for k in OWN_COUNTERS})
    out.update({family_name("engine_", k, s.kind): s.kind.value for k, s in ENGINE_STATS.items()})
    out.update({family_name("process_", k, s.kind): s.kind.value for k, s in PROCESS_STATS.items()})
    out.update(dict.fromkeys(HISTOGRAMS, "histogram"))
    return out


# ---- the parser the tests rely on ------------------------------------------------------

GOOD = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 3\n"


@pytest.mark.parametrize("text,needle", [
    ("a_total 3\n", "outside the family"),                                        # no family at all
    ("# TYPE a_total counter\na_total 3\n", "no HELP"),
    ("# HELP a A.\n# TYPE a counter\na 3\n", "ends in _total"),
    ("# HELP a_total A.\n# TYPE a_total gauge\na_total 3\n", "ends in _total"),
    (GOOD + "b 1\n", "outside the family"),                                         # a sample of no family
    (GOOD + "# HELP b B.\n# TYPE b gauge\nb 1\na_total{x=\"2\"} 1\n", "outside the family"),  # split group
    (GOOD + "a_total{x=\"1\"} 4\n", "duplicate"),
    ("# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
     "cumulative"),
    (GOOD.rstrip("\n"), "newline"),
])
def test_the_parser_refuses_what_breaks_the_rules(text: str, needle: str) -> None:
    assert parse(GOOD)["a_total"].samples == {("a_total", (("x", "1"),)): 3.0}
    with pytest.raises(ExpositionError, match=needle):
        parse(text)


# ---- the classification ----------------------------------------------------------------

def test_every_classified_statistic_renders_as_its_kind_with_help() -> None:
    """All of ENGINE_STATS and PROCESS_STATS at once: no two keys make one family name, each
    goes out as the type the table says, and docs/METRICS.md lists it."""
    text = Metrics("m").render(dict.fromkeys(ENGINE_STATS, 1), dict.fromkeys(PROCESS_STATS, 1))
    families = parse(text)
    assert {name: f.type for name, f in families.items()} == expected_families()
    assert all(f.help for f in families.values())
    documented = (Path(__file__).resolve().parents[2] / "docs" / "METRICS.md").read_text()
    assert [name for name in families if f"`{name}`" not in documented] == []


def test_an_unclassified_statistic_goes_out_untyped_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics("m")
    with caplog.at_level(logging.WARNING, logger="engine.server.metrics"):
        for _ in range(2):
            families = parse(metrics.render({"surprise_blocks": 7, "prefill_tokens": 1}))
    assert families["kvpool:engine_surprise_blocks"].type == "untyped"
    assert "ENGINE_STATS" in (families["kvpool:engine_surprise_blocks"].help or "")
    assert families["kvpool:engine_prefill_tokens_total"].type == "counter"
    assert [r.getMessage() for r in caplog.records].count(
        "statistic engine_surprise_blocks is not classified in engine.server.metrics; exposed untyped") == 1


class _Stream:
    """An index-view stream that stays open until the test lets it end."""

    def __init__(self, end: threading.Event) -> None:
        self._end = end

    def __iter__(self) -> Iterator[object]:
        self._end.wait(30)
        return iter(())

    def cancel(self) -> None:
        self._end.set()


class _QuietClient:
    """A metaserver client nobody asks anything but the index view's stream."""

    def __init__(self) -> None:
        self.end = threading.Event()

    def watch_index(self, *args: object) -> _Stream:
        return _Stream(self.end)

    def close(self) -> None:
        """Nothing to release."""


class _Pool:
    """The levels `PoolWorker.counters` reads off a pool, without a transfer engine."""

    stats = PoolStats()
    num_slots = 4
    publishing = False
    disk = None

    def __len__(self) -> int:
        return 0

    def num_held(self) -> int:
        return 0


def test_both_connector_halves_report_only_classified_statistics() -> None:
    """The scheduler half with its index view on, the worker half with its saver and pool:
    every key they return has its row in ENGINE_STATS (the engine sums them into stats())."""
    extra = {"metaserver": "127.0.0.1:1", "node_id": "me", "lookup_view": True}
    settings = PoolConnectorSettings.from_extra(lambda k, d=None: extra.get(k, d), 30.0)
    client = _QuietClient()
    sched = PoolScheduler(settings, "ns", 16, consume=True, produce=True, client=client)  # type: ignore[arg-type]
    try:
        sched_keys = set(sched.counters())
    finally:
        client.end.set()
        sched.close()
    saver = Saver(lambda *_: True, 64, 256)
    try:
        worker = SimpleNamespace(stats=TransferStats(), _saver=saver, pool=_Pool())
        worker_keys = set(PoolWorker.counters(worker))  # type: ignore[arg-type]
    finally:
        saver.close()
    assert "lookup_view_current" in sched_keys and "pool_slots" in worker_keys  # the optional parts were there
    assert (sched_keys | worker_keys) - ENGINE_STATS.keys() == set()


def test_a_speculating_engine_counts_every_token_and_its_counters_never_go_down(loaded) -> None:  # noqa: ANN001
    """Scraped after every step of a real engine: the exposition parses, nothing is
    untyped, no counter goes down; generation_tokens_total counts every token, several per
    output when drafts are accepted."""
    engine = make_engine(loaded, max_num_seqs=4, speculative_config=NGRAM)
    metrics = Metrics("smollm2-135m")
    for prompt in copy_prompts(loaded.tokenizer):
        engine.add_request(prompt, SamplingParams(max_tokens=32))
    last = counters(parse(metrics.render(engine.stats(), memory_stats())))
    tokens: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            metrics.on_output(out)
            tokens[out.request_id] = len(out.token_ids)
        metrics.on_step(engine)
        families = parse(metrics.render(engine.stats(), memory_stats()))
        assert [n for n, f in families.items() if f.type == "untyped"] == []
        now = counters(families)
        assert now.keys() == last.keys()
        assert [k for k, v in last.items() if now[k] < v] == []
        last = now
    by_name = {name: v for (name, _), v in last.items()}
    assert by_name["kvpool:engine_spec_accepted_tokens_total"] > 0   # outputs carried several tokens
    assert by_name["kvpool:generation_tokens_total"] == sum(tokens.values()) == 64
    assert by_name["kvpool:requests_finished_total"] == 2
    assert set(engine.stats()) - ENGINE_STATS.keys() == set()


# ---- the served node ----------------------------------------------------------------------

def scrape(url: str) -> dict[str, Family]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def value(families: dict[str, Family], name: str) -> float:
    """The one sample of an unlabelled-but-for-the-model family."""
    (v,) = families[name].samples.values()
    return v


@pytest.mark.slow
def test_a_served_node_with_the_pool_exposes_documented_typed_monotonic_families(
        metaserver: MetaserverProcess, tmp_path: Path) -> None:
    """`kvpool serve --kv-connector mooncake --speculative-config ...`: two scrapes around a
    request parse, carry exactly the classified families (so no statistic is unclassified
    and no row of the table is stale), and no counter went down while some went up."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    node = EngineProcess(tmp_path / "node.log", "node-m", metaserver.address, pool_size="64MiB", extra_args=(
        "--kv-cache-bytes", "64MiB", "--threads", "2", "--speculative-config", spec))
    with node:
        before = scrape(node.url)
        node.complete(list(range(100, 164)), 8)  # four full blocks of 16 tokens to save

        def saved() -> dict[str, Family] | None:
            # Saves reach the pool on the saver's thread, after the answer: poll for them.
            families = scrape(node.url)
            return families if value(families, "kvpool:engine_connector_saved_blocks_total") > 0 else None

        after = wait_for(saved, timeout_s=30)
    want = expected_families()
    assert {n: f.type for n, f in before.items()} == want
    assert {n: f.type for n, f in after.items()} == want
    old, new = counters(before), counters(after)
    assert new.keys() == old.keys()
    assert [k for k, v in old.items() if new[k] < v] == []
    rose = {key[0] for key, v in new.items() if v > old[key]}
    assert {"kvpool:requests_finished_total", "kvpool:generation_tokens_total", "kvpool:engine_prefill_tokens_total",
            "kvpool:engine_pool_puts_total"} <= rose, rose
