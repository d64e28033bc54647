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


def test_a_kernel_tagged_layout_is_hashed_as_the_node_hashes_it() -> None:
    from engine.block_pool import chain_seed, hash_blocks
    from engine.kernel_tags import TAG_PREFIX

    hasher = PromptHasher("smollm2-135m", served_name="smollm2-135m")
    base = hasher.config.layout_fingerprint("float32", 16)
    body = json.dumps({"prompt": list(range(100, 140)), "max_tokens": 1, "model": "smollm2-135m"}).encode()
    assert hasher.expect("float32", 16) == base
    plain = hasher.chain(body, chat=False)
    tagged = base + TAG_PREFIX + "down,o"  # a CPU where oneDNN won two linears
    assert hasher.expect("float32", 16, tagged) == tagged
    chain = hasher.chain(body, chat=False)
    assert chain is not None and plain is not None and chain != plain
    assert list(chain.hashes) == list(hash_blocks(chain_seed(tagged, None), list(range(100, 140)), 16))
    both = base + "|isa:avx2" + TAG_PREFIX + "down,gate_up"  # an AVX2 CPU's class, then its oneDNN linears
    assert hasher.expect("float32", 16, both) == both
    assert hasher.expect("float32", 16, base + "|isa:avx2") == base + "|isa:avx2"
    # Anything else after the layout is not a kernel tag: the router keeps its own layout (and refuses the node).
    for odd in ("|bf16", TAG_PREFIX + "down|isa:avx2", "|isa:avx2|x", TAG_PREFIX, "x"):
        assert hasher.expect("float32", 16, base + odd) == base, odd
    assert hasher.expect("float32", 32, tagged) == hasher.config.layout_fingerprint("float32", 32)
