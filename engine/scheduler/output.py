"""What one scheduling step decided (handed to the model runner)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int       # tokens computed this step, from request.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """True if this step reaches the end of the known tokens (so a token is sampled)."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)   # request ids preempted this step
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # scheduled requests' blocks (with a connector)
    kv_connector_metadata: Any = None    # the connector's KVConnectorMetadata for this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
