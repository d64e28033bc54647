"""The KV connector interface, shaped like vLLM's `KVConnectorBase_V1` (vLLM 0.32).

Where it sits: the engine's scheduler calls the scheduler side, its model runner the worker
side; an implementation (`connector/`) imports this module, the engine imports no
implementation (the factory loads one by name).

A connector has two halves, created separately with a role, as in vLLM:

Scheduler side (runs in the scheduler, decides):
    on_new_request(request)
        a request arrived (its block hashes are set): a connector may start its lookup now.
    get_num_new_matched_tokens(request, num_computed_tokens) -> (int | None, bool)
        tokens beyond the local prefix-cache hit that the connector can load, and whether
        they load asynchronously. May be called repeatedly; no side effects; None = "ask
        again later" (the request is skipped this step).
    update_state_after_alloc(request, blocks, num_external_tokens)
        the scheduler allocated blocks for those tokens; `blocks` is the request's whole block
        table (as in vLLM), the external tokens start after the local hit; remember where they go.
    build_connector_meta(scheduler_output) -> KVConnectorMetadata
        everything the worker side must do this step (a typed dataclass); resets the state.
    update_connector_output(connector_output)
        what the worker side reported back after the step.
    wait_for_lookups(timeout_s)          (ours) block until a lookup answers, bounded: the
        scheduler calls it when it has nothing to run but requests told "ask again later"
    request_finished(request, block_ids) -> (bool, dict | None)
        True = the connector still uses the blocks (the scheduler frees them only when
        `get_finished` reports the request in its sending set); plus kv_transfer_params.
        (ours) A request whose `kv_transfer_params` ask for a remote decode and whose blocks
        are held answers only when the send finished, with the params the worker side
        reports then (`get_kv_transfer_params`) if any, else these.

Worker side (runs next to the model and its KV cache, moves bytes):
    register_kv_caches(kv_caches)        the paged cache tensors, by name
    bind_connector_metadata(meta) / clear_connector_metadata()
    start_load_kv(forward_context)       start this step's loads (asynchronous)
    wait_for_layer_load(layer_name)      block until one layer's KV is in place
    save_kv_layer(layer_name, kv_layer, attn_metadata)
    wait_for_save()                      block until this step's saves are issued
    wait_for_loads(request_ids, timeout_s)   (ours) block until those loads finished, bounded
    get_finished(finished_req_ids) -> (sending, recving)   request ids done since the last call
    get_block_ids_with_load_errors() -> set[int]           block ids whose load failed
    get_kv_connector_stats() -> dict                       counters (vLLM returns KVConnectorStats)
    get_kv_transfer_params() -> dict[str, dict]            (ours) params of sends finished since the last call
    shutdown()

Class attribute `cache_header_bytes`: room the connector needs before each block's payload
in the engine's cache (the engine lays its cache out with it before the first step).
Failures to start or serve are raised as `KVConnectorError`.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.step import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from engine.kv_connector.config import KVTransferConfig
    from engine.request import Request
    from engine.step import SchedulerOutput


class KVConnectorError(Exception):
    """A connector could not start or serve (pool, transfer engine or metadata server
    unavailable). Implementations raise this type, with a one-line message for the user,
    so that the engine and its CLI never name a connector's own exceptions."""


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 - the base of every connector's typed metadata (as in vLLM)
    """What the scheduler side hands the worker side for one step."""


@dataclass(frozen=True)
class EngineContext:
    """What a connector learns about the engine it is plugged into (vLLM passes VllmConfig)."""

    fingerprint: str        # model/layout namespace of the KV blocks
    block_size: int         # tokens per block
    block_bytes: int        # payload bytes of one block (all layers, K and V)
    slot_bytes: int         # stride of blocks in the cache (header room + payload, aligned)
    header_bytes: int       # room before each block's payload in the cache


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    # Bytes of room before each block's payload in the engine's KV cache (a multiple of 64).
    cache_header_bytes: int = 0

    def __init__(self, config: KVTransferConfig, ctx: EngineContext, role: KVConnectorRole) -> None:
        self.config = config
        self.ctx = ctx
        self.role = role
        self._metadata: KVConnectorMetadata | None = None

    # ---- worker side ----------------------------------------------------------------

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "no connector metadata bound for this step"
        return self._metadata

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """The paged KV cache tensors, by name, before the first step."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def wait_for_loads(self, request_ids: frozenset[str], timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Block until the loads of `request_ids` started so far have finished (delivered or
        failed) or `timeout_s` passed, whichever is first; return at once if none is in flight.
        Lets the engine wait on completion instead of polling. Default: no wait."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Request ids whose asynchronous sends / receives finished since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (their KV must be recomputed)."""
        return set()

    def get_kv_transfer_params(self) -> dict[str, dict[str, Any]]:
        """(ours) kv_transfer_params of the requests whose send finished since the last call,
        by request id (reported with them in `finished_sending`). Default: none."""
        return {}

    def get_kv_connector_stats(self) -> dict[str, float]:
        """Counters for the engine's /stats and /metrics (names are the connector's)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, registrations, sessions). Idempotent."""

    # ---- scheduler side -------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:  # noqa: B027 - optional hook
        """A request arrived (block hashes computed); called once, before it is scheduled."""

    def wait_for_lookups(self, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Block until a lookup in flight answers or `timeout_s` passed. Default: no wait."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: list[int], num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027 - optional hook
        """What the worker side reported after a step."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request finished; True = keep its blocks until `get_finished` reports it sent."""
        return False, None
