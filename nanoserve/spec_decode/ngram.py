"""N-gram prompt lookup: draft what followed the last time the recent tokens appeared.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, take the request's last n tokens
and find their most recent earlier occurrence in its own tokens (prompt and output) that is
followed by a whole draft (else the earliest); the tokens that followed it are the draft.
Editing and autocomplete repeat text already in the prompt, so these drafts are often right,
and cost no model.

A lookup runs every step for every decoding request, so it must cost a small share of a step
(on a small model, a step is about a millisecond): each request's tokens are kept in a growing
array (a step appends its new tokens, not the whole context again), and the places where the
last 1, 2, ... n tokens occurred are narrowed in one pass, shortest first, stopping at the
first length that no earlier place matches.
"""

from __future__ import annotations

import numpy as np

from nanoserve.core.request import Request


class TokenArray:
    """A request's tokens as an int64 array, grown by what each step appended."""

    def __init__(self) -> None:
        self.buffer = np.empty(256, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array of `token_ids` (whose first `length` are already in it)."""
        if len(token_ids) < self.length:  # not the sequence it held: start over
            self.length = 0
        new = token_ids[self.length :]
        if self.length + len(new) > len(self.buffer):
            grown = np.empty(2 * (self.length + len(new)), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        self.buffer[self.length : self.length + len(new)] = new
        self.length += len(new)
        return self.buffer[: self.length]


class NgramProposer:
    """Prompt lookup over each request's own tokens (vLLM's `ngram` method)."""

    can_peek = True  # a match of the longest n-gram tried is one to be sure of

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.arrays: dict[str, TokenArray] = {}  # per running request

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return self._drafts(requests, num_tokens, self.min_n)

    def peek(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Drafts after matches of `max_n` tokens only: a request that repeats a passage
        matches its last max_n tokens; one that repeats nothing seldom does (short n-grams
        recur in any text)."""
        return self._drafts(requests, num_tokens, self.max_n)

    def _drafts(
        self, requests: list[Request], num_tokens: list[int], min_n: int
    ) -> list[list[int]]:
        """Each request's draft after its longest match of `min_n` tokens or more."""
        drafts = []
        for request, count in zip(requests, num_tokens, strict=True):
            array = self.arrays.get(request.request_id)
            if array is None:
                array = self.arrays[request.request_id] = TokenArray()
            drafts.append(self.draft(array.sync(request.all_token_ids), count, min_n))
        return drafts

    def draft(self, tokens: np.ndarray, num_tokens: int, min_n: int | None = None) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest recent match of the suffix (of
        at least `min_n` tokens, default the proposer's)."""
        min_n = self.min_n if min_n is None else min_n
        start, n = longest_earlier_match(tokens, min_n, self.max_n, num_tokens)
        if start < 0:
            return []
        return tokens[start + n : start + n + num_tokens].tolist()

    def finish(self, request: Request) -> None:
        """Drop the request's token array."""
        self.arrays.pop(request.request_id, None)

    def close(self) -> None:
        self.arrays.clear()


def longest_earlier_match(
    tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int
) -> tuple[int, int]:
    """(start, n) of the longest suffix, min_n <= n <= max_n, that occurred before: its most
    recent occurrence with `num_tokens` known tokens after it, else its earliest (in a
    repeating run, the most recent occurrence is just behind the suffix and leaves too little
    to draft); (-1, 0) if none.

    `ends` are the earlier places where the last n tokens end; each longer n keeps those whose
    token n back matches too, so the context is read once, not once per n.
    """
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [matches of the last token]
    best_ends, best_n = ends[:0], 0
    for n in range(1, min(max_n, last) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]  # whole n-grams only
            ends = ends[tokens[ends - (n - 1)] == tokens[last - (n - 1)]]
        if not len(ends):
            break
        if n >= min_n:
            best_ends, best_n = ends, n
    if not best_n:
        return -1, 0
    starts = best_ends - (best_n - 1)
    with_room = starts[starts + best_n + num_tokens <= len(tokens)]
    return (int(with_room[-1]) if len(with_room) else int(starts[0])), best_n
