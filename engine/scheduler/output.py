"""What one scheduling step decided (handed to the model runner)."""
from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
