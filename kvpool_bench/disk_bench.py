"""`kvpool bench disk`: the pool's disk tier beside fio on the same directory, in one run.

    kvpool bench disk --dir DIR [--block-bytes 737280] [--blocks 512] [--restart-blocks 10000]

Random single-block writes and reads at the tier's slot size (payload + 64-byte header,
rounded up to 4 KiB), as the tier does them:
- python: one buffered pwrite/pread per slot (writes made durable by one fdatasync at the
  end; reads after POSIX_FADV_DONTNEED) and one O_DIRECT pwrite/pread from a page-aligned
  buffer: the candidates for the tier's I/O method;
- fio (psync, iodepth 1, the same size and pattern, direct and buffered): what the disk can do;
- the tier itself (`kvpool.disk.DiskTier`): blocks offered to its writer thread, first into
  fresh preallocated slots, then reusing them (LRU eviction), and validated reads of every
  block in random order. Rates are payload MB/s.
With `--restart-blocks N`, also warm restart: a tier of N slots filled with N blocks through
its own writer, closed, and opened again on the same directory; the time to open it (the
header scan of `DiskTier`'s constructor, which rebuilds the tables a restarted node
publishes) is printed beside the issue's target (10,000 blocks re-published and serving hits
within 10 s of start). It takes N slots of disk (7.4 GB for 10,000 SmolLM2 blocks).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvpool_bench.report import write_report

SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M fp32, 16-token blocks


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("disk", help="the pool's disk tier: write and read rates beside fio on the same directory")
    p.add_argument("--dir", required=True, help="directory on the file system to measure (files are removed after)")
    p.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES, help="payload of one KV block")
    p.add_argument("--blocks", type=int, default=512, help="blocks per measurement")
    p.add_argument("--no-fio", action="store_true", help="skip fio (not installed)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure everything this many times, in turn, and compare the tier with fio per round "
                        "(a virtual disk's rate moves from run to run by more than the difference)")
    p.add_argument("--restart-blocks", type=int, default=0,
                   help="also time a warm restart (header scan) of a tier holding this many blocks (0: skip)")
    p.add_argument("--out", default="runs/bench-disk.json")


def _raw(path: str, bs: int, n: int, direct: bool, write: bool) -> float:
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    buf = mmap.mmap(-1, bs)
    buf.write(os.urandom(bs))
    order = list(range(n))
    random.Random(1).shuffle(order)
    try:
        if not direct and not write:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for i in order:
            if write:
                os.pwritev(fd, [buf], i * bs)
            else:
                os.preadv(fd, [buf], i * bs)
        if write:
            os.fdatasync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return n * bs / dt / 1e6


def _fio(path: str, bs: int, n: int, direct: bool, write: bool) -> float:
    out = subprocess.run(["fio", "--name=t", f"--filename={path}", f"--rw={'randwrite' if write else 'randread'}",
                          f"--bs={bs}", f"--size={n * bs}", "--ioengine=psync", "--iodepth=1",
                          f"--direct={int(direct)}", "--end_fsync=1", "--invalidate=1", "--output-format=json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["jobs"][0]["write" if write else "read"]["bw_bytes"] / 1e6


def _fill(tier, block_bytes: int, hashes: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    """Offer one block per hash to `tier` (one random payload, each with its valid header) and
    wait until all are written."""
    import numpy as np

    from kvpool.layout import HEADER_BYTES, MAGIC, SlotHeader, checksum

    src = np.frombuffer(os.urandom(HEADER_BYTES + block_bytes), dtype=np.uint8).copy()
    digest = checksum(src.ctypes.data + HEADER_BYTES, block_bytes)
    for h in hashes:
        src[:HEADER_BYTES] = np.frombuffer(SlotHeader(MAGIC, 1, block_bytes, digest, h).pack(), dtype=np.uint8)
        tier.offer(h, src.ctypes.data, wait_s=10.0)
    tier.flush(600)


def _tier(directory: Path, block_bytes: int, n: int) -> dict[str, float]:
    import numpy as np

    from kvpool.disk import DiskIdentity, DiskTier, disk_slot_bytes
    from kvpool.stats import PoolStats

    identity = DiskIdentity("bench", "bench", block_bytes)
    tier = DiskTier(str(directory / "tier"), n * disk_slot_bytes(block_bytes), identity, PoolStats(), queue_blocks=64)
    out: dict[str, float] = {}
    try:
        for name, first in (("tier_write_fresh", 0), ("tier_write_reuse", n)):
            hashes = [(first + i).to_bytes(32, "little") for i in range(n)]
            t0 = time.perf_counter()
            _fill(tier, block_bytes, hashes)
            out[name] = n * block_bytes / (time.perf_counter() - t0) / 1e6
        dest = np.empty(block_bytes, dtype=np.uint8)
        random.Random(1).shuffle(hashes)
        t0 = time.perf_counter()
        ok = sum(tier.read_into(h, dest.ctypes.data) for h in hashes)
        out["tier_read"] = n * block_bytes / (time.perf_counter() - t0) / 1e6
        if ok != n:
            raise RuntimeError(f"{n - ok} of {n} blocks did not read back from the tier")
    finally:
        tier.close()
        shutil.rmtree(directory / "tier")
    return out


def _restart(directory: Path, block_bytes: int, n: int) -> dict[str, float]:
    """Fill a tier of `n` slots with `n` blocks, close it, and time opening it again."""
    from kvpool.disk import DiskIdentity, DiskTier, disk_slot_bytes
    from kvpool.stats import PoolStats

    identity, path = DiskIdentity("bench", "bench", block_bytes), directory / "restart"
    size = n * disk_slot_bytes(block_bytes)
    try:
        tier = DiskTier(str(path), size, identity, PoolStats(), queue_blocks=64)
        try:
            t0 = time.perf_counter()
            _fill(tier, block_bytes, [i.to_bytes(32, "little") for i in range(n)])
            fill_s, written = time.perf_counter() - t0, len(tier)
        finally:
            tier.close()
        t0 = time.perf_counter()
        again = DiskTier(str(path), size, identity, PoolStats())
        scan_s, kept = time.perf_counter() - t0, len(again)
        again.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    if not written == kept == n:
        raise RuntimeError(f"restart: {written} of {n} blocks written, {kept} found again")
    return {"blocks": n, "fill_s": fill_s, "scan_s": scan_s}


# The tier's access pattern beside fio's same one: random single-slot O_DIRECT writes into
# slots written before (the LRU's steady state), and random single-slot O_DIRECT reads.
PAIRS = {"write": ("tier_write_reuse", "fio_write_direct"), "read": ("tier_read", "fio_read_direct")}


def _round(root: Path, args: argparse.Namespace, bs: int, n: int) -> dict[str, float]:
    """Every rate once: the raw loops and fio on a preallocated file, then the tier."""
    rates: dict[str, float] = {}
    path = str(root / "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, bs * n)
    os.close(fd)
    for write in (True, False):
        op = "write" if write else "read"
        for direct in (False, True):
            mode = "direct" if direct else "buffered"
            rates[f"python_{op}_{mode}"] = _raw(path, bs, n, direct, write)
            if not args.no_fio:
                rates[f"fio_{op}_{mode}"] = _fio(path, bs, n, direct, write)
    os.unlink(path)
    rates.update(_tier(root, args.block_bytes, n))
    return rates


def _over_fio(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per round, the tier's rate over fio's for the same pattern; printed, medians returned."""
    out = {}
    for op, (tier, fio) in PAIRS.items():
        ratios = [r[tier] / r[fio] for r in rounds]
        out[op] = statistics.median(ratios)
        print(f"tier {op}s / fio's, per round: " + ", ".join(f"{x:.0%}" for x in ratios)
              + f"; median {out[op]:.0%} (target >= 80%)")
    return out


def main(args: argparse.Namespace) -> int:
    from kvpool.disk import disk_slot_bytes

    bs, n = disk_slot_bytes(args.block_bytes), args.blocks
    if args.rounds < 1:
        print(f"kvpool bench disk: error: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    root = Path(args.dir) / f"kvpool-bench-disk-{os.getpid()}"
    root.mkdir(parents=True)
    report: dict = {"bench": "disk", "dir": args.dir, "block_bytes": args.block_bytes, "slot_bytes": bs,
                    "blocks": n, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": []}
    try:
        for _ in range(args.rounds):
            report["rounds"].append(_round(root, args, bs, n))
        if args.restart_blocks > 0:
            report["restart"] = _restart(root, args.block_bytes, args.restart_blocks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rounds = report["rounds"]
    report["mb_per_s"] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"disk tier vs fio on {args.dir}: {n} random blocks of {args.block_bytes} bytes (slots of {bs})"
          + (f", medians of {len(rounds)} rounds" if len(rounds) > 1 else ""))
    for key, value in report["mb_per_s"].items():
        print(f"  {key:24s} {value:8.0f} MB/s")
    if not args.no_fio:
        report["tier_over_fio"] = _over_fio(rounds)
    if "restart" in report:
        r = report["restart"]
        print(f"restart scan {r['blocks']} blocks: {r['scan_s']:.2f} s (target: 10,000 blocks re-published and "
              f"serving hits within 10 s of start; filled in {r['fill_s']:.1f} s)")
    write_report(args.out, report)
    return 0
