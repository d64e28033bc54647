"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        reqs = [self.engine.add_request(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for o in self.engine.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r.request_id] for r in reqs]

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages)
        return self.generate([self.tokenizer.encode(prompt)], params)[0]
