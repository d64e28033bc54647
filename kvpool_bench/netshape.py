"""Shape the pool's link on loopback: the transfer engine's traffic at a chosen rate.

On loopback a pull moves at memory speed (about 1 GB/s through the engine's TCP transport), so
pulling a prefix costs about what a local hit does. Real clusters without RDMA pull over a
1-25 Gbit/s link. `shaped_pool_link("1gbit")` puts a Linux HTB qdisc on `lo` whose one class
holds the Mooncake Transfer Engine's TCP ports (its handshake and data ports are taken from
15000-16999, measured: docs/BENCHMARKS.md) to that rate, and sends everything else (HTTP, gRPC,
etcd: ephemeral ports 32768+) through an unshaped class. One class for every node and both
directions: the cluster's pool traffic shares one link of that rate (as nodes behind one
switch port would), not one link per node. The qdisc is removed on exit, also on an exception
(not when the process is killed: then `tc qdisc del dev lo root` removes it).

Needs root and `tc` (iproute2) with the htb scheduler; otherwise `ShapingError` says which is
missing and nothing is changed. Only the machine's own loopback is touched; a qdisc already on
`lo` (someone else's) is refused rather than replaced.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

DEVICE = "lo"
# u32 port matches (value, mask) covering 14336-17407, a superset of the engine's 15000-16999;
# nothing else listens there (servers here take ephemeral ports 32768+).
PORT_MATCHES = ((0x3800, 0xF800), (0x4000, 0xFC00))
log = logging.getLogger(__name__)
RATE = re.compile(r"^\d+(\.\d+)?(kbit|mbit|gbit)$")


class ShapingError(Exception):
    """The link cannot be shaped here (not root, no tc, no htb, or lo already has a qdisc)."""


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ShapingError(f"tc {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _lo_qdisc() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", DEVICE], capture_output=True, text=True).stdout


def check_rate(rate: str) -> None:
    """ShapingError unless `rate` is a tc rate this module takes (500mbit, 1gbit, 2.5gbit)."""
    if not RATE.match(rate):
        raise ShapingError(f"rate must look like 500mbit or 1gbit, got {rate!r}")


@contextlib.contextmanager
def shaped_pool_link(rate: str) -> Iterator[None]:
    """Hold the transfer engine's loopback traffic to `rate` (tc syntax: 500mbit, 1gbit,
    10gbit) for the duration of the block."""
    check_rate(rate)
    if os.geteuid() != 0:
        raise ShapingError("shaping the pool's link needs root (tc on lo)")
    if shutil.which("tc") is None:
        raise ShapingError("shaping the pool's link needs tc (iproute2)")
    current = _lo_qdisc()
    if "htb" in current or "tbf" in current:
        raise ShapingError("lo already has a shaping qdisc; not replacing someone else's (a killed run's? "
                           "`tc qdisc del dev lo root` removes it)")
    _tc("qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb", "default", "20")
    try:
        # explicit quanta: HTB's default (rate / r2q) is out of its range at these rates; the
        # shaped class bursts one 64 KiB GSO segment (lo's MTU).
        _tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:20", "htb",
            "rate", "100gbit", "quantum", "200000")
        _tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:10", "htb",
            "rate", rate, "ceil", rate, "burst", "64k", "cburst", "64k", "quantum", "65536")
        for field in ("sport", "dport"):
            for value, mask in PORT_MATCHES:
                _tc("filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "ip", field, str(value), hex(mask), "flowid", "1:10")
        yield
    finally:
        done = subprocess.run(["tc", "qdisc", "del", "dev", DEVICE, "root"], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("could not remove the shaping qdisc from lo (%s): run `tc qdisc del dev lo root`",
                        done.stderr.strip())
