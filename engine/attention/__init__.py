"""Attention over the paged KV cache: a torch reference backend and Triton kernels."""
from engine.attention.metadata import AttentionMetadata, SeqSpan

__all__ = ["AttentionMetadata", "SeqSpan"]
