"""Configuration of the metadata server: one frozen dataclass, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from metaserver.auth import check_token


@dataclass(frozen=True)
class MetaServerConfig:
    listen: str = "127.0.0.1:50051"                # HOST:PORT the gRPC server binds
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    key_prefix: str = "/kvpool/"                    # every etcd key lives under it
    replica_id: str = ""                            # for logs and Stats; default host:port
    hash_bytes: int = 32                            # length of every block hash
    default_lease_ttl_s: int = 10                   # node lease when RegisterNode asks for 0
    max_lease_ttl_s: int = 3600
    max_publish_batch: int = 8192                   # records per Publish / hashes per Unpublish
    max_query_hashes: int = 16384                   # chain length per QueryPrefix
    max_invalidate_hashes: int = 65536
    max_capacity_bytes: int = 1 << 50               # 1 PiB: larger is a client bug
    max_txn_ops: int = 128                          # etcd's default --max-txn-ops
    max_inflight_txns: int = 4                      # concurrent write-behind transactions
    max_pending_writes: int = 2_000_000             # queued etcd changes before Publish is refused
    etcd_timeout_s: float = 2.0                     # deadline of every etcd call
    etcd_retry_s: float = 0.2                       # first backoff after etcd failed
    shutdown_flush_s: float = 5.0                   # SIGTERM: time to write the queue through
    # etcd's history, compacted by the metaserver (as kube-apiserver does): every interval, to
    # the current revision less `etcd_compact_keep`. etcd's own auto-compaction runs only on
    # a leader that has lived a whole period, which members restarted often never do.
    etcd_compact_interval_s: float = 300.0          # 0 = leave it to etcd's own settings
    etcd_compact_keep: int = 10_000                 # revisions kept (a lagging watcher reloads)
    # TLS (PEM files; all "" = plaintext gRPC). A client CA turns on mutual TLS: every
    # client must present a certificate it signed.
    tls_cert_file: str = ""                         # server certificate chain
    tls_key_file: str = ""                          # its private key
    tls_client_ca_file: str = ""                    # CA bundle that signs client certificates
    # Bearer tokens (metaserver.auth); both "" = every call is open. Never logged.
    admin_token: str = field(default="", repr=False)
    node_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")
        if not self.etcd_endpoints:
            raise ValueError("at least one etcd endpoint is needed (--etcd HOST:PORT)")
        for ep in self.etcd_endpoints:
            h, sep, p = ep.rpartition(":")
            if not sep or not h or not p.isdigit():
                raise ValueError(f"etcd endpoint must be HOST:PORT, got {ep!r}")
        if not self.key_prefix.startswith("/") or not self.key_prefix.endswith("/"):
            raise ValueError(f"key_prefix must start and end with '/', got {self.key_prefix!r}")
        if not 8 <= self.hash_bytes <= 64:
            raise ValueError(f"hash_bytes must be in 8..64, got {self.hash_bytes}")
        if not 1 <= self.default_lease_ttl_s <= self.max_lease_ttl_s:
            raise ValueError("default_lease_ttl_s must be in 1..max_lease_ttl_s")
        if not 1 <= self.max_txn_ops <= 10_000:
            raise ValueError(f"max_txn_ops must be in 1..10000, got {self.max_txn_ops}")
        for name in ("max_publish_batch", "max_query_hashes", "max_invalidate_hashes",
                     "max_inflight_txns", "max_pending_writes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.etcd_compact_interval_s < 0 or self.etcd_compact_keep < 1:
            raise ValueError("etcd_compact_interval_s must be >= 0 and etcd_compact_keep >= 1")
        if self.etcd_timeout_s <= 0 or self.etcd_retry_s <= 0:
            raise ValueError("etcd_timeout_s and etcd_retry_s must be > 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("--tls-client-ca (mutual TLS) needs TLS: give --tls-cert and --tls-key too")
        if self.admin_token:
            check_token(self.admin_token, "the admin token")
        if self.node_token:
            check_token(self.node_token, "the node token")
        if self.admin_token and self.admin_token == self.node_token:
            raise ValueError("the admin token and the node token must differ")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def auth(self) -> bool:
        return bool(self.admin_token or self.node_token)

    @property
    def replica_name(self) -> str:
        return self.replica_id or self.listen
