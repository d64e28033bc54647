"""`kvpool bench transfer`: cross-process block reads, our get path against the physical limits.

One run, same bytes, same machine, a source process and this reader process:
- kvpool get: `NodePool.get` (TE batch per source into the read buffer's landing slots,
  validation, the copy into the destinations);
- validated floor: the get's batches read straight into the destinations (no landing slot,
  no copy), posted at once and completed in order, each block's header and checksum checked,
  and nothing else (no handle, no bookkeeping): the least any read that validates its blocks
  takes here, so get/floor is what the pool's code adds (its copy out of the landing slots
  included) and floor/raw what validation costs on this machine;
- raw TE: the transfer engine's batched read of the same payload ranges, no pool logic;
- raw TE, our ranges: the same engine call, as one batch, for the ranges a get posts (header
  + payload per block, blocks back to back on both sides merged within each of the get's
  batches), no validation: what the get adds to the transfer;
- TCP: one Python socket stream of the same bytes (loopback without any engine);
- memcpy: an in-process copy of the same bytes (the memory limit);
- Mooncake Store: `mooncake_master` + `MooncakeDistributedStore.batch_get_into` of the same
  blocks (a peer system).
Block sizes 64 KiB .. 4 MiB, chains of 1 .. 256 blocks (capped at --max-bytes per chain).
"""
from __future__ import annotations

import argparse
import json
import mmap
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvpool import NodePool, PoolConfig, parse_size, slot_bytes_for
from kvpool.layout import HEADER_BYTES, valid_block
from kvpool.reader import batch_slices, coalesce
from kvpool_bench.report import write_report
from kvpool_bench.transfer_source import block_hash
from kvpool_harness.processes import EtcdProcess, MetaserverProcess, free_port
from metaserver.client import MetaClient

# Chains start at this block: slot 0 of a pool (and of the destination) is page-aligned, and
# the kernel's loopback copy from or to a page-aligned address is up to ~25% slower here
# (docs/journal/benchmarks-history.md); one slot in 64 or more is, so block 1 on is the typical case.
FIRST = 1


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("transfer", help="block read throughput vs raw TE, TCP, memcpy and Mooncake Store")
    p.add_argument("--sizes", default="64KiB,256KiB,1MiB,4MiB")
    p.add_argument("--chains", default="1,16,64,256")
    p.add_argument("--max-bytes", default="256MiB", help="largest chain in bytes")
    p.add_argument("--repeat", type=int, default=7,
                   help="timed rounds per cell at least; each round times every method once, in turn (median reported)")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="more rounds for quick cells until the rounds take about this long (a 0.3 ms read "
                        "timed 7 times is at the mercy of one scheduler hiccup)")
    p.add_argument("--no-store", action="store_true", help="skip Mooncake Store")
    p.add_argument("--scatter", action="store_true",
                   help="destinations of a chain in a shuffled order of cache slots (a fragmented engine cache: "
                        "no two blocks back to back, so no merged ranges)")
    p.add_argument("--phases", action="store_true",
                   help="for one-block chains, also time the phases of a get (before the submit, the submit, "
                        "the transfer, validation and after) beside a raw submit + complete of the same range")
    p.add_argument("--out", default="runs/bench-transfer.json")


def timed_interleaved(fns: dict[str, Callable[[], None]], repeat: int, min_seconds: float = 0.0) -> dict[str, float]:
    """Median seconds per method. Methods are interleaved (round r times each once, in turn,
    starting with a different one each round, so none always follows the same neighbour),
    so that drift in this shared machine's speed lands on all of them alike; one warm-up
    call each first (connections, page faults). At least `repeat` rounds, more (up to
    20,000) if that many take less than `min_seconds` by the warm-up calls' times."""
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    round_s = time.perf_counter() - t0
    repeat = max(repeat, min(20_000, int(min_seconds / max(round_s, 1e-6))))
    runs: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(repeat):
        for name, fn in order[r % len(order):] + order[:r % len(order)]:  # each method goes first in turn
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    return {name: statistics.median(r) for name, r in runs.items()}


def start_master(tmp: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = open(tmp / "mooncake_master.log", "wb")
    proc = subprocess.Popen([exe, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                             f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                             f"--metrics_port={metrics}"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", rpc), 0.2).close()
            socket.create_connection(("127.0.0.1", http), 0.2).close()
            return proc, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"mooncake_master did not start; see {tmp / 'mooncake_master.log'}")


class TcpReader:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, dest: memoryview) -> None:
        self.sock.sendall(struct.pack("<Q", len(dest)))
        got = 0
        while got < len(dest):
            got += self.sock.recv_into(dest[got:])


def run(args: argparse.Namespace, tmp: Path) -> list[dict]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    chains = [int(c) for c in args.chains.split(",")]
    max_bytes = parse_size(args.max_bytes)
    counts = [min(max(chains), max_bytes // s) for s in sizes]
    rows = []
    with EtcdProcess(tmp / "etcd") as etcd, MetaserverProcess(etcd.endpoint, tmp / "ms.log", log_level="WARNING") as ms:
        master = None
        store_args: list[str] = []
        if not args.no_store:
            master, master_addr, meta = start_master(tmp)
            store_args = ["--store-master", master_addr, "--store-metadata", meta]
        src = subprocess.Popen([sys.executable, "-m", "kvpool_bench.transfer_source", "--metaserver", ms.address,
                                "--sizes", ",".join(map(str, sizes)), "--blocks", ",".join(str(FIRST + n) for n in counts),
                                *store_args], stdout=subprocess.PIPE, text=True)
        try:
            assert src.stdout is not None
            info = json.loads(src.stdout.readline())
            store = None
            # Destinations in slot strides, as the engine's cache is laid out: kvpool reads header
            # and payload as one range; the others move only the payload to the same addresses.
            # Page-aligned like the engine's cache (torch's allocator aligns to 64 bytes): the
            # kernel's loopback copy into a destination that is only 16-byte aligned (numpy's
            # default) can take twice as long, which would fall on whichever method reads there.
            dest_mem = mmap.mmap(-1, max(slot_bytes_for(s) * (FIRST + n) for s, n in zip(sizes, counts)))
            dest = np.frombuffer(dest_mem, dtype=np.uint8)
            local_src = np.random.default_rng(1).integers(0, 255, size=dest.nbytes, dtype=np.uint8)
            if info["store"]:
                from mooncake.store import MooncakeDistributedStore

                store = MooncakeDistributedStore()
                if store.setup("127.0.0.1", meta, 16 << 20, 16 << 20, "tcp", "", master_addr) != 0:
                    raise RuntimeError("Mooncake Store setup failed in the reader")
                store.register_buffer(dest.ctypes.data, dest.nbytes)
            tcp = TcpReader(info["tcp_port"])
            client = MetaClient(ms.address)
            for size, n in zip(sizes, counts):
                reader = NodePool(PoolConfig(f"reader-{size}", slot_bytes_for(size), size, f"bench-{size}"))
                reader.register_memory(dest.ctypes.data, dest.nbytes)
                hashes = [block_hash(size, i) for i in range(FIRST + n)]
                q = client.query_prefix(f"bench-{size}", hashes)
                assert q.num_matched == FIRST + n, (q.num_matched, FIRST + n)
                node = q.nodes[q.locations[0].node_id]
                for chain in [c for c in chains if c <= n]:
                    nbytes = chain * size
                    blocks = range(FIRST, FIRST + chain)
                    order = list(blocks)
                    if args.scatter:  # no two consecutive blocks in neighbouring slots
                        order = order[::2] + order[1::2] if chain > 2 else order[::-1]
                    dests = [dest.ctypes.data + i * slot_bytes_for(size) + HEADER_BYTES for i in order]
                    locs = q.locations[FIRST:FIRST + chain]
                    slots = [node.buffer_address + loc.offset for loc in locs]
                    # The floor: the get's batches, each block read straight into its destination
                    # (header room before it; back-to-back blocks merged), with no landing slot and
                    # no copy: what a get would cost if a failed transfer could not reach the cache.
                    parts = batch_slices(chain)
                    batches = [coalesce([d - HEADER_BYTES for d in dests[p]], slots[p],
                                        [HEADER_BYTES + size] * len(slots[p])) for p in parts]
                    runs = tuple([x for b in batches for x in b[i]] for i in range(3))
                    checks = [[(d - HEADER_BYTES, d, size, loc.block_hash, loc.generation)
                               for d, loc in zip(dests[p], locs[p])] for p in parts]

                    def ours() -> None:
                        res = reader.get(locs, q.nodes, dests).wait(60)
                        if res.failed:
                            raise RuntimeError(f"{len(res.failed)} blocks failed")

                    def floor() -> None:
                        te = reader.te
                        ids = [te.submit_read(node.session_address, *b) for b in batches]
                        for bid, blocks in zip(ids, checks):
                            te.complete(bid)
                            if not all(valid_block(*blk) for blk in blocks):
                                raise RuntimeError("a block failed validation")

                    def raw_te() -> None:
                        reader.te.read_sync(node.session_address, dests,
                                            [node.buffer_address + loc.offset + HEADER_BYTES for loc in locs],
                                            [size] * chain)

                    def store_get() -> None:
                        assert store is not None
                        rcs = store.batch_get_into([f"b{size}-{i}" for i in blocks], dests, [size] * chain)
                        if any(rc != size for rc in rcs):
                            raise RuntimeError(f"Mooncake Store get returned {set(rcs)}")

                    cell = {"block_bytes": size, "chain": chain, "bytes": nbytes, "ranges": len(runs[0])}
                    lo = dests[0] - dest.ctypes.data  # the same first destination byte for every method
                    def raw_te_ranges() -> None:
                        reader.te.read_sync(node.session_address, *runs)

                    fns = {"kvpool_get": ours, "floor": floor, "raw_te": raw_te, "raw_te_ranges": raw_te_ranges,
                           "tcp": lambda: tcp.read(memoryview(dest)[lo:lo + nbytes]),
                           "memcpy": lambda: np.copyto(dest[lo:lo + nbytes], local_src[:nbytes])}
                    if store is not None:
                        fns["mooncake_store"] = store_get
                    for name, secs in timed_interleaved(fns, args.repeat, args.min_seconds).items():
                        cell[f"{name}_s"] = secs
                        cell[f"{name}_GBps"] = nbytes / secs / 1e9
                    if args.phases and chain == 1:
                        cell["phases_us"] = phases(reader, node.session_address, ours, dests[0],
                                                   node.buffer_address + locs[0].offset, size, 20 * args.repeat)
                    rows.append(cell)
                    print_row(cell, header=len(rows) == 1)
                    if "phases_us" in cell:
                        print_phases(cell["phases_us"])
                reader.close()
            if store is not None:
                store.close()
            client.close()
        finally:
            src.terminate()
            src.wait(30)
            if master is not None:
                master.terminate()
                master.wait(30)
    return rows


def phases(reader: NodePool, session: str, get: Callable[[], None], dest: int, slot_addr: int, size: int,
           rounds: int) -> dict[str, dict[str, float]]:
    """Median microseconds of each phase of a one-block `kvpool get` and of a raw submit +
    complete of the same header-inclusive range, interleaved round by round: `pre` from the
    call to the transfer engine's submit, `submit` the submit call, `between` from its return
    to the completion call, `transfer` the completion call (the engine spins until the data
    is in), `post` from there to the result (`validate` is the header check and xxh3
    checksum part of it)."""
    import kvpool.reader as reader_mod

    te, marks, sums = reader.te, {}, []
    submit, complete, validate = te.submit_read, te.complete, reader_mod.valid_block

    def timed_submit(*a: object) -> int:
        marks["s0"] = time.perf_counter()
        bid = submit(*a)  # type: ignore[arg-type]
        marks["s1"] = time.perf_counter()
        return bid

    def timed_complete(bid: int) -> None:
        marks["c0"] = time.perf_counter()
        complete(bid)
        marks["c1"] = time.perf_counter()

    def timed_validate(*a: object) -> bool:
        t0 = time.perf_counter()
        v = validate(*a)  # type: ignore[arg-type]
        sums.append(time.perf_counter() - t0)
        return v

    def raw() -> None:
        te.complete(te.submit_read(session, [dest - HEADER_BYTES], [slot_addr], [HEADER_BYTES + size]))

    runs: dict[str, dict[str, list[float]]] = {"kvpool_get": {}, "raw_te_async": {}}
    te.submit_read, te.complete, reader_mod.valid_block = timed_submit, timed_complete, timed_validate  # type: ignore[method-assign]
    try:
        for _ in range(rounds):
            for name, fn in (("kvpool_get", get), ("raw_te_async", raw)):
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                for k, v in (("pre", marks["s0"] - t0), ("submit", marks["s1"] - marks["s0"]),
                             ("between", marks["c0"] - marks["s1"]), ("transfer", marks["c1"] - marks["c0"]),
                             ("post", t1 - marks["c1"]), ("total", t1 - t0)):
                    runs[name].setdefault(k, []).append(v)
    finally:
        te.submit_read, te.complete, reader_mod.valid_block = submit, complete, validate  # type: ignore[method-assign]
    out = {name: {k: statistics.median(v) * 1e6 for k, v in r.items()} for name, r in runs.items()}
    out["kvpool_get"]["validate"] = statistics.median(sums) * 1e6
    return out


def print_phases(p: dict[str, dict[str, float]]) -> None:
    for name in ("kvpool_get", "raw_te_async"):
        print(f"{'':>22}   {name:<12} " + "  ".join(f"{k} {v:.1f}" for k, v in p[name].items()) + " us", flush=True)


COLS = ("kvpool_get", "floor", "raw_te", "raw_te_ranges", "tcp", "memcpy", "mooncake_store")


def print_row(c: dict, header: bool) -> None:
    if header:
        print(f"{'block':>8} {'chain':>5} {'MiB':>6} | {'kvpool get':>10} {'floor':>6} {'raw TE':>7} {'ranges':>10} "
              f"{'TCP':>6} {'memcpy':>7} {'MC Store':>8} | {'get/raw':>7} {'get/flr':>7} {'flr/raw':>7} "
              f"{'get/store':>9} {'get p50':>8}")
        print(f"{'':>8} {'':>5} {'':>6} | {'GB/s':>10} {'GB/s':>6} {'GB/s':>7} {'GB/s':>10} {'GB/s':>6} {'GB/s':>7} "
              f"{'GB/s':>8} | {'':>7} {'':>7} {'':>7} {'':>9} {'ms':>8}")
    get, flr, raw, rng, tcp, mem, store = (c.get(f"{k}_GBps", float("nan")) for k in COLS)
    ranges = f"({c['ranges']}) {rng:.2f}"
    print(f"{c['block_bytes'] // 1024:>6}Ki {c['chain']:>5} {c['bytes'] / 2**20:>6.1f} | {get:>10.2f} {flr:>6.2f} "
          f"{raw:>7.2f} {ranges:>10} {tcp:>6.2f} {mem:>7.2f} {store:>8.2f} | {get / raw:>7.0%} {get / flr:>7.0%} "
          f"{flr / raw:>7.0%} {get / store:>9.0%} {c['kvpool_get_s'] * 1e3:>8.3f}", flush=True)


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-transfer-") as tmp:
        rows = run(args, Path(tmp))
    write_report(args.out, {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows})
    return 0
