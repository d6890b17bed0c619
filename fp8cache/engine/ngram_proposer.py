"""N-gram (prompt lookup) proposals: the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens, in its prompt or its output (vLLM's "ngram" method, TGI's --speculate).

Longer n-grams are tried first (prompt_lookup_max down to prompt_lookup_min). It runs every step for every
decoding sequence, so the search is a few vectorised comparisons over the token ids.

Back-off: a proposal whose first token is rejected costs a verify step for nothing. After such a miss a
sequence skips proposing for 1, 2, 4, ... steps (at most MAX_SKIP); any accepted token ends the back-off. On
text that never repeats its context this keeps the cost of speculation to a few verify steps in a hundred.
"""

from __future__ import annotations

import numpy as np

from fp8cache.engine.sequence import Sequence
from fp8cache.engine.speculative_config import SpeculativeConfig

MAX_SKIP = 32


def lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the last n tokens (n from max_n down)."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = length - n  # an occurrence starting in [0, length - n) ends before the suffix itself
        pattern = token_ids[-n:]
        match = token_ids[:starts] == pattern[0]
        for i in range(1, n):
            match &= token_ids[i:starts + i] == pattern[i]
        hits = np.flatnonzero(match)
        if hits.size:
            follow = int(hits[-1]) + n
            return token_ids[follow:follow + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most min(K, limit) draft tokens for seq's next positions ([] while it backs off)."""
        if seq.spec_skip > 0:
            seq.spec_skip -= 1
            return []
        k = min(self.config.num_speculative_tokens, limit)
        if k < 1:
            return []
        ids = np.asarray(seq.token_ids, dtype=np.int64)
        return lookup(ids, self.config.prompt_lookup_min, self.config.prompt_lookup_max, k)

    @staticmethod
    def observe(seq: Sequence, num_accepted: int) -> None:
        """Back off after a proposal whose first token was rejected; an accepted token resets it."""
        if num_accepted:
            seq.spec_misses = 0
            return
        seq.spec_skip = min(2 ** seq.spec_misses, MAX_SKIP)
        seq.spec_misses += 1
