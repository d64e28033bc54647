"""Loaders: the GGUF model exported to a Hugging Face safetensors folder loads back and
generates the same tokens; missing or unsupported models give one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.loader import ModelLoadError, load_model
from engine.request import SamplingParams
from tests.engine.conftest import make_engine, run_all

ROOT = Path(__file__).resolve().parents[2]


def export_folder(loaded, folder: Path) -> None:  # noqa: ANN001
    c = loaded.config
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "exported/SmolLM2-135M-Instruct",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_embeddings, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_ids[0]}))
    loaded.tokenizer._tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": loaded.tokenizer.chat_template}))


def test_safetensors_folder_round_trip(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    folder = tmp_path / "smollm2-st"
    export_folder(loaded, folder)
    st = load_model(str(folder))
    assert st.config.num_kv_heads == 3 and st.config.tie_embeddings and st.config.name == "SmolLM2-135M-Instruct"
    assert torch.equal(st.weights["model.layers.3.self_attn.k_proj.weight"],
                       loaded.weights["model.layers.3.self_attn.k_proj.weight"])
    msgs = [{"role": "user", "content": "Name three colors."}]
    assert st.tokenizer.apply_chat_template(msgs) == loaded.tokenizer.apply_chat_template(msgs)
    prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(msgs))
    params = SamplingParams(max_tokens=12)
    a = run_all(make_engine(loaded, kv_cache_bytes=64 << 20), [prompt], params)[0]
    b = run_all(make_engine(st, kv_cache_bytes=64 << 20), [prompt], params)[0]
    assert a.token_ids == b.token_ids


def test_missing_and_unsupported_models(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(tmp_path / "bert"))
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="unsupported model"):
        load_model(str(tmp_path / "x.bin"))


def test_cli_reports_a_missing_model_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpool_cli", "generate", "--model", str(tmp_path / "none.gguf"),
                           "--prompt", "hi"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("kvpool generate: error: model") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_our_gguf_reader_reads_what_ggufs_own_reader_reads() -> None:
    """engine.loader.gguf_file against the gguf package's reader on the packaged model: every
    metadata field's value, and every tensor's name, type and data (bytes and shape)."""
    import gguf
    import numpy as np

    from engine.loader.common import resolve
    from engine.loader.gguf_file import GGUFFile

    path = resolve("smollm2-135m")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys and len(keys) > 20
    for k in keys:
        f = theirs.fields[k]
        if f.types[0] == gguf.GGUFValueType.STRING:
            want = bytes(f.parts[f.data[0]]).decode()
        elif f.types[0] == gguf.GGUFValueType.ARRAY and f.types[1] == gguf.GGUFValueType.STRING:
            want = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            want = [f.parts[i].tolist()[0] for i in f.data]
        else:
            want = f.parts[f.data[0]].tolist()[0]
        assert ours.fields[k] == want, k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        data = ours.data(a)
        assert a.ggml_type == b.tensor_type and data.shape == b.data.shape and data.dtype == b.data.dtype, a.name
        assert np.array_equal(data, b.data), a.name


def test_a_bad_or_cut_gguf_file_is_a_one_line_error(tmp_path: Path) -> None:
    from engine.loader.common import resolve

    whole = resolve("smollm2-135m").read_bytes()[:2 << 20]
    (tmp_path / "cut.gguf").write_bytes(whole[:100_000])       # inside the vocabulary
    with pytest.raises(ModelLoadError, match="truncated or corrupt metadata"):
        load_model(str(tmp_path / "cut.gguf"))
    (tmp_path / "other.gguf").write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "other.gguf"))
    (tmp_path / "v1.gguf").write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ModelLoadError, match="GGUF version 1"):
        load_model(str(tmp_path / "v1.gguf"))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "empty.gguf"))
    (tmp_path / "short.gguf").write_bytes(whole)                # the header whole, the weights cut
    with pytest.raises(ModelLoadError, match="ends past the end of the file"):
        load_model(str(tmp_path / "short.gguf"), weights=False)
