"""GGUF loader: dequantize to fp32, undo llama.cpp's Q/K permutation, build the tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.loader.common import LoadedModel, ModelLoadError
from engine.loader.gguf_file import GGUFError, GGUFFile
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def dequantize(data: np.ndarray, qtype) -> np.ndarray:  # noqa: ANN001  (gguf's GGMLQuantizationType)
    """`data` (as GGUFFile.data shapes it) as float32, the numbers of `gguf.quants.dequantize`:
    a block type's blocks in one call of the type's own `dequantize_blocks` (element by element
    the same arithmetic), where gguf's calls it on groups of 16 rows, many times slower."""
    import gguf

    kind = getattr(gguf.quants, qtype.name, None)
    if data.dtype != np.uint8 or kind is None or not hasattr(kind, "dequantize_blocks"):
        return gguf.quants.dequantize(data, qtype).astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    kind.init_grid()
    out = kind.dequantize_blocks(data.reshape(-1, size))
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * block).astype(np.float32, copy=False)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its RoPE; back to the HF (half-split) order."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: Path, with_weights: bool = True) -> LoadedModel:
    try:
        import gguf  # its tables of types (GGUFFile) and its dequantization
    except ImportError:
        raise ModelLoadError("reading GGUF needs the PyPI package gguf") from None
    try:
        reader = GGUFFile(path)
    except GGUFError as err:
        raise ModelLoadError(str(err)) from None
    fields = reader.fields
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path} (only llama)")
    p = "llama."
    n_head, n_kv = fields.get(p + "attention.head_count"), fields.get(p + "attention.head_count_kv")
    hidden = fields.get(p + "embedding_length")
    tokens = fields.get("tokenizer.ggml.tokens")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    weights: dict[str, torch.Tensor] = {}
    if with_weights:
        import torch  # with the weights only: a router (weights=False) runs without torch
    for t in reader.tensors if with_weights else ():
        w = dequantize(reader.data(t), gguf.GGMLQuantizationType(t.ggml_type))
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                continue
            key = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
            if rest == "attn_q.weight":
                w = unpermute_qk(w, n_head)
            elif rest == "attn_k.weight":
                w = unpermute_qk(w, n_kv)
        else:
            continue
        weights[key] = torch.from_numpy(np.ascontiguousarray(w))
    config = ModelConfig(
        name=path.stem.split(".")[0],
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=fields.get(p + "feed_forward_length"),
        num_layers=fields.get(p + "block_count"),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=hidden // n_head,
        rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
        rms_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=fields.get(p + "context_length", 2048),
        tie_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id", 1),
        eos_token_ids=(eos,),
    )
    tokenizer = Tokenizer.from_gguf(tokens, fields.get("tokenizer.ggml.merges"),
                                    fields.get("tokenizer.ggml.token_type"),
                                    fields.get("tokenizer.chat_template", ""), config.bos_token_id, eos)
    return LoadedModel(config, weights, tokenizer, str(path))
