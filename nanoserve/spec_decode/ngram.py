"""N-gram prompt lookup: draft what followed the last time the recent tokens appeared.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, take the request's last n tokens
and find their most recent earlier occurrence in its own tokens (prompt and output); the tokens
that followed it are the draft. Editing and autocomplete repeat text already in the prompt, so
these drafts are often right, and cost no model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoserve.core.request import Request


class NgramProposer:
    """Prompt lookup over each request's own tokens (vLLM's `ngram` method)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [
            self.propose_one(r.all_token_ids, n) for r, n in zip(requests, num_tokens, strict=True)
        ]

    def propose_one(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest recent match of the suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = last_earlier_match(tokens, n)
            if start >= 0:
                return tokens[start + n : start + n + num_tokens].tolist()
        return []

    def finish(self, request: Request) -> None:
        """Nothing kept per request."""

    def close(self) -> None:
        """Nothing to release."""


def last_earlier_match(tokens: np.ndarray, n: int) -> int:
    """Where the last n tokens occurred before (the latest start), or -1."""
    suffix = tokens[-n:]
    windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]: every earlier n-gram
    (starts,) = np.nonzero((windows == suffix).all(axis=1))
    return int(starts[-1]) if len(starts) else -1
