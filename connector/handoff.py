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
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from metaserver.types import BlockHash, BlockLocation, BlockRecord, Namespace, NodeId, NodeRecord


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The client asks this (producer) node to hand the prompt's KV to a decode node."""
    return bool(params) and params.get("do_remote_decode") is True


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The request's prompt KV was computed by a producer and is named in `params`."""
    return bool(params) and params.get("do_remote_prefill") is True


def producer_params(node: NodeRecord, records: Sequence[BlockRecord]) -> dict[str, Any]:
    """What the producer answers: where its pool holds each block of `records`."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_node_id": node.node_id,
            "remote_session": node.session_address, "remote_buffer": node.buffer_address,
            "remote_capacity": node.capacity_bytes, "remote_fingerprint": node.namespace,
            "remote_blocks": [[r.block_hash.hex(), r.offset, r.size_bytes, r.generation] for r in records]}


def vllm_producer_params(node_id: str, request_id: str, block_ids: Sequence[int], num_blocks: int,
                         fingerprint: str) -> dict[str, Any]:
    """What a vLLM producer answers (see the module docstring): vLLM's fields and the count
    of full prompt blocks its worker puts into the pool."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": node_id,
            "remote_request_id": request_id, "remote_block_ids": list(block_ids), "remote_host": None,
            "remote_port": None, "kvpool_node_id": node_id, "kvpool_fingerprint": fingerprint,
            "kvpool_num_blocks": num_blocks}


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
