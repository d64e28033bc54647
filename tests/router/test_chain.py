"""The router's prompt hasher answers to the names the nodes answer to (the real tokenizer)."""
from __future__ import annotations

import json

from router.chain import PromptHasher


def test_the_served_alias_and_the_models_own_name_both_hash_and_other_names_do_not() -> None:
    hasher = PromptHasher("smollm2-135m", served_name="smollm2-135m")
    hasher.expect("float32", 16)
    body = {"prompt": list(range(100, 140)), "max_tokens": 1}
    chains = [hasher.chain(json.dumps({**body, "model": name}).encode(), chat=False)
              for name in ("smollm2-135m", "SmolLM2-135M-Instruct")]
    assert chains[0] is not None and chains[0] == chains[1] and len(chains[0].hashes) == 2
    assert hasher.chain(json.dumps({**body, "model": "gpt-17"}).encode(), chat=False) is None
