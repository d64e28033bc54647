"""`kvpool serve` and `kvpool generate`: engine flags map one to one to EngineConfig fields."""
from __future__ import annotations

import argparse
import logging
import sys

from kvpool.layout import parse_size
from kvpool_harness.engine_node import read_api_key

log = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="packaged model name, .gguf file or safetensors folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-bytes", default="1GiB", help="memory for the paged KV cache, e.g. 2GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="at most this many prefill tokens of one request per step (0 = no cap)")
    p.add_argument("--max-model-len", type=int, default=0, help="0 = the model's context length")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--kernels", default="auto", choices=["auto", "c", "onednn"],
                   help="CPU float32 kernels: auto = per op, the faster of our C kernel and its fallback on this "
                        "CPU (the linears against oneDNN; attention, norms, RoPE and SiLU against torch; timed once "
                        "per CPU model, cached in ~/.cache/kvpool/kernels.json); c / onednn = that kernel for every "
                        "linear and the C kernels for the rest (c still takes the rows per call timed for this CPU)")
    p.add_argument("--speculative-config", default="",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", '
                        '"draft_num_layers": 8} (a self-draft: the first layers of the model)')
    p.add_argument("--served-model-name", default="",
                   help="the model name in the API (default: --model as given); the model's own name is accepted too")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    k = p.add_argument_group("KV connector (the global pool)")
    k.add_argument("--kv-connector", default="", help="connector name, e.g. mooncake; unset = local prefix cache only")
    k.add_argument("--metaserver", default="", help="metaserver HOST:PORT[,HOST:PORT] (for --kv-connector mooncake)")
    k.add_argument("--pool-size", default="", help="this node's DRAM pool, e.g. 4GiB (default 1GiB)")
    k.add_argument("--pool-disk", default="",
                   help="directory of this node's disk tier under the DRAM pool (kept across restarts of the "
                        "same --node-id); off unless --pool-disk-size is set too")
    k.add_argument("--pool-disk-size", default="", help="size of the disk tier, e.g. 64GiB")
    k.add_argument("--node-id", default="", help="this node's stable id in the pool (default: host-pid)")
    k.add_argument("--kv-role", choices=("producer", "consumer", "both"), default="",
                   help="P/D role (vLLM's kv_producer / kv_consumer / kv_both): a producer saves what it computes "
                        "and hands prompts to decode nodes, a consumer loads and does not save; default both")
    k.add_argument("--kv-transfer-config", default="",
                   help='JSON as vLLM\'s flag: {"kv_connector": "mooncake", "kv_role": "kv_both", '
                        '"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}')


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--advertise-url", default="",
                   help="this server's URL as routers should reach it, announced in the pool's node registry "
                        "(default http://HOST:PORT; none when --host is a wildcard address)")
    s.add_argument("--max-request-bytes", default="4MiB", help="larger request bodies get HTTP 413")
    s.add_argument("--max-pending-requests", type=int, default=0,
                   help="answer HTTP 503 (overloaded) beyond this many requests in flight; 0 = no limit")
    s.add_argument("--api-key-file", default="",
                   help="file holding the API key the /v1/ routes require as `Authorization: Bearer <key>` "
                        "(or env KVPOOL_API_KEY; unset = open)")
    g = sub.add_parser("generate", help="offline generation")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)


def advertised_url(args: argparse.Namespace) -> str:
    """The URL `kvpool serve` announces in the node registry ("" for `generate`, or a
    wildcard --host with no --advertise-url: no address others could use)."""
    if getattr(args, "advertise_url", ""):
        return args.advertise_url
    host = getattr(args, "host", "")
    if not host or host in ("0.0.0.0", "::", "[::]"):
        return ""
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def kv_transfer_config(args: argparse.Namespace):  # noqa: ANN201
    """The connector settings from --kv-transfer-config and the shorthand flags (which win)."""
    from engine.kv_connector.config import KVTransferConfig

    if not (args.kv_connector or args.kv_transfer_config):
        if args.metaserver or args.pool_size or args.pool_disk or args.pool_disk_size or args.node_id or args.kv_role:
            raise ValueError("--metaserver, --pool-size, --pool-disk(-size), --node-id and --kv-role need "
                             "--kv-connector")
        return None
    base = KVTransferConfig.from_json(args.kv_transfer_config) if args.kv_transfer_config else None
    extra = dict(base.kv_connector_extra_config) if base else {}
    for key, value in (("metaserver", args.metaserver), ("pool_size", args.pool_size), ("node_id", args.node_id),
                       ("pool_disk", args.pool_disk), ("pool_disk_size", args.pool_disk_size)):
        if value:
            extra[key] = value
    # The connector's default id, fixed here so that /kv_layout can name it (a router maps the
    # index's node ids to URLs through it).
    from connector.settings import default_node_id

    extra.setdefault("node_id", default_node_id())
    url = advertised_url(args)
    if url:
        extra.setdefault("api_url", url)
    for key in ("pool_size", "pool_disk_size"):
        if key in extra:
            parse_size(extra[key])  # a bad size is a flag error, not a crash later
    fields = {"kv_role": base.kv_role, "kv_load_failure_policy": base.kv_load_failure_policy,
              "kv_load_timeout_s": base.kv_load_timeout_s, "kv_load_wait_s": base.kv_load_wait_s} if base else {}
    if args.kv_role:
        fields["kv_role"] = f"kv_{args.kv_role}"
    return KVTransferConfig(kv_connector=args.kv_connector or (base.kv_connector if base else ""),
                            kv_connector_extra_config=extra, **fields)


def engine_config(args: argparse.Namespace):  # noqa: ANN201
    from engine.config import EngineConfig
    from engine.spec_decode.config import SpeculativeConfig

    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_bytes=parse_size(args.kv_cache_bytes),
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        enable_chunked_prefill=not args.no_chunked_prefill, device=args.device,
                        attention_backend=args.attention_backend, kernels=args.kernels,
                        # as vLLM: the API serves the name the user started it with; the KV
                        # fingerprint keeps the model's own name (LLMEngine), not this alias
                        served_model_name=args.served_model_name or args.model,
                        kv_transfer_config=kv_transfer_config(args),
                        speculative_config=SpeculativeConfig.parse(args.speculative_config)
                        if args.speculative_config else None)


def _build_engine(args: argparse.Namespace, prog: str):  # noqa: ANN202
    import torch

    from engine.kv_connector import KVConnectorError
    from engine.llm_engine import LLMEngine
    from engine.loader import ModelLoadError
    from engine.native.build import KernelBuildError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = engine_config(args)
    except ValueError as err:
        print(f"kvpool {prog}: error: {err}", file=sys.stderr)
        return None
    try:
        return LLMEngine(config)
    # KernelBuildError: a $KVPOOL_KERNEL_ISA this CPU cannot run (a failed build only logs)
    except (ModelLoadError, ValueError, KVConnectorError, KernelBuildError) as err:
        print(f"kvpool {prog}: error: {err}", file=sys.stderr)
        return None


def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine.server.app import build_app
    from engine.server.async_engine import EngineHost

    try:
        api_key = read_api_key(args.api_key_file)
        max_request_bytes = parse_size(args.max_request_bytes)
        if args.max_pending_requests < 0:
            raise ValueError("--max-pending-requests must be >= 0")
    except (OSError, ValueError) as err:
        print(f"kvpool serve: error: {err}", file=sys.stderr)
        return 2
    host = EngineHost(lambda: _build_engine(args, "serve"))  # built on the thread that will step it
    engine = host.engine
    if engine is None:
        return 1
    app = build_app(engine, max_request_bytes, api_key, args.max_pending_requests, host)
    log.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    try:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts
        # its request in the engine (a non-streaming one would otherwise run to its end)
        web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True, handler_cancellation=True)
    except OSError as err:
        print(f"kvpool serve: error: {err}", file=sys.stderr)
        return 1
    return 0


def generate(args: argparse.Namespace) -> int:
    from engine.request import SamplingParams

    engine = _build_engine(args, "generate")
    if engine is None:
        return 1
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as err:
        print(f"kvpool generate: error: {err}", file=sys.stderr)
        return 2
    tk = engine.tokenizer
    prompts = [tk.encode(tk.apply_chat_template([{"role": "user", "content": p}])) if args.chat else p
               for p in args.prompt]
    from engine.llm_engine import EngineError

    try:
        reqs = [engine.add_request(p, params) for p in prompts]
    except EngineError as err:
        print(f"kvpool generate: error: {err}", file=sys.stderr)
        return 2
    done = {}
    try:
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
    finally:
        engine.close()
    for r in reqs:
        print(done[r.request_id].text)
    return 0
