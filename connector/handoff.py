"""Prefill/decode hand-off: the `kv_transfer_params` a producer answers with and a consumer
loads from (vLLM's P/D field, with our pool's locations in it).

    router -> prefill node     {"do_remote_decode": true}          (and max_tokens 1)
    prefill node -> router     {"do_remote_prefill": true, "do_remote_decode": false,
                                "remote_node_id": ID, "remote_session": "HOST:PORT",
                                "remote_buffer": ADDR, "remote_capacity": BYTES,
                                "remote_fingerprint": FP,
                                "remote_blocks": [[HASH_HEX, OFFSET, SIZE, GENERATION], ...]}
    router -> decode node      that dict, as the request's kv_transfer_params

The producer answers only once every listed block is in its pool (`PoolWorker`), so the
decode node reads them straight from those slots: no lookup in the index, no race with the
publish.

A vLLM producer cannot wait: vLLM sends the prefill response as the request finishes
(`request_finished` returns the params then), before its worker has put the blocks into the
pool. So a vLLM node answers vLLM's own fields (`remote_engine_id`, `remote_request_id`,
`remote_block_ids`, `remote_host`, `remote_port`: what vLLM's proxies expect to see and copy)
and names the blocks by count, not slot (`vllm_producer_params`):

    prefill vLLM -> proxy     {"do_remote_prefill": true, "do_remote_decode": false,
                               "remote_engine_id": NODE, "remote_request_id": ID,
                               "remote_block_ids": [...], "remote_host": null, "remote_port": null,
                               "kvpool_node_id": NODE, "kvpool_fingerprint": FP,
                               "kvpool_num_blocks": N}

and the decode node looks the prompt up in the index as usual, waiting (up to the
connector's `handoff_wait_s`) until the run it finds reaches those N blocks: the producer
publishes them a moment later. The blocks are the prompt's full blocks in chain order from block 0. A decode node
takes the leading blocks whose hashes equal its own chain for the request (same prompt,
salt and layout), and reads them like any pool hit: each read is validated (slot header,
generation, checksum), so a block the producer lost or overwrote meanwhile is recomputed,
never used.

The tail: the decode node computes only the prompt's last token (its logits start the
output), so it needs the KV of every prompt token before it, also those in the last,
partial block. The producer puts that block too (`kvpool_tail_tokens`: how many prompt
tokens it holds, 2 or more) under a hand-off-only hash (`tail_hash`: the layout, the
producer's request id, the chain before it and its tokens), listed after the full blocks
(by count: one more block). No prefix lookup asks for such a hash (prefix chains name full
blocks only), so it is never shared. A prompt that fills its last block exactly needs no
tail: the decode node uses all but one token of that full block (`consumer_tail`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from metaserver.types import BlockHash, BlockLocation, BlockRecord, Namespace, NodeId, NodeRecord


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The client asks this (producer) node to hand the prompt's KV to a decode node."""
    return bool(params) and params.get("do_remote_decode") is True


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The request's prompt KV was computed by a producer and is named in `params`."""
    return bool(params) and params.get("do_remote_prefill") is True


def tail_hash(fingerprint: str, request_id: str, parent: bytes | None, tokens: Sequence[int]) -> BlockHash:
    """The hand-off-only name of a prompt's last, partial block (module docstring): its
    layout, the producer's request, the chained hash of the block before it and its tokens."""
    h = hashlib.sha256(b"kvpool-handoff-tail\0")
    for part in (fingerprint.encode(), request_id.encode(), parent or b""):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return BlockHash(h.digest())


def producer_tail(num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens in the last block that a producer hands off as a tail (0: none; a tail of
    one token is the last token itself, which the decode node computes anyway)."""
    r = num_prompt_tokens % block_size
    return r if r >= 2 else 0


def consumer_tail(params: Mapping[str, Any], fingerprint: str, block_hashes: Sequence[bytes], num_tokens: int,
                  block_size: int, prompt_tokens: Sequence[int] | None) -> tuple[BlockHash, int] | None:
    """The hand-off block after the prompt's full blocks before its last token, and how many
    of its tokens the decode node loads; None when there is none to load. ValueError when the
    params are malformed."""
    end, k = divmod(num_tokens - 1, block_size)
    if k == 0:
        return None
    if num_tokens % block_size == 0:  # the last block is full: a chain block, all but its last token
        return (BlockHash(bytes(block_hashes[end])), k) if len(block_hashes) > end else None
    if "kvpool_tail_tokens" not in params or prompt_tokens is None:
        return None
    if _int(params, "kvpool_tail_tokens") != k + 1:
        return None  # another prompt length: not this request's block
    if end > len(block_hashes):
        return None
    producer = params.get("remote_request_id")
    if not isinstance(producer, str) or not producer:
        raise ValueError("kv_transfer_params.remote_request_id must be a non-empty string")
    parent = bytes(block_hashes[end - 1]) if end else None
    return tail_hash(fingerprint, producer, parent, prompt_tokens[end * block_size:num_tokens]), k


def producer_params(node: NodeRecord, records: Sequence[BlockRecord], request_id: str = "",
                    tail_tokens: int = 0) -> dict[str, Any]:
    """What the producer answers: where its pool holds each block of `records` (the last one
    the tail, with `tail_tokens`)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_node_id": node.node_id,
        "remote_session": node.session_address, "remote_buffer": node.buffer_address,
        "remote_capacity": node.capacity_bytes, "remote_fingerprint": node.namespace,
        "remote_blocks": [[r.block_hash.hex(), r.offset, r.size_bytes, r.generation] for r in records]}
    if tail_tokens:
        params.update(remote_request_id=request_id, kvpool_tail_tokens=tail_tokens)
    return params


def vllm_producer_params(node_id: str, request_id: str, block_ids: Sequence[int], num_blocks: int,
                         fingerprint: str, tail_tokens: int = 0) -> dict[str, Any]:
    """What a vLLM producer answers (see the module docstring): vLLM's fields, the count of
    full prompt blocks its worker puts into the pool and the tokens of the tail after them."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": node_id,
              "remote_request_id": request_id, "remote_block_ids": list(block_ids), "remote_host": None,
              "remote_port": None, "kvpool_node_id": node_id, "kvpool_fingerprint": fingerprint,
              "kvpool_num_blocks": num_blocks}
    if tail_tokens:
        params["kvpool_tail_tokens"] = tail_tokens
    return params


def names_blocks_by_count(params: Mapping[str, Any]) -> bool:
    """`params` come from a vLLM producer (`vllm_producer_params`): blocks by count, not slot."""
    return "kvpool_num_blocks" in params and "remote_blocks" not in params


def expected_blocks(params: Mapping[str, Any], fingerprint: str) -> int:
    """How many leading prompt blocks a vLLM producer put into the pool for this request (0
    when it holds another layout). ValueError (one line) when the params are malformed."""
    try:
        _str(params, "kvpool_node_id")
        n = _int(params, "kvpool_num_blocks")
        return n if _str(params, "kvpool_fingerprint") == fingerprint else 0
    except KeyError as err:
        raise ValueError(f"kv_transfer_params lack {err}") from None


def consumer_hit(params: Mapping[str, Any], fingerprint: str,
                 block_hashes: Sequence[bytes]) -> tuple[tuple[BlockLocation, ...], dict[NodeId, NodeRecord]]:
    """The locations of the request's leading blocks that `params` name (at most
    len(block_hashes)), and the producer's node record. An empty answer when the producer
    holds another layout or the chains differ from block 0. ValueError (one line) when the
    params are malformed."""
    try:
        node_id = NodeId(_str(params, "remote_node_id"))
        node = NodeRecord(node_id, _str(params, "remote_session"), _int(params, "remote_buffer"),
                          _int(params, "remote_capacity"), Namespace(_str(params, "remote_fingerprint")), 0, 0)
        blocks = params["remote_blocks"]
        if not isinstance(blocks, list):
            raise ValueError("remote_blocks must be a list")
        if node.namespace != fingerprint:
            return (), {}
        locations = []
        for i, entry in enumerate(blocks[:len(block_hashes)]):
            try:
                hash_hex, offset, size, generation = entry
                h = bytes.fromhex(hash_hex)
            except (TypeError, ValueError):
                raise ValueError(f"remote_blocks[{i}] must be [HASH_HEX, OFFSET, SIZE, GENERATION]") from None
            if h != block_hashes[i]:
                break  # another prompt (or salt) from here on: its KV is not this request's
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, size, generation)):
                raise ValueError(f"remote_blocks[{i}] has a bad offset, size or generation")
            locations.append(BlockLocation(BlockHash(h), node_id, offset, size, generation))
    except (KeyError, TypeError) as err:
        raise ValueError(f"kv_transfer_params lack or mistype {err}") from None
    return tuple(locations), {node_id: node}


def _str(params: Mapping[str, Any], key: str) -> str:
    v = params[key]
    if not isinstance(v, str) or not v:
        raise ValueError(f"kv_transfer_params.{key} must be a non-empty string")
    return v


def _int(params: Mapping[str, Any], key: str) -> int:
    v = params[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"kv_transfer_params.{key} must be a non-negative integer")
    return v
