"""N-gram prompt lookup: draft what followed the last time the recent tokens appeared.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, take the request's last n tokens
and find their most recent earlier occurrence in its own tokens (prompt and output) that is
followed by a whole draft (else the earliest); the tokens that followed it are the draft.
Editing and autocomplete repeat text already in the prompt, so these drafts are often right,
and cost no model.
"""

from __future__ import annotations

import numpy as np

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
        # Every earlier place of the last token: the only places an earlier n-gram can end.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = best_earlier_match(tokens, n, num_tokens, ends)
            if start >= 0:
                return tokens[start + n : start + n + num_tokens].tolist()
        return []

    def finish(self, request: Request) -> None:
        """Nothing kept per request."""

    def close(self) -> None:
        """Nothing to release."""


def best_earlier_match(
    tokens: np.ndarray, n: int, num_tokens: int, ends: np.ndarray | None = None
) -> int:
    """Where the last n tokens occurred before, or -1: the most recent occurrence with
    `num_tokens` known tokens after it, else the earliest (in a repeating run, the most recent
    occurrence is just behind the suffix and leaves too little to draft).

    `ends`: the earlier places of the last token (found if not given); each is checked
    backwards, one token at a time, so a lookup reads the context once, not once per n-gram.
    """
    last = len(tokens) - 1
    if ends is None:
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    ends = ends[ends >= n - 1]  # whole n-grams only
    for back in range(1, n):
        ends = ends[tokens[ends - back] == tokens[last - back]]
    if not len(ends):
        return -1
    starts = ends - (n - 1)
    with_room = starts[starts + n + num_tokens <= len(tokens)]
    return int(with_room[-1]) if len(with_room) else int(starts[0])
