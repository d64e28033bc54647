"""`--speculative-config`: vLLM's JSON form, e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 8}
`draft_model` is a self-draft here: the target's first `draft_num_layers` layers with its final
norm and LM head (early exit), sharing the target's paged KV cache (see `draft.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.json_flag import json_object

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4      # k: tokens proposed per request and step
    prompt_lookup_max: int = 4           # ngram: longest suffix matched
    prompt_lookup_min: int = 2           # ngram: shortest suffix matched
    draft_num_layers: int = 0            # draft_model: the target's first N layers (0 = a quarter of them)
    # Speculation pays only when the batch is small (a verify pass reads the weights once for
    # k + 1 tokens of every request) and proposals are accepted: no proposals while more than
    # this many requests decode, and none for a request whose recent acceptance is below
    # `min_acceptance` (it tries again after `backoff_steps` steps).
    disable_by_batch_size: int = 2       # measured: docs/BENCHMARKS.md "Speculative decoding"
    min_acceptance: float = 0.3
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.draft_num_layers < 0:
            raise ValueError(f"draft_num_layers must be >= 0, got {self.draft_num_layers}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.backoff_steps < 1:
            raise ValueError(f"backoff_steps must be >= 1, got {self.backoff_steps}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the JSON of `--speculative-config`; ValueError with a one-line message."""
        known = {f.name: f.type for f in fields(cls)}
        raw = json_object(text, "--speculative-config", known)
        for k, v in raw.items():
            want = {"str": str, "int": int, "float": (int, float)}[known[k]]
            if not isinstance(v, want) or isinstance(v, bool):
                raise ValueError(f"--speculative-config: {k} must be {known[k]}, got {v!r}")
        return cls(**raw)
