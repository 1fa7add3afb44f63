"""N-gram (prompt-lookup) draft proposer for speculative decoding.

The drafts are the tokens that followed the most recent earlier occurrence of the sequence's last n
tokens (longest n first). The runner verifies them in the next step.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to num_speculative_tokens (and max_drafts) draft tokens; [] when nothing matches."""
        limit = self.num_speculative_tokens if max_drafts is None else min(max_drafts, self.num_speculative_tokens)
        if limit <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows that end before the last token, so a match is followed by at least one token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + limit].tolist()
        return []
