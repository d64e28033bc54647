"""Which newly computed blocks the connector saves into the pool.

`write_through` saves every full block a node computes (the default: it is what lets a
request on another node pull a prefix the first time it comes back). `selective` saves a
block only from its second computation on this node (SGLang HiCache's
`write_through_selective` idea): a block computed once and never again costs no copy, no
pool slot and no publish, at the price of the first reuse being a recompute. The node
remembers the hashes it computed in a bounded LRU set (`save_seen_blocks`, ~100 bytes a
hash), so a reuse further back than that many blocks counts as a first computation.

Not thread-safe: the host's scheduler thread owns it (inside `PoolScheduler`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

POLICIES = ("write_through", "selective")


def check_policy(policy: str) -> None:
    """ValueError unless `policy` is one of POLICIES."""
    if policy not in POLICIES:
        raise ValueError(f"save_policy must be one of {', '.join(POLICIES)}, got {policy!r}")


class SavePolicy:
    def __init__(self, policy: str, seen_blocks: int) -> None:
        """ValueError for an unknown policy or a bad `seen_blocks`."""
        check_policy(policy)
        if seen_blocks < 1:
            raise ValueError(f"save_seen_blocks must be >= 1, got {seen_blocks}")
        self.policy = policy
        self._capacity = seen_blocks
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.skipped = 0  # blocks not saved because this node computed them for the first time (counter)

    def select(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Indexes of the blocks (just computed, chain order) to save."""
        if self.policy == "write_through":
            return list(range(len(block_hashes)))
        keep = []
        seen = self._seen
        for i, h in enumerate(block_hashes):
            if h in seen:
                seen.move_to_end(h)
                keep.append(i)
            else:
                seen[h] = None
                if len(seen) > self._capacity:
                    seen.popitem(last=False)
        self.skipped += len(block_hashes) - len(keep)
        return keep
