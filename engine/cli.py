"""`kvpool serve` and `kvpool generate`: engine flags map one to one to EngineConfig fields."""
from __future__ import annotations

import argparse
import logging
import sys

from kvpool.layout import parse_size

log = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="packaged model name, .gguf file or safetensors folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-bytes", default="1GiB", help="memory for the paged KV cache, e.g. 2GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=0, help="0 = the model's context length")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--served-model-name", default="")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-request-bytes", default="4MiB")
    g = sub.add_parser("generate", help="offline generation")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)


def engine_config(args: argparse.Namespace):  # noqa: ANN201
    from engine.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_bytes=parse_size(args.kv_cache_bytes),
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        enable_chunked_prefill=not args.no_chunked_prefill, device=args.device,
                        attention_backend=args.attention_backend, served_model_name=args.served_model_name)


def _build_engine(args: argparse.Namespace, prog: str):  # noqa: ANN202
    import torch

    from engine.llm_engine import LLMEngine
    from engine.loader import ModelLoadError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return LLMEngine(engine_config(args))
    except (ModelLoadError, ValueError) as err:
        print(f"kvpool {prog}: error: {err}", file=sys.stderr)
        return None


def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine.server.app import build_app

    engine = _build_engine(args, "serve")
    if engine is None:
        return 1
    app = build_app(engine, parse_size(args.max_request_bytes))
    log.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
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
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    for r in reqs:
        print(done[r.request_id].text)
    return 0
