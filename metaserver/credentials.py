"""Client-side credentials for a secured metaserver: TLS files and a bearer token.

Where it sits: `MetaClient` (and through it `NodeSession`, the connector and `kvpool
admin`) builds its channels and call metadata from a `ClientSecurity`;
`kvpool_harness.processes.wait_serving` uses one to poll a TLS server's health. The server
side is `metaserver.server` (TLS) and `metaserver.auth` (tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from metaserver.auth import AUTHORIZATION_KEY


def read_secret_file(path: str, what: str) -> str:
    """The secret in `path` without surrounding whitespace; ValueError (naming the file,
    never its content) when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ValueError(f"cannot read the {what} file {path}: {reason}") from None
    if not secret:
        raise ValueError(f"the {what} file {path} is empty")
    return secret


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"cannot read the {what} {path}: {err.strerror}") from None


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches the metaserver. The default is plaintext without a token."""

    tls_ca_file: str = ""        # PEM CA bundle that signed the server certificate; "" = plaintext
    tls_cert_file: str = ""      # PEM client certificate chain (mutual TLS)
    tls_key_file: str = ""       # its private key
    tls_server_name: str = ""    # name to verify in the server certificate; "" = the endpoint's host
    token: str = field(default="", repr=False)  # bearer token (admin or node); "" = none

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("a client certificate needs its key (--tls-cert and --tls-key together)")
        if (self.tls_cert_file or self.tls_server_name) and not self.tls_ca_file:
            raise ValueError("TLS options need the CA that signed the server certificate (--tls-ca)")
        if self.token and (not self.token.isascii() or not self.token.isprintable()
                           or any(c.isspace() for c in self.token)):
            raise ValueError("the token must be printable ASCII without spaces")

    @classmethod
    def from_files(cls, tls_ca_file: str = "", tls_cert_file: str = "", tls_key_file: str = "",
                   token_file: str = "", tls_server_name: str = "") -> ClientSecurity:
        """From file paths ("" = not given); the token is read from `token_file` now."""
        token = read_secret_file(token_file, "token") if token_file else ""
        return cls(tls_ca_file, tls_cert_file, tls_key_file, tls_server_name, token)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from the files (read now), or None for plaintext; ValueError."""
        if not self.tls:
            return None
        cert = _read(self.tls_cert_file, "TLS client certificate") if self.tls_cert_file else None
        key = _read(self.tls_key_file, "TLS client key") if self.tls_key_file else None
        return grpc.ssl_channel_credentials(_read(self.tls_ca_file, "TLS CA file"), key, cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTHORIZATION_KEY, f"Bearer {self.token}"),) if self.token else ()

    def channel(self, target: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
        """A channel to `target` with these credentials (no call metadata: see call_metadata)."""
        opts = [*(options or []), *self.channel_options()]
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, credentials, options=opts)
