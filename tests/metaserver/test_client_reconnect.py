"""The metaserver client after its replicas restart: a channel whose connection failed waits
out its reconnect backoff before trying again and fails every call at once meanwhile. The
client must not: once a replica serves again, a call reaches it (the backoff is made a
minute long here, so that a call made within its deadline can only succeed by connecting
afresh), and while every replica is down a call still fails fast."""
from __future__ import annotations

from collections.abc import Callable

import pytest

import metaserver.client as client_mod
from kvpool_harness.processes import MetaserverProcess
from metaserver.client import MetaClient
from metaserver.errors import InvalidArgument, Unavailable

MINUTE_MS = 60_000


def test_a_call_reaches_replicas_back_from_a_restart_despite_the_reconnect_backoff(
        metaserver_factory: Callable[..., MetaserverProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "_CHANNEL_OPTIONS", [
        ("grpc.initial_reconnect_backoff_ms", MINUTE_MS), ("grpc.min_reconnect_backoff_ms", MINUTE_MS),
        ("grpc.max_reconnect_backoff_ms", MINUTE_MS), ("grpc.use_local_subchannel_pool", 1)])
    replicas = [metaserver_factory(), metaserver_factory()]
    with MetaClient([m.address for m in replicas], timeout_s=5.0) as client:
        client.stats()
        for m in replicas:
            m.kill()
        with pytest.raises(Unavailable):  # down: fails (its channels now back off for a minute)
            client.query_prefix("ns", [b"x" * 32], timeout_s=0.5)
        for m in replicas:
            m.start()  # on the same port; returns once the replica is SERVING
        # Reaches a replica (which rejects the empty namespace) instead of Unavailable.
        with pytest.raises(InvalidArgument):
            client.query_prefix("", [b"x" * 32], timeout_s=5.0)
        assert client.stats().index.num_nodes == 0
        for m in replicas:  # down again: fresh channels are refused too, the call is Unavailable
            m.kill()
        with pytest.raises(Unavailable):
            client.query_prefix("ns", [b"x" * 32], timeout_s=0.5)
