"""`kvpool cluster`: its help, and `restart` as a user runs it, across separate invocations.

`restart` is tested on a stand-in node (tests/kvpool_harness/fake_node.py, a real process
that starts in a blink); tests/bench/test_cluster_cli.py restarts a real engine node of a
real cluster.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_harness.cluster import STATE, _pid_is_ours, _write_json, node_record
from kvpool_harness.engine_node import EngineProcess, http_json, wait_healthy
from kvpool_harness.processes import free_port
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


def kvpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env=env)


def test_help_lists_every_action(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_cli.main import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["cluster", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for action in ("up", "status", "restart", "down"):
        assert re.search(rf"^ +{action} +\w", out, re.M), f"`{action}` has no help line:\n{out}"


def _health(address: str) -> dict:
    status, body = http_json(address + "/health", timeout_s=5)
    assert status == 200
    return body


@pytest.mark.slow
def test_restart_stops_a_node_by_pid_and_starts_it_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster of one stand-in node, recorded as `cluster up` records its nodes; `restart`
    ends it by its PID and starts the same command again, with the environment the harness
    gave it, also when the node is already gone; `status` and `down` follow the new PID."""
    monkeypatch.chdir(ROOT)  # where `python -m tests.kvpool_harness.fake_node` finds the module (recorded cwd)
    run = tmp_path / "cluster"
    node = EngineProcess(run / "node-0.log", "node-0", port=free_port())
    node.spawn(["--node-id", "node-0", "--port", str(node.port)], env={"FAKE_NODE_MARK": "set-by-the-harness"},
               module="tests.kvpool_harness.fake_node")
    try:
        wait_healthy(node, "stand-in node-0", timeout_s=60)
        record = node_record(node)
        assert record["env"] == {"FAKE_NODE_MARK": "set-by-the-harness"}  # the harness's change only
        _write_json(run / STATE, {"connector": False, "engine": "kvpool", "model": "none", "processes": [record]})

        r = kvpool("cluster", "restart", "node-0", "--run-dir", str(run), "--timeout", "120")
        assert r.returncode == 0, r.stderr
        assert f"restarted node-0: {node.url}" in r.stdout and f"was {node.pid}" in r.stdout
        assert node.proc is not None and node.proc.wait(10) == -signal.SIGTERM  # ended by its PID
        new = json.loads((run / STATE).read_text())["processes"][0]
        assert new["pid"] != node.pid and new["address"] == node.url
        body = _health(node.url)  # the same command line and environment, in the new process
        assert body == {"pid": new["pid"], "argv": ["--node-id", "node-0", "--port", str(node.port)],
                        "mark": "set-by-the-harness"}

        # A node that is gone (crashed) is started again too, from the recorded launch.
        os.kill(new["pid"], signal.SIGKILL)
        wait_for(lambda: not _pid_is_ours(new["pid"]), timeout_s=30)
        r = kvpool("cluster", "restart", "node-0", "--run-dir", str(run), "--timeout", "120")
        assert r.returncode == 0, r.stderr
        again = json.loads((run / STATE).read_text())["processes"][0]
        assert _health(node.url) == {**body, "pid": again["pid"]}
        st = kvpool("cluster", "status", "--run-dir", str(run))
        assert st.returncode == 0 and f"pid {again['pid']}" in st.stdout and "running ready" in st.stdout

        r = kvpool("cluster", "restart", "ghost", "--run-dir", str(run))
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip() == f"kvpool cluster: error: 'ghost' is not a node of the cluster in {run} (its nodes: node-0)"
        r = kvpool("cluster", "restart", "node-0", "--run-dir", str(tmp_path / "none"))
        assert r.returncode == 1 and r.stderr.strip() == f"kvpool cluster: error: no cluster in {tmp_path / 'none'} (no {STATE})"
    finally:
        down = kvpool("cluster", "down", "--run-dir", str(run))
        node.stop()
    assert down.returncode == 0 and "stopped node-0" in down.stdout, down.stderr
    assert not _pid_is_ours(again["pid"]) and not (run / STATE).exists()
