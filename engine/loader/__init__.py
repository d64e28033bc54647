"""Model loaders: GGUF files and Hugging Face safetensors folders -> (config, weights, tokenizer)."""
from engine.loader.common import LoadedModel, ModelLoadError
from engine.loader.dispatch import load_model

__all__ = ["LoadedModel", "ModelLoadError", "load_model"]
