"""`EtcdCluster`: three real etcd processes that form one cluster (one raft group), so a key
written through one member is read through another, and two members down lose the quorum."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpool_harness.processes import EtcdCluster

pytestmark = pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl not installed")


def ctl(endpoint: str, *args: str, timeout: str = "3s") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["etcdctl", f"--endpoints=http://{endpoint}", f"--command-timeout={timeout}", *args],
                          capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=60)


def test_members_form_one_cluster_and_two_down_lose_the_quorum(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path, 3) as cluster:
        a, b, c = cluster.members
        members = ctl(a.endpoint, "member", "list")
        assert members.returncode == 0, members.stderr
        assert sorted(line.split(", ")[2] for line in members.stdout.splitlines()) == ["etcd-0", "etcd-1", "etcd-2"]
        assert ctl(a.endpoint, "put", "k", "v1").returncode == 0
        assert ctl(c.endpoint, "get", "k", "--print-value-only").stdout.strip() == "v1"  # one raft group

        b.stop()  # one member down: the other two still make a quorum
        assert ctl(a.endpoint, "put", "k", "v2").returncode == 0
        c.stop()  # two down: no write commits
        assert ctl(a.endpoint, "put", "k", "v3", timeout="2s").returncode != 0

        for m in (b, c):  # started again with their folders: they rejoin as themselves
            m.launch()
        for m in (b, c):
            m.wait_healthy(30)
        # The put that timed out is indeterminate, as raft makes it: it sits in the leader's log
        # and commits if that leader keeps its term once the others are back. So the members must
        # agree on v2 or v3, never on v1 or with each other not.
        values = {ctl(m.endpoint, "get", "k", "--print-value-only", "--consistency=l").stdout.strip()
                  for m in (a, b, c)}
        assert len(values) == 1 and values <= {"v2", "v3"}, values
        assert ctl(b.endpoint, "put", "k", "v4").returncode == 0  # the quorum is back
        assert {ctl(m.endpoint, "get", "k", "--print-value-only").stdout.strip() for m in (a, b, c)} == {"v4"}


def test_every_member_gets_the_environment_and_keeps_it_on_a_restart(tmp_path: Path) -> None:
    def environ(pid: int) -> list[bytes]:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")

    with EtcdCluster(tmp_path, 3, env={"GOMEMLIMIT": "80MiB"}) as cluster:
        assert all(b"GOMEMLIMIT=80MiB" in environ(m.proc.pid) for m in cluster.members)
        m = cluster.members[1]
        m.kill()
        m.start()
        assert b"GOMEMLIMIT=80MiB" in environ(m.proc.pid)
        assert "PATH=" in b"\n".join(environ(m.proc.pid)).decode()  # added to, not in place of, ours
