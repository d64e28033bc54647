"""`load_model`: resolve a model name or path and dispatch to the GGUF or safetensors loader."""
from __future__ import annotations

from engine.loader.common import LoadedModel, ModelLoadError, resolve


def load_model(model: str, weights: bool = True) -> LoadedModel:
    """`weights=False`: the config and tokenizer only (a router's need), weights left empty."""
    path = resolve(model)
    if path.is_file() and path.suffix == ".gguf":
        from engine.loader.gguf_loader import load_gguf  # each loader's imports load only when used

        return load_gguf(path, weights)
    if path.is_dir() and (path / "config.json").exists():
        from engine.loader.safetensors_loader import load_safetensors

        return load_safetensors(path, weights)
    raise ModelLoadError(f"unsupported model at {path}: expected a .gguf file or a folder with config.json")
