"""engine.hugepages: the KV cache and the GEMV panels land on transparent huge pages where the
kernel offers them (THP "madvise" mode, Debian's default, backs only regions that ask)."""
from __future__ import annotations

from pathlib import Path

import torch

from engine import hugepages
from engine.kv_cache import CacheLayout, PagedKVCache
from engine.layer_ops import GEMV_PANEL, pack_gemv

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ON = THP.exists() and "[never]" not in THP.read_text()


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that hold `t`'s storage, from /proc/self/smaps."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_a_kv_cache_is_on_huge_pages() -> None:
    cache = PagedKVCache(CacheLayout(30, 3, 64, 16, torch.float32), 200)  # ~147 MB
    assert (cache.raw == 0).all()  # still a zeroed cache
    if THP_ON:
        assert huge_kib(cache.raw) >= 100 * 1024
    else:
        assert huge_kib(cache.raw) == 0


def test_plain_torch_memory_stays_on_small_pages_here() -> None:
    """The comparison can fail: without the advice, "madvise" mode gives no huge pages."""
    if THP_ON and "[madvise]" in THP.read_text():
        t = torch.empty((64 << 20,), dtype=torch.uint8).fill_(1)
        assert huge_kib(t) == 0


def test_gemv_panels_are_advised_and_equal_to_the_weight() -> None:
    w = torch.randn(GEMV_PANEL * 256, 576)  # 18.9 MB of panels
    p = pack_gemv(w)
    assert torch.equal(p, w.view(256, GEMV_PANEL, 576).transpose(1, 2))
    if THP_ON:
        assert huge_kib(p) >= 8 * 1024


def test_small_or_non_cpu_tensors_are_left_alone() -> None:
    assert not hugepages.advise(torch.empty(16))  # no whole 2 MiB page inside
    assert hugepages.empty((4, 4), torch.float32).shape == (4, 4)
