"""The pool connector's settings, read once from `kv_connector_extra_config`.

Both halves and every host (our engine's `MooncakeConnector`, a vLLM plug-in) take these
instead of reading the free-form JSON themselves.

Keys: metaserver (HOST:PORT[,..], required), pool_size ("4GiB"), pool_disk (a directory for
the pool's disk tier) and pool_disk_size ("64GiB"; the tier is off unless both are set), node_id, api_url (the engine's
http://HOST:PORT, announced in the node registry for routers), protocol,
metadata_server, device_name, local_hostname, transfer_timeout_s, progress_timeout_s,
lease_ttl_s, read_timeout_s, rpc_timeout_s, query_timeout_s, lookup_deadline_s, suspect_s, lookup_view,
view_stale_s, async_saves, save_queue_blocks, save_policy (write_through | selective: see
`connector.save_policy`), save_seen_blocks, metaserver_tls_ca /
metaserver_tls_cert / metaserver_tls_key / metaserver_token_file, handoff_wait_s (P/D from a vLLM
producer: how long a decode node waits for the prompt's blocks to appear in the index), debug_load_delay_s (fault
drills: wait this long between the query and the read, so a test can kill or overwrite the
source).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connector.save_policy import check_policy
from kvpool.layout import parse_size
from kvpool.transfer import TransferConfig
from metaserver.client import MetaClient
from metaserver.credentials import ClientSecurity


def _flag(value: Any) -> bool:
    """A JSON boolean, or its string spelling (a helm value or CLI flag may arrive as text)."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes", "on"):
        return True
    if str(value).lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def default_node_id() -> str:
    """A node id when none is configured: this host and process."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PoolConnectorSettings:
    metaserver: str                    # HOST:PORT[,HOST:PORT] of the metadata servers
    node_id: str                       # this node's stable id in the pool
    pool_size_bytes: int               # this node's DRAM pool
    transfer: TransferConfig           # the transfer engine's protocol, metadata mode, timeouts
    lease_ttl_s: int = 10              # node lease in the metaserver
    read_timeout_s: float = 10.0       # a pool read not finished by then fails (capped by kv_load_timeout_s)
    rpc_timeout_s: float = 5.0         # deadline of the metaserver client's RPCs
    query_timeout_s: float = 1.0       # deadline of one lookup RPC (on the lookup thread)
    lookup_deadline_s: float = 0.1     # a request waits this long for its lookup, then goes on locally
    suspect_s: float = 5.0             # a source whose reads all failed is not offered for this long
    lookup_view: bool = True           # answer lookups from a node-local view of the index (metaserver.view)
    view_stale_s: float = 2.0          # a view silent this long is not used (lookups go by RPC)
    async_saves: bool = True           # copy saved blocks into the pool on a saver thread, off the step
    save_queue_blocks: int = 256       # saves waiting beyond this are dropped (never waited for)
    save_policy: str = "write_through"  # or "selective": save a block from its second computation here
    save_seen_blocks: int = 65536      # selective: block hashes remembered as computed once
    debug_load_delay_s: float = 0.0    # fault drills only: delay between lookup and read
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""
    api_url: str = ""                  # the engine's API (http://HOST:PORT) in the registry; "" = none
    handoff_wait_s: float = 5.0        # P/D from a vLLM producer: wait this long for its blocks in the index
    disk_dir: str = ""                 # the pool's disk tier (kvpool.disk); off unless this and
    disk_size_bytes: int = 0           # its size are both set

    @classmethod
    def from_extra(cls, extra: Callable[[str, Any], Any], load_timeout_s: float) -> PoolConnectorSettings:
        """From `KVTransferConfig.extra`; ValueError with a one-line message for a bad value."""
        metaserver = extra("metaserver", "")
        if not metaserver:
            raise ValueError("the mooncake connector needs kv_connector_extra_config.metaserver (HOST:PORT)")
        try:
            transfer = TransferConfig(protocol=extra("protocol", "tcp"),
                                      metadata_server=extra("metadata_server", "P2PHANDSHAKE"),
                                      device_name=extra("device_name", ""),
                                      local_hostname=extra("local_hostname", "127.0.0.1"),
                                      transfer_timeout_s=int(extra("transfer_timeout_s", 20)),
                                      progress_timeout_s=int(extra("progress_timeout_s", 10)))
            return cls(metaserver=str(metaserver), node_id=str(extra("node_id", "") or default_node_id()),
                       pool_size_bytes=parse_size(extra("pool_size", "1GiB")), transfer=transfer,
                       lease_ttl_s=int(extra("lease_ttl_s", 10)),
                       read_timeout_s=min(float(extra("read_timeout_s", 10.0)), load_timeout_s),
                       rpc_timeout_s=float(extra("rpc_timeout_s", 5.0)),
                       query_timeout_s=float(extra("query_timeout_s", 1.0)),
                       lookup_deadline_s=float(extra("lookup_deadline_s", 0.1)),
                       suspect_s=float(extra("suspect_s", 5.0)),
                       lookup_view=_flag(extra("lookup_view", True)),
                       view_stale_s=float(extra("view_stale_s", 2.0)),
                       async_saves=_flag(extra("async_saves", True)),
                       save_queue_blocks=int(extra("save_queue_blocks", 256)),
                       save_policy=str(extra("save_policy", "write_through")),
                       save_seen_blocks=int(extra("save_seen_blocks", 65536)),
                       debug_load_delay_s=float(extra("debug_load_delay_s", 0.0)),
                       tls_ca_file=extra("metaserver_tls_ca", ""), tls_cert_file=extra("metaserver_tls_cert", ""),
                       tls_key_file=extra("metaserver_tls_key", ""), token_file=extra("metaserver_token_file", ""),
                       api_url=str(extra("api_url", "")),
                       handoff_wait_s=float(extra("handoff_wait_s", cls.handoff_wait_s)),
                       disk_dir=str(extra("pool_disk", "")), disk_size_bytes=parse_size(extra("pool_disk_size", 0)))
        except (TypeError, ValueError) as err:
            raise ValueError(f"kv_connector_extra_config: {err}") from None

    def __post_init__(self) -> None:
        check_policy(self.save_policy)
        if self.save_seen_blocks < 1 or self.save_queue_blocks < 1:
            raise ValueError("save_seen_blocks and save_queue_blocks must be >= 1")

    def meta_client(self) -> MetaClient:
        """A new metaserver client with these credentials (each half owns its own: in vLLM the
        scheduler and the workers live in different processes)."""
        security = ClientSecurity.from_files(tls_ca_file=self.tls_ca_file, tls_cert_file=self.tls_cert_file,
                                             tls_key_file=self.tls_key_file, token_file=self.token_file)
        return MetaClient(self.metaserver, timeout_s=self.rpc_timeout_s, security=security)
