"""The C attention kernels (engine/native/csrc/paged_decode.c, paged_prefill.c), built on first
use and called via ctypes.

Built and cached by `engine.native.build` (this machine's compiler and CPU; see there).
`available()` is False (and the torch path runs) where no compiler works; `build(SOURCE)` raises
instead, for `make setup` and tests that must not pass without the kernel.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from engine.native.build import CSRC, KernelBuildError, LazyLibrary

SOURCE = CSRC / "paged_decode.c"
PREFILL_SOURCE = CSRC / "paged_prefill.c"
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64  # the C source's array bounds
PREFILL_HEAD_DIM = 64  # the prefill kernel's register tiles are cut for this head size


def _bind(lib: ctypes.CDLL) -> Any:
    f = lib.paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    f.restype = None
    return f


_kernel = LazyLibrary(SOURCE, _bind, "C decode attention unavailable, using the torch path")


def _function():  # noqa: ANN202
    return _kernel.get()


def available() -> bool:
    return _function() is not None


def supports(blocks: torch.Tensor, heads: int, kv_heads: int) -> bool:
    """Whether the kernel handles this cache ([block, layer, k/v, token, kv_head, head_dim] view) and head shape."""
    return (_float32_cache(blocks, heads, kv_heads) and heads // kv_heads <= MAX_GROUP
            and blocks.shape[-1] <= MAX_HEAD_DIM and blocks.shape[3] <= MAX_BLOCK and available())


def _float32_cache(blocks: torch.Tensor, heads: int, kv_heads: int) -> bool:
    """What both kernels read: a float32 CPU cache whose (kv_head, head_dim) rows are dense, and
    query heads in whole groups per KV head."""
    return (blocks.device.type == "cpu" and blocks.dtype == torch.float32 and heads % kv_heads == 0
            and blocks.stride(-1) == 1 and blocks.stride(4) == blocks.shape[-1])


def paged_decode(q: torch.Tensor, blocks: torch.Tensor, layer: int, rows: torch.Tensor, ctx_lens: torch.Tensor,
                 tables: torch.Tensor, table_starts: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Attention of the one-token sequences at `rows` of q ([tokens, heads, head_dim], last dim contiguous)
    over their paged K/V, written into the same rows of `out` ([tokens, heads, head_dim], contiguous).
    Sequence i's block table is tables[table_starts[i]:...] and it has ctx_lens[i] keys (its new token's
    included, already written). All index tensors int64, contiguous, on the CPU."""
    fn = _function()
    assert fn is not None and q.stride(-1) == 1 and q.stride(1) == q.shape[-1] and out.is_contiguous()
    kvh, hd = blocks.shape[4], blocks.shape[5]
    fn(blocks.data_ptr(), blocks.stride(0), layer * blocks.stride(1), blocks.stride(2), blocks.stride(3),
       q.data_ptr(), q.stride(0), out.data_ptr(), rows.data_ptr(), ctx_lens.data_ptr(), tables.data_ptr(),
       table_starts.data_ptr(), rows.shape[0], kvh, q.shape[1] // kvh, hd, blocks.shape[3], scale)


def _bind_prefill(lib: ctypes.CDLL) -> Any:
    lib.paged_prefill_built.restype = ctypes.c_int
    if not lib.paged_prefill_built():
        raise KernelBuildError("this CPU has neither AVX-512 nor AVX2 with FMA (the kernel's register tiles need one)")
    f = lib.paged_prefill_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    f.restype = ctypes.c_int
    return f


_prefill_kernel = LazyLibrary(PREFILL_SOURCE, _bind_prefill, "C prefill attention unavailable, using SDPA")


def supports_prefill(q: torch.Tensor, blocks: torch.Tensor) -> bool:
    """Whether `paged_prefill` can run for these queries ([tokens, heads, head_dim]) and this
    cache (it may still decline: see its return value)."""
    return (_float32_cache(blocks, q.shape[1], blocks.shape[4]) and blocks.shape[-1] == PREFILL_HEAD_DIM
            and q.dtype == torch.float32 and q.stride(-1) == 1 and q.stride(1) == q.shape[-1]
            and _prefill_kernel.get() is not None)


def paged_prefill(q: torch.Tensor, blocks: torch.Tensor, layer: int, table: torch.Tensor, ctx_len: int,
                  out: torch.Tensor, scale: float) -> bool:
    """Causal attention of one sequence's last q.shape[0] positions ([n, heads, head_dim], head
    and dim contiguous) over its `ctx_len` keys, read in place along `table` (int64;
    the chunk's own K/V already written), into `out` ([n, heads, head_dim], same inner layout).
    False (nothing written) where the built kernel declines (head_dim not 64): use SDPA then."""
    fn = _prefill_kernel.get()
    hd = blocks.shape[5]
    assert fn is not None and q.stride(-1) == 1 and q.stride(1) == hd and out.stride(-1) == 1 and out.stride(1) == hd
    table = table.contiguous()
    assert table.dtype == torch.int64 and table.device.type == "cpu"
    kvh = blocks.shape[4]
    return bool(fn(blocks.data_ptr(), blocks.stride(0), layer * blocks.stride(1), blocks.stride(2), blocks.stride(3),
                   q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), table.data_ptr(), ctx_len, q.shape[0],
                   kvh, q.shape[1] // kvh, hd, blocks.shape[3], scale))
