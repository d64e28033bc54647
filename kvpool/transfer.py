"""The binding layer over the Mooncake Transfer Engine: config in, exceptions out.

Where it sits: `kvpool.pool` reads remote blocks through this module only. The binding
returns integer codes (0 ok, negative failure); here they become `TransferError`s. Protocol (tcp, rdma), metadata mode
(P2PHANDSHAKE, etcd://..., http://...) and device are configuration.

The engine reads its timeouts from the environment when it is created, so `TransferEngine`
sets MC_TRANSFER_TIMEOUT / MC_TCP_PROGRESS_TIMEOUT_SEC (and MC_TCP_BIND_ADDRESS in etcd
mode) from the config before constructing the binding; the values are process-wide.

Thread safety: the binding is thread-safe for transfers; registration is done by one owner.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


class TransferError(Exception):
    """A transfer-engine call failed (the binding's return code is in the message)."""


@dataclass(frozen=True)
class TransferConfig:
    """The transfer engine's settings. Its timeouts reach the binding through the process's
    environment (MC_TRANSFER_TIMEOUT, MC_TCP_PROGRESS_TIMEOUT_SEC, and MC_TCP_BIND_ADDRESS in
    etcd mode), which `TransferEngine` sets from these fields as it is created: the binding
    reads them then, once per process, so every engine of a process shares them."""

    protocol: str = "tcp"                  # "tcp" here; "rdma" where the hardware has it
    metadata_server: str = "P2PHANDSHAKE"  # or "etcd://HOST:PORT", "http://HOST:PORT/metadata"
    device_name: str = ""                  # RDMA devices, comma-separated; "" = auto
    local_hostname: str = "127.0.0.1"      # address peers reach this node at
    # A read fails once no byte of it moved for progress_timeout_s (the connection is dropped), or
    # transfer_timeout_s after it was posted (the binding gives up; the transfer may go on: see
    # kvpool.reader). A loaded host stalls for seconds (swapping, starved threads): at 2 s, such
    # stalls failed reads that 10 s lets finish (docs/BENCHMARKS.md, "vLLM plug-in reads").
    transfer_timeout_s: int = 20           # MC_TRANSFER_TIMEOUT (the binding takes at least 5)
    progress_timeout_s: int = 10           # TCP: MC_TCP_PROGRESS_TIMEOUT_SEC

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not (self.metadata_server == "P2PHANDSHAKE" or self.metadata_server.startswith(("etcd://", "http://"))):
            raise ValueError("metadata_server must be P2PHANDSHAKE, etcd://HOST:PORT or http://HOST:PORT/metadata")
        if self.transfer_timeout_s < 1 or self.progress_timeout_s < 1:
            raise ValueError("transfer timeouts must be >= 1 s")


class TransferEngine:
    """One initialized Mooncake transfer engine with the memory it registered."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        os.environ["MC_TRANSFER_TIMEOUT"] = str(config.transfer_timeout_s)
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(config.progress_timeout_s)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        if config.metadata_server != "P2PHANDSHAKE":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        try:
            from mooncake.engine import TransferEngine as _Binding
        except ImportError as err:
            raise TransferError(
                f"the Mooncake Transfer Engine is not importable ({err}); install kvpool[cpu] or kvpool[cuda] "
                "and Debian libibverbs1") from None
        self._te = _Binding()
        rc = self._te.initialize(config.local_hostname, config.metadata_server, config.protocol, config.device_name)
        if rc != 0:
            raise TransferError(f"transfer engine initialize({config.local_hostname}, {config.metadata_server}, "
                                f"{config.protocol}) returned {rc}")
        self.session_id = f"{config.local_hostname}:{self._te.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # addr -> nbytes

    # ---- memory ---------------------------------------------------------------------

    def register(self, addr: int, nbytes: int) -> None:
        if nbytes <= 0:
            raise TransferError(f"cannot register {nbytes} bytes")
        rc = self._te.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({addr:#x}, {nbytes}) returned {rc}")
        self._registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        if self._registered.pop(addr, None) is None:
            return
        rc = self._te.unregister_memory(addr)
        if rc != 0:
            raise TransferError(f"unregister_memory({addr:#x}) returned {rc}")

    def is_registered(self, addr: int, nbytes: int) -> bool:
        """True if [addr, addr+nbytes) lies inside one registered region."""
        for base, size in self._registered.items():
            if base <= addr and addr + nbytes <= base + size:
                return True
        return False

    def close(self) -> None:
        for addr in list(self._registered):
            try:
                self.unregister(addr)
            except TransferError as err:
                log.warning("%s", err)

    # ---- reads ----------------------------------------------------------------------

    def read_sync(self, session: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        """Read remote ranges into local ones in one batch; raises TransferError on failure."""
        rc = self._te.batch_transfer_sync_read(session, local, remote, lengths)
        if rc != 0:
            raise TransferError(f"batch read of {len(lengths)} ranges from {session} returned {rc}")

    def submit_read(self, session: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> int:
        """Start a batched read; returns a batch id for `complete`."""
        batch = self._te.batch_transfer_async_read(session, local, remote, lengths)
        if batch <= 0:
            raise TransferError(f"submitting a read of {len(lengths)} ranges from {session} returned {batch}")
        return batch

    def complete(self, batch_id: int) -> None:
        """Block (GIL released) until every range of the batch is done; TransferError if any
        failed or the engine's transfer timeout passed. (The binding's transfer_check_status
        looks at a batch's first range only, so it cannot tell a batch is complete.)"""
        rc = self._te.get_batch_transfer_status([batch_id])
        if rc != 0:
            raise TransferError(f"transfer batch {batch_id} failed ({rc})")
