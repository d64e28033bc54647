"""Attention over the paged KV cache: the CPU backend (C kernels, torch SDPA where they do not
apply) and Triton kernels."""
from engine.attention.metadata import AttentionMetadata, SeqSpan

__all__ = ["AttentionMetadata", "SeqSpan"]
