"""EngineHost: the server's engine is built on the thread that then runs its loop (one OpenMP
pool, `--threads` applied where the loop runs). Builders here are plain callables: what is
checked is which thread runs what, and how a failed build is reported."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.server.async_engine import EngineHost


def test_the_loop_runs_on_the_thread_that_built_the_engine() -> None:
    seen: dict[str, object] = {}

    def build() -> object:
        seen["build"] = threading.get_ident()
        torch.set_num_threads(1)           # per thread under OpenMP: must reach the loop's thread
        return object()

    host = EngineHost(build)               # type: ignore[arg-type]
    assert seen["build"] != threading.get_ident() and host.engine is not None
    done = threading.Event()

    def loop() -> None:
        seen["loop"], seen["threads"] = threading.get_ident(), torch.get_num_threads()
        done.set()

    host.run(loop)
    assert done.wait(10)
    host.thread.join(10)
    assert seen["loop"] == seen["build"] == host.thread.ident
    assert seen["threads"] == 1


def test_a_failed_build_is_reported_to_the_caller() -> None:
    def build() -> object:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineHost(build)                  # type: ignore[arg-type]
    host = EngineHost(lambda: None)        # the builder said why and returned None
    assert host.engine is None
    host.thread.join(10)
    assert not host.thread.is_alive()
