"""Tokenizer and chat template, built from what the model file ships (no hub access)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

_CONTROL = 3  # GGUF token_type of control tokens (<|im_start|>, ...)


class Tokenizer:
    def __init__(self, tk: _HFTokenizer, chat_template: str, bos_token_id: int, eos_token_id: int) -> None:
        self._tk = tk
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self._template = env.from_string(chat_template) if chat_template else None

    @staticmethod
    def _raise(message: str) -> None:
        raise ValueError(message)

    @classmethod
    def from_gguf(cls, tokens: list[str], merges: list[str], token_types: list[int], chat_template: str,
                  bos_token_id: int, eos_token_id: int) -> Tokenizer:
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
        tk = _HFTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                               for i, kind in enumerate(token_types) if kind == _CONTROL])
        return cls(tk, chat_template, bos_token_id, eos_token_id)

    @classmethod
    def from_folder(cls, folder: Path, bos_token_id: int, eos_token_id: int) -> Tokenizer:
        tk = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        template = ""
        cfg = folder / "tokenizer_config.json"
        if cfg.exists():
            template = json.loads(cfg.read_text()).get("chat_template") or ""
        return cls(tk, template, bos_token_id, eos_token_id)

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tk.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.token_text(self.bos_token_id),
                                     eos_token=self.token_text(self.eos_token_id))
