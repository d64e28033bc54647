"""Who may make which metaserver call: bearer tokens, roles, and node session proofs.

Where it sits: the servicer (`metaserver.servicer`) asks `Authenticator.authorize` before
every MetaService call; the domain layer (`metaserver.service`) checks a node's session
proof against the node record, under its lock, so the check and the change are atomic.

Two shared secrets, configured on the server (`--admin-token-file`, `--node-token-file`):
- the admin token may make every call, for any node;
- the node token may make node calls (RegisterNode, KeepAlive, UnregisterNode, Publish,
  Unpublish), queries and failed-read reports, the node calls only for a node whose session
  proof it carries: RegisterNode returns a fresh random session token, whose SHA-256 is kept in the node's etcd record
  (so every replica can check it), and later calls for that node must send the token as
  `kvpool-node-session` metadata. A node token can thus not act for another node, nor
  replace another node's live registration.
With no token configured every call is open (the behaviour before tokens existed).

Statuses: no `authorization` metadata, a malformed one or a token that matches neither
secret -> UNAUTHENTICATED (we do not know who called); a known token that may not make the
call, or a node call without the node's session proof -> PERMISSION_DENIED. Messages never
contain a secret. Health and reflection are not guarded.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from metaserver.errors import PermissionDenied, Unauthenticated

AUTHORIZATION_KEY = "authorization"       # metadata: "Bearer <token>"
SESSION_KEY = "kvpool-node-session"       # metadata: the session token RegisterNode returned
MIN_TOKEN_LEN = 16


class Role(enum.Enum):
    ADMIN = "admin"
    NODE = "node"


class Access(enum.Enum):
    """What a method needs."""

    QUERY = "query"   # either token
    NODE = "node"     # the node token with the node's session proof, or the admin token
    ADMIN = "admin"   # the admin token


METHOD_ACCESS: dict[str, Access] = {
    "RegisterNode": Access.NODE,
    "KeepAlive": Access.NODE,
    "UnregisterNode": Access.NODE,
    "Publish": Access.NODE,
    "Unpublish": Access.NODE,
    "QueryPrefix": Access.QUERY,
    "QueryPrefixBatch": Access.QUERY,
    "ReportFailedRead": Access.QUERY,
    "WatchIndex": Access.QUERY,
    "Invalidate": Access.ADMIN,
    "Drain": Access.ADMIN,
    "Undrain": Access.ADMIN,
    "Stats": Access.QUERY,
    "ListNodes": Access.QUERY,
}


@dataclass(frozen=True, slots=True)
class Caller:
    """The authorized caller of one RPC."""

    role: Role | None   # None: the server checks no tokens
    # The session proof that node-bound calls must match: None when none is checked (no
    # tokens configured, or the admin token); "" when a node token came without one.
    node_session: str | None = None


OPEN = Caller(None, None)


def new_session_token() -> str:
    return secrets.token_urlsafe(32)


def session_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def session_matches(digest: bytes, token: str) -> bool:
    """Constant-time check of a session token against a stored digest (b"": never matches)."""
    return bool(digest) and bool(token) and hmac.compare_digest(digest, session_digest(token))


def check_token(token: str, what: str) -> None:
    """ValueError (never showing the token) unless `token` can be a bearer secret."""
    if len(token) < MIN_TOKEN_LEN:
        raise ValueError(f"{what} must be at least {MIN_TOKEN_LEN} characters (e.g. `openssl rand -hex 32`)")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"{what} must be printable ASCII without spaces (it travels as gRPC metadata)")


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


class Authenticator:
    """Maps a call's metadata to a `Caller`; thread-safe (immutable after construction)."""

    def __init__(self, admin_token: str = "", node_token: str = "") -> None:
        self._admin = admin_token.encode()
        self._node = node_token.encode()

    @property
    def enabled(self) -> bool:
        return bool(self._admin or self._node)

    def authorize(self, metadata: Iterable[tuple[str, str | bytes]], method: str) -> Caller:
        """The caller of `method`; raises Unauthenticated or PermissionDenied."""
        if not self.enabled:
            return OPEN
        values = {key: value for key, value in metadata}
        header = values.get(AUTHORIZATION_KEY)
        if header is None:
            raise Unauthenticated(f"{method}: missing credentials: this metaserver needs "
                                  "'authorization: Bearer <token>' metadata (kvpool admin --token-file)")
        scheme, _, token = _bytes(header).strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise Unauthenticated(f"{method}: malformed authorization metadata; expected 'Bearer <token>'")
        token = token.strip()
        # Both comparisons always run: the time taken does not tell which secret was close.
        is_admin = hmac.compare_digest(token, self._admin) & bool(self._admin)
        is_node = hmac.compare_digest(token, self._node) & bool(self._node)
        if not (is_admin or is_node):
            raise Unauthenticated(f"{method}: invalid token")
        if is_admin:
            return Caller(Role.ADMIN, None)
        access = METHOD_ACCESS[method]
        if access is Access.ADMIN:
            raise PermissionDenied(f"{method} needs the admin token; the node token may not make this call")
        session = values.get(SESSION_KEY, "")
        return Caller(Role.NODE, _bytes(session).decode("ascii", "replace"))
