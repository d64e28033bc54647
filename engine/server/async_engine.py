"""Runs the engine loop in its own thread and hands outputs to asyncio callers.

Callers (HTTP handlers on the event loop) `submit()` a request and read its outputs from an
asyncio.Queue; the engine thread steps while there is work and sleeps otherwise. Only the
engine thread touches the engine; submissions and aborts cross over through a queue.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.llm_engine import EngineError, LLMEngine
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class _Submit:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: asyncio.Queue[RequestOutput | Exception]
    loop: asyncio.AbstractEventLoop
    kv_transfer_params: dict | None = None


class EngineHost:
    """A thread that builds the engine and later runs its loop (`AsyncEngine(..., host=)`).

    Why one thread for both: OpenMP (torch's and the C kernels') keeps a pool of worker threads
    per thread that starts parallel regions, and once a process holds more such threads than
    CPUs, libgomp cuts every worker's spin between regions to ~100 rounds: the workers sleep
    and each region pays a futex wake-up. An engine loaded on the main thread and stepped on
    another holds two pools, and a short prefill took markedly longer that way than on one
    thread (docs/journal/benchmarks-history.md, "The decode kernel in two passes, and the run's floor
    on this machine"). `torch.set_num_threads` is also per thread under OpenMP, so
    `--threads` only reaches the loop when the loop's thread applies it.

    `build` runs on the new thread; its result (None: it failed and said why) is `engine`,
    and an exception it raises is raised here."""

    def __init__(self, build: Callable[[], LLMEngine | None]) -> None:
        self._build = build
        self._loop: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=1)
        self._ready = threading.Event()
        self.engine: LLMEngine | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as err:  # handed to the constructor's caller
            self._error = err
        finally:
            self._ready.set()
        if self.engine is None:
            return
        run = self._loop.get()
        if run is not None:
            run()

    def run(self, loop: Callable[[], None]) -> None:
        """Run `loop` on the engine's thread (once)."""
        self._loop.put(loop)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics, max_in_flight: int = 0,
                 host: EngineHost | None = None) -> None:
        """`host`: the thread that built `engine` runs the loop (see EngineHost); else a new one."""
        self.engine = engine
        self.metrics = metrics
        self.max_in_flight = max_in_flight  # 0 = no admission limit
        self.in_flight = 0                   # admitted HTTP requests not answered yet (event-loop side)
        self.rejected = 0
        self._inbox: queue.Queue[_Submit | str | None] = queue.Queue()
        self._sinks: dict[str, _Submit] = {}
        self._host = host
        self._thread = host.thread if host else threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.dead: str | None = None

    def admit(self) -> bool:
        """Admission control, called on the event loop: False when the server is full."""
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            self.rejected += 1
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    def start(self) -> None:
        if self._host is not None:
            self._host.run(self._run)
        else:
            self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(30)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       cache_salt: str | None = None,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; raises EngineError if it is rejected. Leaving
        it before the last output (closed, or its reader cancelled) aborts the request in the
        engine, which frees its blocks."""
        sink: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._inbox.put(_Submit(request_id, prompt, params, cache_salt, sink, asyncio.get_running_loop(),
                                kv_transfer_params))
        try:
            while True:
                item = await sink.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._inbox.put(request_id)  # abort if still running (client went away); no-op otherwise

    def _deliver(self, sub: _Submit, item: RequestOutput | Exception) -> None:
        sub.loop.call_soon_threadsafe(sub.sink.put_nowait, item)

    def _drain_inbox(self, block: bool) -> bool:
        """Take in the submissions and aborts queued so far (waiting up to 50 ms for the first
        if `block`); False once `stop()` asked the loop to end. Engine thread only."""
        try:
            item = self._inbox.get(timeout=0.05 if block else 0)
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, str):
                if item in self._sinks:
                    log.info("%s: aborted (the client went away)", item)
                    self.engine.abort(item)
                    self._sinks.pop(item, None)
                    self.metrics.forget(item)  # no finished output will come to end its record
                    # The gauges are otherwise refreshed after a step, and an abort that
                    # leaves no work takes no step: /metrics would show it running forever.
                    self.metrics.on_step(self.engine)
            else:
                try:
                    self.engine.add_request(item.prompt, item.params, item.request_id, item.cache_salt,
                                            item.kv_transfer_params)
                    self._sinks[item.request_id] = item
                except EngineError as err:
                    self._deliver(item, err)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _run(self) -> None:
        try:
            while self._drain_inbox(block=not self.engine.has_unfinished()):
                if not self.engine.has_unfinished():
                    continue
                for out in self.engine.step():
                    sub = self._sinks.get(out.request_id)
                    if sub is None:
                        continue
                    self.metrics.on_output(out)
                    self._deliver(sub, out)
                    if out.finished:
                        del self._sinks[out.request_id]
                self.metrics.on_step(self.engine)
        except Exception as err:  # the loop must not die silently: fail everything in flight
            log.exception("engine loop crashed")
            self.dead = f"engine loop crashed: {err!r}"
            for sub in self._sinks.values():
                self._deliver(sub, EngineError(self.dead))
