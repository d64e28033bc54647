"""Requests and their sampling parameters, as the scheduler and the API see them."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks are being loaded by the connector
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None           # per-request generator; None = nondeterministic
    stop: tuple[str, ...] = ()        # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n logprobs per generated token (0 = only the chosen one)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or self.temperature > 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in 0..20, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    # The client's `kv_transfer_params` (vLLM's P/D field): {"do_remote_decode": true} asks a
    # producer to hand the prompt's KV to a decode node; a consumer gets {"do_remote_prefill":
    # true, ...} naming the blocks to load. The connector reads them; the engine only carries them.
    kv_transfer_params: dict | None = None
    kv_transfer_params_out: dict | None = None   # what the connector hands back (the answer's field)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0          # tokens whose KV is in the cache
    num_cached_tokens: int = -1           # local prefix-cache hit at first scheduling (-1: not yet)
    num_external_tokens: int = 0          # tokens loaded by the connector (its last load)
    # Of those, the prompt tokens loaded at its first admission: what its answer reports (a
    # preempted request may later reload its own blocks, generated tokens included).
    num_prompt_external_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks so far
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    output_text: str = ""
    # Speculative decoding: this step's draft tokens (and their distributions, for sampled
    # drafts), set by the speculator before scheduling; and the request's running totals.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished
