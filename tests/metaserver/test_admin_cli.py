"""`kvpool admin` as a user runs it: a real process against a real metaserver."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from metaserver.client import MetaClient
from metaserver.launch import MetaserverProcess, free_port

NS = "ns-admin"
H = [f"{i:064x}" for i in range(4)]


def admin(address: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool", "--log-level", "WARNING", "admin", "--metaserver",
                           address, *args], capture_output=True, text=True, timeout=60, input=stdin)


@pytest.fixture
def address(metaserver: MetaserverProcess) -> str:
    with MetaClient(metaserver.address) as c:
        c.register_node("node-a", "127.0.0.1:7001", 0, 1 << 20, NS, 30)
    return metaserver.address


def test_publish_query_nodes_stats_invalidate(address: str) -> None:
    r = admin(address, "publish", "--node", "node-a", *sum((["--hash", x] for x in H[:3]), []),
              "--offset", "0", "--size", "4096")
    assert r.returncode == 0 and "published 3 blocks" in r.stdout, r.stderr

    r = admin(address, "query", "--namespace", NS, *sum((["--hash", x] for x in H), []))
    assert r.returncode == 0 and "matched 3 of 4 blocks" in r.stdout
    assert "NODE" in r.stdout and "127.0.0.1:7001" in r.stdout

    r = admin(address, "--json", "query", "--namespace", NS, "--hash", H[0], "--hash", H[1])
    data = json.loads(r.stdout)
    assert data["num_matched"] == 2 and data["locations"][1]["offset"] == 4096

    r = admin(address, "nodes")
    assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:2] == ["NODE", "SESSION"]
    assert "node-a" in r.stdout and "active" in r.stdout
    nodes = json.loads(admin(address, "--json", "nodes").stdout)
    assert nodes[0]["node_id"] == "node-a" and nodes[0]["num_blocks"] == 3

    stats = json.loads(admin(address, "--json", "stats").stdout)
    assert stats["index"]["num_copies"] == 3 and stats["etcd_healthy"] is True
    assert "etcd               healthy" in admin(address, "stats").stdout

    r = admin(address, "invalidate", "--namespace", NS, "--hash", H[1])
    assert r.returncode == 0 and "invalidated 1" in r.stdout
    r = admin(address, "--json", "query", "--namespace", NS, *sum((["--hash", x] for x in H), []))
    assert json.loads(r.stdout)["num_matched"] == 1

    r = admin(address, "drain", "node-a")
    assert r.returncode == 0 and "draining" in r.stdout
    assert "draining" in admin(address, "nodes").stdout


def test_invalidate_all_asks_unless_yes(address: str) -> None:
    admin(address, "publish", "--node", "node-a", "--hash", H[0], "--offset", "0", "--size", "64")
    r = admin(address, "invalidate", "--all", stdin="")
    assert r.returncode == 4 and "--yes" in r.stderr
    assert json.loads(admin(address, "--json", "stats").stdout)["index"]["num_copies"] == 1
    r = admin(address, "invalidate", "--all", "--yes")
    assert r.returncode == 0 and "invalidated 1" in r.stdout
    assert json.loads(admin(address, "--json", "stats").stdout)["index"]["num_copies"] == 0


@pytest.mark.parametrize("args,code,message", [
    (["query", "--namespace", NS, "--hash", "zz"], 2, "not hexadecimal"),
    (["query", "--namespace", NS, "--hash", "abcd"], 1, "INVALID_ARGUMENT: query: block hash #0 is 2 bytes"),
    (["query", "--namespace", "nope", "--hash", H[0]], 1, "NOT_FOUND"),
    (["invalidate", "--hash", H[0]], 2, "--hash needs --namespace"),
    (["invalidate"], 2, "give one of"),
    (["publish", "--node", "ghost", "--hash", H[0], "--offset", "0", "--size", "64"], 1, "FAILED_PRECONDITION"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_errors_are_one_line_with_exit_codes(address: str, args: list[str], code: int, message: str) -> None:
    r = admin(address, *args)
    assert r.returncode == code, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    if code == 1:
        assert len(r.stderr.strip().splitlines()) == 1


def test_unreachable_metaserver() -> None:
    r = admin(f"127.0.0.1:{free_port()}", "--timeout", "1", "nodes")
    assert r.returncode == 3
    assert "metaserver unreachable" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
