"""`kvpool admin` as a user runs it: a real process against a real metaserver."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool_harness.processes import MetaserverProcess, free_port
from metaserver.client import MetaClient

NS = "ns-admin"
H = [f"{i:064x}" for i in range(4)]


# Each call's deadline: generous, because a loaded CI machine's etcd can stall a write for
# seconds; what these tests check is the CLI's output, not its speed. A test that wants the
# deadline to pass gives its own `--timeout` (argparse keeps the last one given).
DEADLINE = ("--timeout", "60")


def admin(address: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", "--log-level", "WARNING", "admin", "--metaserver",
                           address, *DEADLINE, *args], capture_output=True, text=True, timeout=180, input=stdin)


@pytest.fixture
def address(metaserver: MetaserverProcess) -> str:
    with MetaClient(metaserver.address, timeout_s=60) as c:
        # Nothing keeps this lease alive: the longest the server grants, so that no slow machine
        # outlives it across a test's ~3 s CLI starts.
        c.register_node("node-a", "127.0.0.1:7001", 0, 1 << 20, NS, 3600)
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


def test_drain_undrain_round_trip(address: str) -> None:
    def state() -> dict:
        return json.loads(admin(address, "--json", "nodes").stdout)[0]

    publish = ["publish", "--node", "node-a", "--hash", H[0], "--hash", H[1], "--offset", "0", "--size", "64"]
    query = ["--json", "query", "--namespace", NS, "--hash", H[0], "--hash", H[1]]
    assert admin(address, *publish).returncode == 0
    r = admin(address, "drain", "node-a")
    assert r.returncode == 0 and r.stdout.strip() == "node node-a draining; 2 blocks removed from the index"
    assert state()["draining"] is True and json.loads(admin(address, *query).stdout)["num_matched"] == 0
    r = admin(address, *publish)
    assert r.returncode == 1 and "FAILED_PRECONDITION: node 'node-a' is draining" in r.stderr

    r = admin(address, "undrain", "node-a")
    assert r.returncode == 0 and r.stdout.startswith("node node-a active again"), r.stderr
    assert state()["draining"] is False and "active" in admin(address, "nodes").stdout
    assert admin(address, *publish).returncode == 0  # its publishes are accepted again
    assert [loc["node_id"] for loc in json.loads(admin(address, *query).stdout)["locations"]] == ["node-a"] * 2
    r = admin(address, "--json", "undrain", "node-a")
    assert r.returncode == 0 and json.loads(r.stdout) == {"was_draining": False}


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
    (["drain", "ghost"], 1, "NOT_FOUND: unknown node id 'ghost': it is not registered"),
    (["undrain", "ghost"], 1, "NOT_FOUND: unknown node id 'ghost': it is not registered"),
    (["undrain"], 2, "the following arguments are required: node"),
])
def test_errors_are_one_line_with_exit_codes(address: str, args: list[str], code: int, message: str) -> None:
    r = admin(address, *args)
    assert r.returncode == code, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    if args[0] in ("drain", "undrain"):  # an admin names a node: unknown, not "register first"
        assert "register first" not in r.stderr
    if code == 1:
        assert len(r.stderr.strip().splitlines()) == 1


def test_unreachable_metaserver() -> None:
    r = admin(f"127.0.0.1:{free_port()}", "--timeout", "1", "nodes")
    assert r.returncode == 3
    assert "metaserver unreachable" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_cli", *args], capture_output=True, text=True, timeout=180)


def test_options_go_before_or_after_the_command(address: str) -> None:
    """As in etcdctl/kubectl/helm: `admin --metaserver X stats --json` = `admin --metaserver X --json stats`,
    and `--log-level` goes before or after the command."""
    before = admin(address, "--json", "stats")     # the old order still works
    after = admin(address, "stats", "--json")
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert json.loads(before.stdout)["index"] == json.loads(after.stdout)["index"]
    assert json.loads(after.stdout)["index"]["num_nodes"] == 1

    r = kvpool("admin", "nodes", "--metaserver", address, *DEADLINE, "--json", "--log-level", "WARNING")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["node_id"] == "node-a"
    r = kvpool("--log-level", "WARNING", "admin", "--metaserver", address, "nodes", *DEADLINE)
    assert r.returncode == 0 and "node-a" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "metaserver", "admin", "stats", "--metaserver", address, "--json",
                        "--log-level", "WARNING", *DEADLINE], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and json.loads(r.stdout)["etcd_healthy"] is True, r.stderr

    r = kvpool("admin", "stats", "--json")
    assert r.returncode == 2 and "required: --metaserver" in r.stderr


@pytest.mark.parametrize("args", [
    ["admin", "--metaserver", "h:1", "stats"],
    ["metaserver", "--listen", "127.0.0.1:1"],
    ["serve", "--port", "1"],
    ["cluster", "status"],
    ["bench", "metaserver"],
])
def test_log_level_goes_before_or_after_the_command(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_cli.main import build_parser

    monkeypatch.delenv("KVPOOL_LOG_LEVEL", raising=False)
    parser = build_parser()
    assert parser.parse_args(args).log_level == "INFO"
    assert parser.parse_args(["--log-level", "WARNING", *args]).log_level == "WARNING"
    assert parser.parse_args([*args, "--log-level", "WARNING"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "ERROR", *args, "--log-level", "WARNING"]).log_level == "WARNING"


@pytest.mark.parametrize("argv", [["admin", "--help"], ["--log-level", "INFO", "admin", "nodes", "--help"],
                                  ["metaserver", "--help"]])
def test_admin_and_metaserver_import_neither_torch_nor_the_benchmarks(argv: list[str]) -> None:
    """The core commands start in a fraction of a second: they never load the engine."""
    code = ("import sys\nfrom kvpool_cli.main import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'engine', 'kvpool_bench', 'kvpool_harness', 'router'))\nprint('HEAVY', heavy)\n" % argv)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout, r.stdout[-2000:]
