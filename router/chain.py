"""A request's block-hash chain, computed exactly as the engine nodes compute it.

The router parses the body with the engine's own request parser (so a prompt, chat
messages and `cache_salt` mean what they mean on a node), applies the model's chat
template, tokenizes with the model's tokenizer, and chains SHA-256 block hashes from the
seed of the nodes' layout fingerprint and the request's salt (`engine.block_pool`). Equal
chains on the router and on a node are what makes the index's answer about this request.

Thread-safe (no mutable state after construction).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.block_pool import chain_seed, hash_blocks
from engine.kernel_tags import is_kernel_tag
from engine.loader import load_model
from engine.server.protocol import BadRequest, parse


@dataclass(frozen=True, slots=True)
class Chain:
    hashes: tuple[bytes, ...]   # the prompt's full blocks, chained from block 0
    num_tokens: int             # prompt tokens


class PromptHasher:
    def __init__(self, model: str, served_name: str = "") -> None:
        """Loads `model`'s config and tokenizer (no weights). `served_name`: the model name the
        nodes serve, if not the model's own (their `--served-model-name`, or `--model` as
        given); the nodes answer to the model's own name too, and so does the hasher."""
        loaded = load_model(model, weights=False)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = served_name or loaded.config.name
        self.model_names = list(dict.fromkeys((self.model_name, loaded.config.name)))
        self.fingerprint = ""
        self.block_size = 0

    def expect(self, dtype: str, block_size: int, reported: str = "") -> str:
        """Hash for nodes with this dtype and block size; returns the fingerprint they must report.
        `reported`: a node's own fingerprint. Where it is this layout's with kernel tags (the
        node's CPU class, the linears it runs on oneDNN: engine/kernel_choice.py, each another
        namespace of blocks), the hasher takes it, so that its chains are that node's."""
        self.block_size = block_size
        base = self.config.layout_fingerprint(dtype, block_size)
        tagged = reported.startswith(base) and is_kernel_tag(reported[len(base):])
        self.fingerprint = reported if tagged else base
        return self.fingerprint

    def prompt_ids(self, body: bytes, chat: bool) -> tuple[list[int], str | None] | None:
        """The prompt's token ids and cache salt, or None for a body the nodes would refuse
        (the chosen node then answers it with its own 400)."""
        try:
            parsed = parse(json.loads(body), chat, self.model_names, default_max_tokens=16)
            if chat:
                assert parsed.messages is not None
                ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(parsed.messages))
            else:
                assert parsed.prompt is not None
                ids = self.tokenizer.encode(parsed.prompt) if isinstance(parsed.prompt, str) else list(parsed.prompt)
        except (BadRequest, ValueError, UnicodeDecodeError):
            return None
        return ids, parsed.cache_salt

    def chain(self, body: bytes, chat: bool) -> Chain | None:
        """The body's chain (None: not parseable, or `expect` not called yet)."""
        if not self.block_size:
            return None
        got = self.prompt_ids(body, chat)
        if got is None:
            return None
        ids, salt = got
        seed = chain_seed(self.fingerprint, salt)
        return Chain(tuple(hash_blocks(seed, ids, self.block_size)), len(ids))
