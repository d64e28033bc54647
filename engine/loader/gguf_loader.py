"""GGUF loader: dequantize to fp32, undo llama.cpp's Q/K permutation, build the tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.loader.common import LoadedModel, ModelLoadError
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

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


def _field(reader, key: str, default=None):  # noqa: ANN001, ANN202
    f = reader.fields.get(key)
    if f is None:
        return default
    import gguf

    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        if len(f.types) > 1 and f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its RoPE; back to the HF (half-split) order."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: Path, with_weights: bool = True) -> LoadedModel:
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("reading GGUF needs the PyPI package gguf") from None
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path} (only llama)")
    p = "llama."
    n_head, n_kv = _field(reader, p + "attention.head_count"), _field(reader, p + "attention.head_count_kv")
    hidden = _field(reader, p + "embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors if with_weights else ():
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
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
        intermediate_size=_field(reader, p + "feed_forward_length"),
        num_layers=_field(reader, p + "block_count"),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=hidden // n_head,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=_field(reader, p + "context_length", 2048),
        tie_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", 1),
        eos_token_ids=(eos,),
    )
    tokenizer = Tokenizer.from_gguf(tokens, _field(reader, "tokenizer.ggml.merges"),
                                    _field(reader, "tokenizer.ggml.token_type"),
                                    _field(reader, "tokenizer.chat_template", ""), config.bos_token_id, eos)
    return LoadedModel(config, weights, tokenizer, str(path))
