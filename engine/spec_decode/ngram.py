"""N-gram proposer (prompt lookup decoding): the request's own tokens predict its next ones.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: find the most recent earlier
occurrence of the last n tokens; propose the (up to) k tokens that followed it. Works where
the output copies from the context (edits, code, quoting, summaries with repeated names).
"""
from __future__ import annotations

import numpy as np

from engine.spec_decode.proposer import Proposal


class NgramProposer:
    prior_acceptance = 1.0   # a failed lookup costs a few verified tokens: give it two tries
    costly = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> Proposal | None:
        """Up to k tokens after the latest earlier match of the longest suffix that has one."""
        arr = np.asarray(tokens, dtype=np.int64)
        total = arr.shape[0]
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = arr[total - n:]
            # windows ending before the suffix itself: start positions 0 .. total - n - 1
            windows = np.lib.stride_tricks.sliding_window_view(arr[:total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                follow = arr[start:start + k].tolist()
                if follow:
                    return Proposal(follow)
        return None
