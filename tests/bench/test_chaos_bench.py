"""`kvpool bench chaos`: the nemesis's schedule (fast, no processes) and a short seeded run
(slow: etcd x3, two metaserver replicas, two nodes with the real model and disk tiers, the
router; faults every few seconds, among them a partition and a removed disk tier) whose
checker must pass."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool_bench.chaos import ETCD, Fault, conversations, etcd_gauges, instances, rss_by_age, rss_growth, schedule
from kvpool_bench.chaos_plot import windows

SHORT = {"duration_s": 60, "interval": (4.0, 8.0), "heal": (2.0, 5.0)}


def test_same_seed_same_schedule_and_seeds_differ() -> None:
    assert schedule(7, **SHORT) == schedule(7, **SHORT)  # type: ignore[arg-type]
    assert schedule(7, **SHORT) != schedule(8, **SHORT)  # type: ignore[arg-type]
    assert schedule(3, 3600) == schedule(3, 3600)


@pytest.mark.parametrize("seed", range(20))
def test_each_event_fits_its_bounds_and_heals_before_the_next(seed: int) -> None:
    events = schedule(seed, **SHORT)  # type: ignore[arg-type]
    assert events
    t = 0.0
    for e in events:
        assert 4.0 <= e.at_s <= 8.0 and 2.0 <= e.heal_s <= 5.0   # healed after heal_s; the next starts after that
        assert 1 <= len(e.faults) <= 2
        targets = [t for f in e.faults for t in f.targets]
        assert len(targets) == len(set(targets)), e            # two faults at once hit different processes
        assert sum(t.startswith("etcd-") for t in targets) <= 2 < ETCD  # never every etcd member
        for f in e.faults:
            assert f.action in ("kill", "stop", "restart", "partition", "disk")
            assert f.action not in ("restart", "partition", "disk") or f.targets[0].startswith("node-")
            assert len(f.targets) == 1 or f.quorum_loss
        t += e.at_s + e.heal_s
    assert t <= 60


@pytest.mark.parametrize("seed", range(20))
def test_a_run_has_a_double_fault_a_quorum_loss_a_partition_and_a_disk_fault(seed: int) -> None:
    events = schedule(seed, **SHORT)  # type: ignore[arg-type]
    assert len(events) >= 4
    assert any(len(e.faults) == 2 for e in events)
    assert any(f.quorum_loss for e in events for f in e.faults)
    assert {"partition", "disk"} <= {f.action for e in events for f in e.faults}


@pytest.mark.parametrize("seed", range(20))
def test_a_short_run_of_four_events_has_every_forced_kind_too(seed: int) -> None:
    events = schedule(seed, 40, (4.0, 8.0), (2.0, 5.0))  # the slow test's timeline
    if len(events) >= 4:
        kinds = {f.action for e in events for f in e.faults}
        assert {"partition", "disk"} <= kinds, events
        assert any(len(e.faults) == 2 for e in events) and any(f.quorum_loss for e in events for f in e.faults)


def test_the_long_schedule_covers_every_kind_of_fault() -> None:
    faults = {(f.action, f.targets[0].split("-")[0], f.quorum_loss) for e in schedule(0, 3600) for f in e.faults}
    for want in [("kill", "node", False), ("stop", "node", False), ("restart", "node", False),
                 ("kill", "ms", False), ("stop", "ms", False), ("kill", "etcd", False), ("stop", "etcd", False),
                 ("kill", "etcd", True), ("stop", "etcd", True), ("kill", "router", False), ("stop", "router", False),
                 ("partition", "node", False), ("disk", "node", False)]:
        assert want in faults, want


def test_a_duration_too_short_for_one_fault_has_none() -> None:
    assert schedule(0, 5, (20, 60), (3, 10)) == []
    assert str(Fault("stop", ("etcd-0", "etcd-2"))) == "stop etcd-0+etcd-2"


def test_conversations_come_round_again_after_distinct_batches() -> None:
    def prompts(gen, n: int) -> list[tuple[int, ...]]:
        return [r.prompt for _, conv in zip(range(n), gen) for r in conv]
    cycled = prompts(conversations(3, 4, distinct=2), 24)  # 8 users x 4 rounds a batch: 3 batches
    assert len(cycled) == 96 and cycled[:32] != cycled[32:64] and cycled[64:] == cycled[:32]
    assert prompts(conversations(3, 4), 24)[:64] == cycled[:64]  # the same batches until then
    assert prompts(conversations(3, 4), 24)[64:] != cycled[:32]  # never repeats without it


def test_rss_growth_compares_the_end_with_the_first_sample_from_the_baseline() -> None:
    mib = 2 ** 20
    samples = [{"t_s": 0.0, "a": 90 * mib, "b": 50 * mib, "pids": {"a": 1, "b": 2}},
               {"t_s": 10.0, "a": 100 * mib, "b": 0, "pids": {"a": 1, "b": None}},  # b down at the baseline
               {"t_s": 12.0, "a": 105 * mib, "b": 60 * mib, "pids": {"a": 1, "b": 3}},
               {"t_s": 20.0, "a": 115 * mib, "b": 66 * mib, "pids": {"a": 4, "b": 3}}]
    g = rss_growth(samples, 10.0)
    assert g["a"] == {"base_t_s": 10.0, "base": 100 * mib, "end": 115 * mib, "ratio": 1.15, "restarts": 1}
    assert g["b"]["base_t_s"] == 12.0 and g["b"]["ratio"] == 1.1 and g["b"]["restarts"] == 0
    assert rss_growth(samples, 30.0) == {}


def lives(*spans: tuple[float, float, Callable[[float], float]], end_s: float = 3600.0, every_s: float = 10.0
          ) -> list[dict]:
    """Samples of one name, "p", run by one process per span (start, stop, RSS in MiB at an age),
    down between spans: what the nemesis makes of a process."""
    out = []
    for i in range(int(end_s / every_s) + 1):
        t = i * every_s
        live = [(k, lo, rss) for k, (lo, hi, rss) in enumerate(spans) if lo <= t < hi]
        k, lo, rss = live[0] if live else (None, 0.0, None)
        out.append({"t_s": t, "p": int(rss(t - lo) * 2 ** 20) if rss else 0, "pids": {"p": None if k is None else 100 + k}})
    return out


def test_a_process_is_judged_against_itself_at_the_same_age() -> None:
    """A process's RSS climbs with its age and then levels off; the nemesis restarts it. By
    name, the end (an older process) over the baseline (a young one) reads as growth; per
    process at the same age nothing grows, and the rule passes where the by-name one fails."""
    def warm(age: float) -> float:
        return 60 + 30 * min(age, 500) / 500  # 60 MiB at the start, 90 from its 500th second on
    samples = lives((0, 400, warm), (410, 1700, warm), (1710, 3000, warm), (3010, 3800, warm), end_s=3700)
    assert [len(life) for life in instances(samples, "p")] == [40, 129, 129, 70]
    assert rss_growth(samples, 600)["p"]["ratio"] > 1.2  # by name: 690 s old at the end, 190 s at 600 s
    g = rss_by_age(samples, 600)
    assert [(x["from_s"], x["ratio"]) for x in g["lived"]] == [(410.0, 1.0), (1710.0, 1.0)]
    assert g["lived"][0]["base"] == g["lived"][0]["end"] == 90 * 2 ** 20
    assert g["restarted"]["p"]["compared"] == 3 and g["restarted"]["p"]["ratio"] == 1.0


def test_a_leak_within_a_process_or_across_restarts_fails_the_rule() -> None:
    def leak(age: float) -> float:
        return 100 + age / 60  # 1 MiB a minute
    g = rss_by_age(lives((0, 3700, leak)), 600)
    assert g["lived"][0]["ratio"] == round((100 + 3600 / 60) / 110, 3) > 1.1 and not g["restarted"]

    def grows(k: int) -> Callable[[float], float]:
        return lambda age: 100 + 6 * k  # flat in each process, 6% more in each next one
    spans = [(k * 700, k * 700 + 690, grows(k)) for k in range(6)]
    g = rss_by_age(lives(*spans, end_s=4200), 600)
    assert not g["lived"]  # no process runs twice 600 s: the within-process rule has nothing
    assert g["restarted"]["p"]["ratio"] == round(130 / 100, 3) > 1.1  # the last at 600 s over the first

    # Too few processes reach the age: not judged rather than judged on young ones.
    assert rss_by_age(lives((0, 500, grows(0)), (510, 3700, grows(3))), 600)["restarted"] == {}


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd not installed")
def test_etcd_gauges_read_a_real_etcds_metrics(tmp_path: Path) -> None:
    from kvpool_harness.processes import EtcdProcess, free_port
    with EtcdProcess(tmp_path / "etcd") as etcd:
        g = etcd_gauges(etcd.endpoint)
    assert set(g) == {"db", "db_in_use", "heap_inuse", "heap_sys", "keys", "committed"}, g
    assert g["db"] >= g["db_in_use"] > 0 and g["heap_sys"] >= g["heap_inuse"] > 0 and g["committed"] >= 1
    assert etcd_gauges(f"127.0.0.1:{free_port()}", timeout_s=1) == {}  # nothing answers: no gauges


@pytest.mark.slow
@pytest.mark.timeout(1200)  # past the run's own 900 s bound (it takes ~5 min on a 2-core machine)
def test_short_chaos_run_passes_the_checker(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "bench", "chaos", "--seed", "1",
         "--warmup", "15", "--duration", "40", "--quiet", "15", "--interval-min", "4", "--interval-max", "8",
         "--heal-min", "2", "--heal-max", "5", "--sample-s", "1", "--max-hit-drop", "0.2", "--run-dir", str(tmp_path / "run"), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    assert proc.returncode == 0 and s["verdict"] == "PASS", proc.stdout[-4000:]
    assert s["wrong"] == 0 and s["failed"] == 0 and s["late"] == 0 and not s["hung_clients"]
    assert all(s["checks"].values()), s["checks"]
    assert any(f["double"] for f in s["faults"]) and any(f["quorum_loss"] for f in s["faults"]), s["faults"]
    kinds = {fault.split()[0] for f in s["faults"] for fault in f["faults"]}
    assert {"partition", "disk"} <= kinds, s["faults"]
    assert s["answered"] >= 20 and s["retried"] >= 1
    assert "verdict: PASS" in proc.stdout
    assert (tmp_path / "report-timeline.png").stat().st_size > 10_000


def test_the_timeline_windows_count_hits_ttft_and_failed_attempts() -> None:
    reqs = [{"start_s": 1.0, "answered": True, "prompt_tokens": 100, "hit_tokens": 50, "ttft_s": 0.2, "attempts": 1},
            {"start_s": 5.0, "answered": True, "prompt_tokens": 100, "hit_tokens": 100, "ttft_s": 0.4, "attempts": 3},
            {"start_s": 25.0, "answered": False, "prompt_tokens": 100, "hit_tokens": 0, "ttft_s": 0.0, "attempts": 2}]
    w = windows(reqs, 20.0)
    assert [x["t_s"] for x in w] == [10.0, 30.0]
    assert w[0]["hit_rate"] == 0.75 and w[0]["failed_attempts"] == 2 and w[0]["ttft_p50"] in (0.2, 0.3, 0.4)
    assert w[1]["hit_rate"] is None and w[1]["ttft_p50"] is None and w[1]["failed_attempts"] == 2
