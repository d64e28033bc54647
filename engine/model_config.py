"""The model's architecture, as the loaders read it (Llama family)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str                  # model id used in the layout fingerprint and /v1/models
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int          # longest context the model was trained for
    tie_embeddings: bool
    bos_token_id: int
    eos_token_ids: tuple[int, ...]

    def layout_fingerprint(self, dtype: str, block_size: int) -> str:
        """The namespace of this model's KV blocks in a given dtype and block size: equal
        fingerprints mean interchangeable blocks (the chain hashes start from it)."""
        return (f"{self.name}|{dtype}|bs{block_size}|L{self.num_layers}|kv{self.num_kv_heads}"
                f"|hd{self.head_dim}")

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError("head_dim * num_heads must equal hidden_size for this Llama implementation")
