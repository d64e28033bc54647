"""Hugging Face safetensors folder loader (config.json, *.safetensors, tokenizer.json)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.loader.common import LoadedModel, ModelLoadError
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # loaded with the weights only (safetensors.torch): a router runs without torch
    import torch


def load_safetensors(folder: Path, with_weights: bool = True) -> LoadedModel:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ModelLoadError("reading safetensors needs the PyPI package safetensors") from None
    cfg = json.loads((folder / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ModelLoadError(f"unsupported architecture {archs or cfg.get('model_type')} in {folder} (only Llama)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {folder}")
    if not (folder / "tokenizer.json").exists():
        raise ModelLoadError(f"no tokenizer.json in {folder}")
    weights: dict[str, torch.Tensor] = {}
    if with_weights:
        from safetensors.torch import load_file
    for f in files if with_weights else ():
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    names = set(weights)
    for f in () if with_weights else files:  # no weights wanted: the tensors' names from the headers
        with safe_open(str(f), "numpy") as st:
            names.update(st.keys())
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    config = ModelConfig(
        name=cfg.get("_name_or_path", "").rstrip("/").split("/")[-1] or folder.name,
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)), max_position=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", "lm_head.weight" not in names)),
        bos_token_id=cfg.get("bos_token_id", 1), eos_token_ids=eos_ids)
    if cfg.get("rope_scaling"):
        raise ModelLoadError(f"rope_scaling {cfg['rope_scaling']} is not supported yet")
    tokenizer = Tokenizer.from_folder(folder, config.bos_token_id, eos_ids[0])
    return LoadedModel(config, weights, tokenizer, str(folder))
