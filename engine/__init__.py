"""engine: a vLLM-v1-style inference engine (paged KV cache, prefix caching, continuous
batching, chunked prefill) that a KV connector plugs into through the contract in
`engine.kv_connector`. It imports no pool, metaserver or connector implementation.

The public names load on first use, so `kvpool_cli.serve` (the `kvpool serve` parser) does
not import torch."""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"EngineConfig": "engine.config", "LLM": "engine.llm", "EngineError": "engine.llm_engine",
           "LLMEngine": "engine.llm_engine", "RequestOutput": "engine.outputs", "RequestStatus": "engine.request",
           "SamplingParams": "engine.request"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:  # noqa: ANN401 - PEP 562 lazy attribute
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
