"""engine: a vLLM-v1-style inference engine (paged KV cache, prefix caching, continuous
batching, chunked prefill) that the KV connector plugs into."""
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import EngineError, LLMEngine
from engine.outputs import RequestOutput
from engine.request import RequestStatus, SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineError", "LLMEngine", "RequestOutput", "RequestStatus", "SamplingParams"]
