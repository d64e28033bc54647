"""Compare the disk tier's candidate I/O methods with fio on one directory (issue 39).

    python scripts/disk_io_compare.py DIR [--block-kib 512] [--blocks 512]

Random slot writes and reads of one block each, in a preallocated file, as the tier does
them: buffered pwrite/pread (page cache; writes made durable with one fdatasync at the end,
reads after POSIX_FADV_DONTNEED so they hit the disk), O_DIRECT from an aligned mmap buffer,
and fio (psync, iodepth 1, the same block size, direct and buffered). Prints MB/s.
With --tier, also the disk tier itself (kvpool.disk.DiskTier: offers written by its writer
thread, validated reads) at a payload of --block-kib minus its 64-byte header.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import subprocess
import time


def _prealloc(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _run(path: str, bs: int, n: int, direct: bool, write: bool) -> float:
    flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
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
    job = json.loads(out)["jobs"][0]["write" if write else "read"]
    return job["bw_bytes"] / 1e6


def _tier(directory: str, bs: int, n: int) -> tuple[float, float]:
    """The disk tier's write and read rates (MB/s of payload) for `n` blocks whose slot is `bs`."""
    import numpy as np

    from kvpool.disk import DiskIdentity, DiskTier
    from kvpool.layout import HEADER_BYTES, MAGIC, SlotHeader, checksum
    from kvpool.stats import PoolStats

    payload = bs - HEADER_BYTES
    tier = DiskTier(os.path.join(directory, "tier"), n * bs, DiskIdentity("bench", "bench", payload), PoolStats())
    src = np.frombuffer(os.urandom(bs), dtype=np.uint8).copy()
    digest = checksum(src.ctypes.data + HEADER_BYTES, payload)
    hashes = [i.to_bytes(32, "little") for i in range(n)]
    try:
        t0 = time.perf_counter()
        for h in hashes:
            src[:HEADER_BYTES] = np.frombuffer(SlotHeader(MAGIC, 1, payload, digest, h).pack(), dtype=np.uint8)
            tier.offer(h, src.ctypes.data, wait_s=10.0)
        tier.flush(600)
        write = n * payload / (time.perf_counter() - t0) / 1e6
        dest = np.empty(payload, dtype=np.uint8)
        order = list(hashes)
        random.Random(1).shuffle(order)
        t0 = time.perf_counter()
        ok = sum(tier.read_into(h, dest.ctypes.data) for h in order)
        read = n * payload / (time.perf_counter() - t0) / 1e6
        assert ok == n, f"{n - ok} blocks did not read back"
    finally:
        tier.close()
        for name in os.listdir(os.path.join(directory, "tier")):
            os.unlink(os.path.join(directory, "tier", name))
        os.rmdir(os.path.join(directory, "tier"))
    return write, read


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--block-kib", type=int, default=512)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--tier", action="store_true", help="also measure kvpool.disk.DiskTier")
    args = p.parse_args()
    bs, n = args.block_kib * 1024, args.blocks
    path = os.path.join(args.dir, "disk_io_compare.bin")
    _prealloc(path, bs * n)
    try:
        for write in (True, False):
            op = "write" if write else "read"
            for direct in (False, True):
                mode = "O_DIRECT" if direct else "buffered"
                print(f"{op:5s} {mode:8s} python {_run(path, bs, n, direct, write):8.0f} MB/s   "
                      f"fio {_fio(path, bs, n, direct, write):8.0f} MB/s", flush=True)
    finally:
        os.unlink(path)
    if args.tier:
        write, read = _tier(args.dir, bs, n)
        print(f"tier  write {write:8.0f} MB/s   read {read:8.0f} MB/s (payload; writer thread, validated reads)")


if __name__ == "__main__":
    main()
