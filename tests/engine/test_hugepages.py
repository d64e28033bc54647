"""engine.hugepages: the KV cache and the linears' weight panels are advised onto transparent huge pages
(THP "madvise" mode, Debian's default, backs only regions that ask)."""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

from engine import hugepages
from engine.kv_cache import CacheLayout, PagedKVCache
from engine.layer_ops import PANEL, half_panels, pack_panels

# The advice is taken wherever the kernel has THP at all (whatever its mode: "never" only
# stops it from being acted on); without THP madvise refuses it.
HAS_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def advised(t: torch.Tensor) -> list[bool]:
    """For each mapping under the whole 2 MiB pages of `t`'s storage: whether it carries the
    huge-page advice (VmFlags "hg" in /proc/self/smaps). Whether the kernel then finds free
    2 MiB pages at fault time depends on the machine's fragmentation, so the advice is what a
    test can hold; the speed it buys is measured in docs/journal/benchmarks-history.md, in a fresh process."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo, hi = (start + hugepages.HUGE_PAGE - 1) & ~(hugepages.HUGE_PAGE - 1), end & ~(hugepages.HUGE_PAGE - 1)
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and lo < b
        elif inside and line.startswith("VmFlags:"):
            flags.append("hg" in line.split()[1:])
    return flags


def test_a_kv_cache_is_advised_onto_huge_pages() -> None:
    cache = PagedKVCache(CacheLayout(30, 3, 64, 16, torch.float32), 200)  # ~147 MB
    assert (cache.raw == 0).all()  # still a zeroed cache
    flags = advised(cache.raw)
    assert flags and all(flags) == HAS_THP


def test_fresh_memory_is_not_advised_until_asked() -> None:
    """The check can fail: a fresh anonymous mapping carries no "hg" until `advise` asks.
    (Not torch.empty: in a long process malloc may hand back memory advised earlier.)"""
    buf = mmap.mmap(-1, 64 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    flags = advised(t)
    assert flags and not any(flags)
    assert hugepages.advise(t) == HAS_THP
    assert all(advised(t)) == HAS_THP
    del t
    buf.close()


def test_weight_panels_are_advised_and_equal_to_the_weight() -> None:
    w = torch.randn(PANEL * 256, 576)  # 18.9 MB of panels
    p = pack_panels(w)
    if half_panels():  # each panel's two halves one after the other
        assert torch.equal(p.view(256, 2, 576, PANEL // 2), w.view(256, 2, PANEL // 2, 576).transpose(2, 3))
    else:
        assert torch.equal(p, w.view(256, PANEL, 576).transpose(1, 2))
    flags = advised(p)
    assert flags and all(flags) == HAS_THP


def test_small_or_non_cpu_tensors_are_left_alone() -> None:
    assert not hugepages.advise(torch.empty(16))  # no whole 2 MiB page inside
    assert hugepages.empty((4, 4), torch.float32).shape == (4, 4)
