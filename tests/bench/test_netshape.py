"""`kvpool_bench.netshape`: the transfer engine's loopback ports shaped for a benchmark and
restored after; bad rates and someone else's qdisc refused with nothing changed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_bench.netshape import ShapingError, shaped_pool_link

CAN_SHAPE = os.geteuid() == 0 and shutil.which("tc") is not None


def lo_qdisc() -> str:
    if shutil.which("tc") is None:
        return ""
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


def lo_classes() -> str:
    return subprocess.run(["tc", "class", "show", "dev", "lo"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("rate", ["1gigabit", "fast", "", "1 gbit", "-1gbit"])
def test_a_bad_rate_is_refused_and_nothing_changes(rate: str) -> None:
    before = lo_qdisc()
    with pytest.raises(ShapingError, match="rate must look like"):
        with shaped_pool_link(rate):
            pass
    assert lo_qdisc() == before


def test_the_engine_ports_are_shaped_inside_and_restored_after() -> None:
    before = lo_qdisc()
    if not CAN_SHAPE:  # the error names what is missing
        with pytest.raises(ShapingError, match="root|tc"):
            with shaped_pool_link("50gbit"):
                pass
        assert lo_qdisc() == before
        return
    assert "htb" not in before
    with shaped_pool_link("50gbit"):
        assert "qdisc htb 1:" in lo_qdisc()
        classes = lo_classes()
        assert "class htb 1:10" in classes and "rate 50Gbit" in classes
        with pytest.raises(ShapingError, match="already has a shaping qdisc"):  # never stacked or replaced
            with shaped_pool_link("1gbit"):
                pass
        assert "rate 50Gbit" in lo_classes()
    assert lo_qdisc() == before


def test_a_failure_inside_still_restores_the_link() -> None:
    before = lo_qdisc()
    expected = RuntimeError if CAN_SHAPE else ShapingError  # without root/tc it never gets inside
    with pytest.raises(expected):
        with shaped_pool_link("50gbit"):
            assert "qdisc htb 1:" in lo_qdisc()
            raise RuntimeError("boom")
    assert lo_qdisc() == before


def test_the_bench_refuses_a_bad_rate_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "cross-node", "--pool-link-rate", "fast",
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("kvpool bench cross-node: error: rate must look like")
    assert not (tmp_path / "run").exists()


def test_the_bench_refuses_shaping_with_running_nodes(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "cross-node", "--pool-link-rate", "1gbit",
                        "--urls", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert "not with --urls" in r.stderr.strip().splitlines()[-1]
