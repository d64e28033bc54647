"""The messages of one step: what the scheduler decided (to the model runner), what the
connector's worker side reports, and what the runner reports back (to the scheduler's
`update_from_output`). A module of its own, below both the scheduler and the connector
contract, so the two can name these types without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int       # tokens computed this step, from request.num_computed_tokens on (drafts included)
    draft_token_ids: tuple[int, ...] = ()   # speculative drafts: the last len() of those tokens
    draft_probs: Any = None                  # their proposal distributions [k, vocab], or None (deterministic)

    @property
    def samples(self) -> bool:
        """True if this step reaches the end of the known tokens (so a token is sampled)."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)   # request ids preempted this step
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # scheduled requests' blocks (with a connector)
    finished_req_ids: frozenset[str] = frozenset()        # ended since the last step: the runner forgets them
    kv_connector_metadata: Any = None    # the connector's KVConnectorMetadata for this step
    # With nothing to compute but loads in flight, the runner waits (on completion, not a
    # sleep) up to `load_wait_s` for the loads of these requests before it reports.
    loads_to_wait: frozenset[str] = frozenset()
    load_wait_s: float = 0.0


@dataclass
class KVConnectorOutput:
    """What the connector's worker side reports after a step (vLLM's `KVConnectorOutput`)."""

    finished_sending: set[str] = field(default_factory=set)   # requests whose blocks it no longer reads
    finished_recving: set[str] = field(default_factory=set)   # requests whose load finished
    invalid_block_ids: set[int] = field(default_factory=set)  # cache blocks whose load failed
    # (ours) the transfer params of requests in finished_sending, for their answers: a P/D
    # producer names the blocks only once they are in its pool (see KVConnectorBase_V1).
    kv_transfer_params: dict[str, dict] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # request id -> the tokens it emits this step, each with its top logprobs or None: one token,
    # or with speculative drafts the accepted ones and the target's next (1 .. drafts + 1)
    sampled: dict[str, list[tuple[int, dict[int, float] | None]]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None   # the worker side's report (with a connector)
