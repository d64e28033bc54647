"""Engine configuration: one frozen dataclass; the CLI flags of `kvpool serve/generate` map to it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_connector.config import KVTransferConfig
    from engine.spec_decode.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"            # packaged name, .gguf file or safetensors folder
    dtype: str = "float32"                 # float32 or bfloat16 (weights, activations, KV cache)
    block_size: int = 16                   # tokens per KV block
    kv_cache_bytes: int = 1 << 30          # memory for the paged KV cache
    max_num_batched_tokens: int = 2048     # token budget of one step
    max_num_seqs: int = 64                 # requests in one step
    long_prefill_token_threshold: int = 0  # > 0: at most this many prefill tokens of one request per step
    max_model_len: int = 0                 # 0 = the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "auto"                   # auto = cuda if available, else cpu
    attention_backend: str = "auto"        # auto = triton on cuda, torch on cpu (attention/cpu_backend.py)
    kernels: str = "auto"                  # CPU float32: auto (faster of C / oneDNN or torch per op here), c or onednn
    served_model_name: str = ""            # name in the API; default: the model's own name
    kv_transfer_config: KVTransferConfig | None = None  # a KV connector (--kv-connector); None = local cache only
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (--speculative-config); None = off

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        if self.kv_cache_bytes <= 0 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("kv_cache_bytes, max_num_batched_tokens and max_num_seqs must be positive")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.kernels not in ("auto", "c", "onednn"):
            raise ValueError(f"kernels must be auto, c or onednn, got {self.kernels!r}")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
