"""Stop conditions, detokenization and the outputs the engine hands to callers."""
from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request, RequestStatus
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                     # generated so far
    text: str                                # generated text so far (stop string removed)
    finished: bool
    finish_reason: str | None                # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None
    logprobs: list[dict[int, float]] | None
    num_cached_tokens: int                   # prompt tokens hit in the local prefix cache
    num_external_tokens: int                 # prompt tokens loaded from the pool
    ttft_s: float | None                     # arrival -> first token
    error: str | None = None
    kv_transfer_params: dict | None = None   # the connector's, for the client (P/D: what a decode node loads)
    # speculative decoding: drafts proposed and accepted for this request, and the steps that verified some
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0


def check_stop(req: Request, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> RequestStatus | None:
    """Update the request's text; return the finished status if it must stop now."""
    p = req.sampling_params
    last = req.output_token_ids[-1]
    req.output_text = tokenizer.decode(req.output_token_ids)
    if not p.ignore_eos and last in eos_token_ids:
        req.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    if last in p.stop_token_ids:
        req.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    for s in p.stop:
        i = req.output_text.find(s)
        if i >= 0:
            req.output_text = req.output_text[:i]
            req.stop_reason = s
            return RequestStatus.FINISHED_STOPPED
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def stop_at_max_tokens(req: Request) -> RequestStatus | None:
    """The stop check without a tokenizer: only `max_tokens` (for a scheduler on its own)."""
    return RequestStatus.FINISHED_LENGTH if len(req.output_token_ids) >= req.sampling_params.max_tokens else None


def make_output(req: Request) -> RequestOutput:
    finished = req.is_finished
    return RequestOutput(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
        text=req.output_text, finished=finished, finish_reason=req.status.value if finished else None,
        stop_reason=req.stop_reason, logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None
        else None, num_cached_tokens=max(req.num_cached_tokens, 0), num_external_tokens=req.num_prompt_external_tokens,
        ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None, error=req.error,
        kv_transfer_params=req.kv_transfer_params_out if finished else None,
        spec_proposed_tokens=req.spec_proposed_tokens, spec_accepted_tokens=req.spec_accepted_tokens,
        spec_steps=req.spec_steps)
