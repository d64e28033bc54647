"""A KV cache in GPU memory, as the pool reaches it: loads copied host-to-device, saves staged
device-to-host on their own stream.

Where it sits: `PoolWorker.register_cache` builds these when the host's cache tensors are on
CUDA (the CPU path does not import this module). The pool itself only ever holds host memory:
a remote block lands in the pool's host read buffer, is validated there, and only then is
copied into the cache (`CudaMemory.write`), so a failed, torn or foreign transfer never
touches GPU memory. (Landing transfers in GPU memory directly would save that copy but would
put unvalidated bytes into the cache; over TCP the transfer engine bounces through host
memory anyway.)

- `CudaMemory`: the pool's `kvpool.layout.CallerMemory` for device addresses inside the
  registered cache tensors (any other address is host memory, memcpy). Each calling thread
  has its own copy stream; a copy first waits for the work already queued on the device's
  default stream (the engine's forward passes: a kernel of a block's previous owner may still
  read it), and the call returns once the copy is complete.
- `CudaStaging`: the saver's staging (`connector.saver`): at `stage` (the host's thread, right
  after a forward pass) a block's bytes are copied device-to-host into a pinned staging slot
  on the save stream, ordered after that pass, with one event per batch; the saver's thread
  waits on the event and puts the staged bytes into the pool; a fence before a forward pass
  makes the device wait on the events of queued saves of the blocks it writes, on the device,
  never on the host.

Thread-safe: the regions are read-only after construction; streams are per thread; staging
slots are handed out under a lock.
"""
from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.layout import CallerMemory, Payload, memcpy, segments_of, view

log = logging.getLogger(__name__)

def host_bytes(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of host memory at `addr` (no copy; the caller keeps it alive)."""
    return torch.frombuffer(view(addr, nbytes), dtype=torch.uint8)


class CudaMemory(CallerMemory):
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        """`tensors`: the cache's tensors on one CUDA device (the addresses the host names are
        inside them)."""
        if not tensors or any(not t.is_cuda or t.device != tensors[0].device for t in tensors):
            raise ValueError("CudaMemory needs the cache's tensors, all on one CUDA device")
        self.device = tensors[0].device
        regions = sorted((t.data_ptr(), t.reshape(-1).view(torch.uint8)) for t in tensors)
        self._starts = [start for start, _ in regions]
        self._bytes = [u8 for _, u8 in regions]
        self._local = threading.local()
        self._pinned: list[int] = []

    def pin(self, regions: Sequence[tuple[int, int]]) -> int:
        """Page-lock host memory that copies come from or go to (the pool's slots and read
        buffer), so those copies run as DMA without a bounce; best effort (a region that cannot
        be pinned is copied pageable). Returns the bytes pinned; `unpin` before freeing them."""
        pinned = 0
        for addr, nbytes in regions:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0))
            except Exception as err:  # noqa: BLE001 - pageable copies still work
                log.warning("could not pin %d bytes of host memory for copies to %s: %s", nbytes, self.device, err)
                continue
            self._pinned.append(addr)
            pinned += nbytes
        return pinned

    def unpin(self) -> None:
        for addr in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(addr)
        self._pinned.clear()

    def stream(self) -> torch.cuda.Stream:
        """This thread's copy stream."""
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = torch.cuda.Stream(self.device)
        return s

    def device_bytes(self, addr: int, nbytes: int) -> torch.Tensor | None:
        """The cache's bytes [addr, addr + nbytes) as a uint8 tensor, or None if `addr` is not
        in the cache (host memory)."""
        k = bisect.bisect_right(self._starts, addr) - 1
        if k < 0:
            return None
        off = addr - self._starts[k]
        u8 = self._bytes[k]
        if off >= u8.numel():
            return None
        if off + nbytes > u8.numel():
            raise ValueError(f"{nbytes} bytes at offset {off} run past the cache tensor's {u8.numel()} bytes")
        return u8[off:off + nbytes]

    def write(self, dest: Payload, src: int, nbytes: int) -> None:
        self._copy(dest, src, nbytes, to_caller=True)

    def read(self, dst: int, src: Payload, nbytes: int) -> None:
        self._copy(src, dst, nbytes, to_caller=False)

    def _copy(self, payload: Payload, host: int, nbytes: int, to_caller: bool) -> None:
        """Between the caller's `payload` (device addresses, or host ones outside the cache) and
        host memory at `host`, in the direction `to_caller` says; complete on return."""
        s = self.stream()
        s.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(s):
            for addr, offset, length in segments_of(payload, nbytes):
                d = self.device_bytes(addr, length)
                h = host + offset
                if d is None:
                    memcpy(addr, h, length) if to_caller else memcpy(h, addr, length)
                elif to_caller:
                    d.copy_(host_bytes(h, length), non_blocking=True)
                else:
                    host_bytes(h, length).copy_(d, non_blocking=True)
        s.synchronize()


class CudaStaging:
    """Pinned host slots that saves are copied into device-to-host, on the save stream."""

    def __init__(self, memory: CudaMemory, block_bytes: int, slots: int) -> None:
        self._memory = memory
        self._block_bytes = block_bytes
        self._buf = torch.empty(max(1, slots) * block_bytes, dtype=torch.uint8, pin_memory=True)
        self._base = self._buf.data_ptr()
        self._lock = threading.Lock()
        self._free = list(range(max(1, slots) - 1, -1, -1))
        self._stream = torch.cuda.Stream(memory.device)

    def stage(self, payloads: Sequence[Payload]) -> tuple[list[int], Any]:
        """Queue device-to-host copies of as many of `payloads` as there are free slots, after
        the work queued so far on the current stream (the forward pass that computed them).
        Returns the staged copies' host addresses (in order; fewer than asked when the slots
        run out) and the event that completes them all."""
        with self._lock:
            take = min(len(payloads), len(self._free))
            slots = [self._free.pop() for _ in range(take)]
        if not slots:
            return [], None
        n = self._block_bytes
        self._stream.wait_stream(torch.cuda.current_stream(self._memory.device))
        with torch.cuda.stream(self._stream):
            for payload, slot in zip(payloads, slots):
                dst = slot * n
                for addr, offset, length in segments_of(payload, n):
                    d = self._memory.device_bytes(addr, length)
                    if d is None:
                        raise ValueError(f"save of a block outside the registered cache (address {addr:#x})")
                    self._buf[dst + offset:dst + offset + length].copy_(d, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return [self._base + slot * n for slot in slots], event

    def wait(self, event: Any) -> None:  # noqa: ANN401 - a torch.cuda.Event
        """The host waits until `event`'s copies are complete (the saver's thread)."""
        event.synchronize()

    def order_before_writes(self, event: Any) -> None:  # noqa: ANN401 - a torch.cuda.Event
        """Work queued next on the current stream (the forward pass that overwrites a block
        whose save is queued) waits on the device for `event`'s copies; the host goes on."""
        torch.cuda.current_stream(self._memory.device).wait_event(event)

    def release(self, addr: int) -> None:
        with self._lock:
            self._free.append((addr - self._base) // self._block_bytes)

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)
