"""Workloads of `kvpool bench cross-node` and the oracle they are judged against.

- `multi_turn`: U users in G groups, R rounds each. Every group shares a system prompt;
  each user may also have a context of their own (a pasted document, the earlier chat: the
  "user history" of LMCache's multi-round QA benchmark) that opens their conversation;
  round r's prompt is the conversation so far: system prompt, the user's context, then for each earlier round
  the user's message and the model's reply to it, then this round's message. The replies
  are the model's own output (greedy), so a round's prompt is known only once the previous
  round is answered: such requests `continue` their session and `Conversations` builds
  their prompts as the answers come in. (Or fixed synthetic replies of `reply_tokens`
  tokens, which the engine has never computed: every round recomputes the last reply.)
- `mooncake_trace`: a Mooncake-format JSONL trace. Each hash id becomes a fixed chunk of
  `tokens_per_hash_id` tokens (the same id, the same tokens), so the sharing structure is
  kept while prompts shrink to what a CPU model can serve; prompts are cut at a context
  limit; arrival times come from the trace's timestamps.
- The oracle: the prefix hit rate an infinite cache shared by every node reaches on the
  same requests in the same order, counted exactly as the engine counts its hits (chained
  block hashes; the last prompt token is always computed). The cache holds what the engine
  computed: each request's prompt and its output but the last token (never fed back).
  `bounded_oracles`: the same with a cache of a given number of blocks, under LRU and under
  Belady's MIN, so a report can say how much of a miss is capacity and how much policy.
- `unique_prompts`: prompts that share nothing (what the pool costs where it cannot help).
"""
from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import OrderedDict, deque
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.block_pool import chain_seed, hash_blocks

VOCAB_LO, VOCAB_HI = 100, 40000  # ordinary token ids of the model's vocabulary


@dataclass(frozen=True)
class BenchRequest:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    session: str = ""          # requests of one session run one after another, in order
    arrival_s: float = 0.0     # offset from the start (trace replay with time scaling)
    continues: bool = False    # the prompt is the session's previous prompt + the model's reply + `prompt`


class Conversations:
    """The full prompts of requests that continue a session, from the answers so far (the
    requests of one session run one after another)."""

    def __init__(self) -> None:
        self._history: dict[str, tuple[int, ...]] = {}

    def prompt(self, req: BenchRequest) -> tuple[int, ...]:
        if not req.continues:
            return req.prompt
        if req.session not in self._history:
            raise ValueError(f"{req.rid} continues session {req.session!r}, which has no answered request yet")
        return self._history[req.session] + req.prompt

    def answered(self, req: BenchRequest, prompt: tuple[int, ...], output: tuple[int, ...]) -> None:
        if req.session:
            self._history[req.session] = prompt + output


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n))


def multi_turn(users: int, rounds: int, groups: int, system_tokens: int, user_tokens: int, reply_tokens: int,
               output_tokens: int, seed: int = 0, context_tokens: int = 0) -> list[BenchRequest]:
    """Requests in round-major order (a session's rounds stay in order). `reply_tokens` 0:
    the model's replies (of `output_tokens` tokens) are the conversation's; else fixed
    synthetic replies of that many tokens. `context_tokens`: each user's own context, after
    the system prompt and before the first message."""
    if min(users, rounds, groups, output_tokens) < 1 or groups > users or reply_tokens < 0 or context_tokens < 0:
        raise ValueError("users, rounds, groups and output tokens must be >= 1, groups <= users, "
                         "and reply and context tokens >= 0")
    rng = random.Random(seed)
    systems = [_tokens(rng, system_tokens) for _ in range(groups)]
    history = {u: systems[u % groups] + _tokens(rng, context_tokens) for u in range(users)}
    out = []
    for r in range(rounds):
        for u in range(users):
            turn = _tokens(rng, user_tokens)
            if reply_tokens == 0 and r > 0:
                out.append(BenchRequest(f"u{u}-r{r}", turn, output_tokens, session=f"u{u}", continues=True))
                continue
            prompt = history[u] + turn
            out.append(BenchRequest(f"u{u}-r{r}", prompt, output_tokens, session=f"u{u}"))
            history[u] = prompt + _tokens(rng, reply_tokens)
    return out


def load_trace(path: str | Path, limit: int = 0, start: int = 0) -> list[dict]:
    """Rows `start` .. `start + limit` of a trace (limit 0 = to the end), arrival times
    shifted so that the window's first request arrives at 0."""
    if start < 0 or limit < 0:
        raise ValueError("the first request and the request limit must be >= 0")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if limit and i >= start + limit:
                break
            row = json.loads(line)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in row:
                    raise ValueError(f"{path}:{i + 1}: missing {key!r}")
            rows.append(row)
    if rows:
        t0 = rows[0]["timestamp"]
        rows = [{**row, "timestamp": row["timestamp"] - t0} for row in rows]
    return rows


def mooncake_trace(rows: list[dict], tokens_per_hash_id: int, max_prompt_tokens: int, max_output_tokens: int,
                   time_scale: float = 1.0, system_tokens: int = 0) -> list[BenchRequest]:
    """Scaled prompts of a Mooncake trace (see the module docstring). `system_tokens`: every
    prompt opens with the same that many tokens (a system prompt all conversations share,
    as in a chat service; the trace's own sharing follows it unchanged)."""
    if tokens_per_hash_id < 1 or max_prompt_tokens < 2 or not 0 <= system_tokens < max_prompt_tokens:
        raise ValueError("tokens_per_hash_id must be >= 1, max_prompt_tokens >= 2 and the trace's system tokens "
                         "in [0, max_prompt_tokens)")
    chunks: dict[int, tuple[int, ...]] = {}
    system = list(_tokens(random.Random("system"), system_tokens))
    out = []
    for i, row in enumerate(rows):
        prompt: list[int] = list(system)
        for h in row["hash_ids"]:
            if h not in chunks:
                chunks[h] = _tokens(random.Random(h), tokens_per_hash_id)
            prompt.extend(chunks[h])
            if len(prompt) >= max_prompt_tokens:
                break
        out.append(BenchRequest(f"t{i}", tuple(prompt[:max_prompt_tokens]),
                                max(1, min(int(row["output_length"]), max_output_tokens)),
                                arrival_s=row["timestamp"] / 1000.0 * time_scale))
    return out


def hash_id_oracle(rows: list[dict]) -> float:
    """Block-level hit rate of the trace's hash ids with an infinite cache."""
    seen: set[int] = set()
    hits = total = 0
    for row in rows:
        ids = row["hash_ids"]
        hits += sum(1 for h in ids if h in seen)
        total += len(ids)
        seen.update(ids)
    return hits / total if total else 0.0


def oracle_hits(requests: list[BenchRequest], block_size: int, fingerprint: str = "") -> list[int]:
    """Per request, the prompt tokens an infinite shared cache would hit (in list order),
    for requests whose prompts are known up front (counting their prompts only)."""
    return prefix_oracle([r.prompt for r in requests], [r.prompt for r in requests], block_size, fingerprint)


def prefix_oracle(prompts: Sequence[Sequence[int]], computed: Sequence[Sequence[int]], block_size: int,
                  fingerprint: str = "") -> list[int]:
    """Per prompt, the tokens an infinite shared cache would hit, where request i leaves the
    full blocks of `computed[i]` (its prompt and what it generated but the last token) behind."""
    seed = chain_seed(fingerprint, None)
    seen: set[bytes] = set()
    out = []
    for prompt, done in zip(prompts, computed, strict=True):
        hashes = hash_blocks(seed, prompt, block_size)
        limit = (len(prompt) - 1) // block_size
        n = 0
        while n < min(limit, len(hashes)) and hashes[n] in seen:
            n += 1
        out.append(n * block_size)
        seen.update(hash_blocks(seed, done, block_size))
    return out


def unique_prompts(n: int, min_tokens: int, max_tokens: int, max_output_tokens: int, seed: int) -> list[BenchRequest]:
    """`n` requests whose prompts share nothing (random tokens, lengths uniform in
    [min_tokens, max_tokens]): the workload where a pool cannot help, to show what it costs."""
    rng = random.Random(seed)
    return [BenchRequest(f"u{i}", _tokens(rng, rng.randint(min_tokens, max_tokens)), max_output_tokens)
            for i in range(n)]


def bounded_oracles(prompts: Sequence[Sequence[int]], computed: Sequence[Sequence[int]], block_size: int,
                    capacity_blocks: int, fingerprint: str = "") -> tuple[list[int], list[int]]:
    """Per prompt, the tokens a shared cache of `capacity_blocks` blocks would hit under LRU
    and under Belady's MIN (evict the block used furthest in the future), request i leaving
    the full blocks of `computed[i]` behind as `prefix_oracle` does."""
    seed = chain_seed(fingerprint, None)
    refs = [hash_blocks(seed, p, block_size)[:(len(p) - 1) // block_size] for p in prompts]
    puts = [hash_blocks(seed, d, block_size) for d in computed]
    return ([n * block_size for n in lru_hits(refs, puts, capacity_blocks)],
            [n * block_size for n in belady_hits(refs, puts, capacity_blocks)])


def fill_index(computed: Sequence[Sequence[int]], block_size: int, capacity_blocks: int, fingerprint: str = "") -> int:
    """The first request after which the distinct full blocks computed so far exceed
    `capacity_blocks` (the caches and pools are full from then on); len(computed) if never."""
    seed = chain_seed(fingerprint, None)
    seen: set[bytes] = set()
    for i, done in enumerate(computed):
        seen.update(hash_blocks(seed, done, block_size))
        if len(seen) > capacity_blocks:
            return i
    return len(computed)


def distinct_blocks(computed: Sequence[Sequence[int]], block_size: int, fingerprint: str = "") -> int:
    """Distinct full blocks (chain hashes) the requests computed: the workload's KV."""
    seed = chain_seed(fingerprint, None)
    return len({h for done in computed for h in hash_blocks(seed, done, block_size)})


def _prefix_in(cache: Container[object], ref: Sequence[object]) -> int:
    n = 0
    while n < len(ref) and ref[n] in cache:
        n += 1
    return n


def lru_hits(refs: Sequence[Sequence[Hashable]], puts: Sequence[Sequence[Hashable]], capacity: int) -> list[int]:
    """Blocks hit per request (the longest present prefix of `refs[i]`) by an LRU cache of
    `capacity` blocks; the hit blocks are used, then `puts[i]` are used or inserted."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    out = []
    for ref, put in zip(refs, puts, strict=True):
        n = _prefix_in(cache, ref)
        out.append(n)
        for h in itertools.chain(ref[:n], put):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return out


def belady_hits(refs: Sequence[Sequence[Hashable]], puts: Sequence[Sequence[Hashable]], capacity: int) -> list[int]:
    """As `lru_hits`, evicting instead the block whose next reference (by a later request's
    `refs`) is furthest away, never-referenced blocks first (Belady's MIN). With prefix
    lookups (a block counts only behind its whole prefix) it is the classic bound's rule, not
    a proven optimum; it is what "any policy" approaches with this much memory."""
    uses: dict[Hashable, deque[int]] = {}
    for i, ref in enumerate(refs):
        for h in dict.fromkeys(ref):
            uses.setdefault(h, deque()).append(i)
    never = len(refs)
    cache: dict[Hashable, int] = {}        # block -> its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tiebreak, block); stale entries skipped
    tiebreak = itertools.count()
    out = []
    for i, (ref, put) in enumerate(zip(refs, puts, strict=True)):
        n = _prefix_in(cache, ref)
        out.append(n)
        for h in dict.fromkeys(itertools.chain(ref[:n], put)):
            q = uses.get(h)
            while q and q[0] <= i:
                q.popleft()
            cache[h] = q[0] if q else never
            heapq.heappush(heap, (-cache[h], next(tiebreak), h))
        while len(cache) > capacity:
            neg, _, h = heapq.heappop(heap)
            if cache.get(h) == -neg:
                del cache[h]
    return out
