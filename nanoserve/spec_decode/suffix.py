"""Suffix decoding (Snowflake's method, vLLM's `suffix`): drafts from counted continuations.

Every token sequence seen is indexed by a suffix trie: each node is a substring of at most
`max_depth` tokens, counted once per occurrence. Two tries serve a request: its own (its prompt
and output so far, grown one token at a time) and a global one of earlier requests' outputs
(the last `max_cached_requests` of them). To draft from a suffix of the request's tokens that
the trie holds, walk down the most frequent child while the product of the
children's shares (an estimate of the chance the draft is still right) stays at or above
`min_token_prob`; the draft may be as long as `max_spec_factor` times the matched length (and
`num_speculative_tokens`). Every match length is tried, and of all the drafts (both tries) the
one that expects the most accepted tokens wins.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.core.request import Request


@dataclass
class TrieNode:
    """One substring: how often it occurred, and the tokens seen after it."""

    count: int = 0
    children: dict[int, TrieNode] = field(default_factory=dict)


class SuffixTrie:
    """Counts of every substring of at most `max_depth` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = TrieNode()

    def add(self, token_ids: list[int], sign: int = 1) -> None:
        """Count (sign 1) or uncount (-1) every substring of a whole sequence."""
        for start in range(len(token_ids)):
            node = self.root
            for token_id in token_ids[start : start + self.max_depth]:
                child = node.children.setdefault(token_id, TrieNode())
                child.count += sign
                if child.count == 0:
                    del node.children[token_id]
                    break
                node = child

    def draft(
        self, context: list[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The best draft over every match length of `context`'s suffix, and its score.

        Each suffix of `context` found in the trie drafts its most frequent continuation; the
        score is the draft's expected number of accepted tokens (the sum of its running
        probabilities), and the highest wins (ties: the longer match).
        """
        best: tuple[list[int], float] = ([], 0.0)
        context = context[-self.max_depth :]
        for match_len in range(1, len(context) + 1):
            node: TrieNode | None = self.root
            for token_id in context[-match_len:]:
                node = node.children.get(token_id) if node is not None else None
            if node is None:
                break  # no longer suffix can match either
            limit = min(max_tokens, int(factor * match_len))
            draft, score = self._follow(node, limit, min_prob)
            if score >= best[1] and draft:
                best = (draft, score)
        return best

    @staticmethod
    def _follow(node: TrieNode, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Walk down the most frequent child while the running probability holds."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while node.children and len(draft) < limit:
            token_id, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            draft.append(token_id)
            score += prob
            node = child
        return draft, score


class GrowingSuffixTrie(SuffixTrie):
    """A request's own trie, extended token by token as its output grows."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.open_nodes: list[TrieNode] = []  # nodes of the suffixes shorter than max_depth
        self.num_tokens = 0

    def extend(self, token_ids: list[int]) -> None:
        """Count the substrings that end at each new token."""
        for token_id in token_ids:
            opened = []
            for node in [self.root, *self.open_nodes]:
                child = node.children.setdefault(token_id, TrieNode())
                child.count += 1
                opened.append(child)
            self.open_nodes = opened[: self.max_depth - 1]
            self.num_tokens += 1


class SuffixProposer:
    """Suffix decoding over each request's own tokens and earlier requests' outputs."""

    def __init__(
        self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_prob = min_prob
        self.tries: dict[str, GrowingSuffixTrie] = {}  # running requests' own tries
        self.global_trie = SuffixTrie(max_depth)
        self.cached_outputs: deque[list[int]] = deque()  # in the global trie, oldest first

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [
            self.propose_one(r.request_id, r.all_token_ids, n)
            for r, n in zip(requests, num_tokens, strict=True)
        ]

    def propose_one(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        """The best draft of at most `num_tokens` from the request's own trie or the global one."""
        trie = self.tries.setdefault(request_id, GrowingSuffixTrie(self.max_depth))
        trie.extend(token_ids[trie.num_tokens :])
        context = token_ids[-self.max_depth :]
        args = (num_tokens, self.max_spec_factor, self.min_prob)
        own, own_expected = trie.draft(context, *args)
        other, other_expected = self.global_trie.draft(context, *args)
        return own if own_expected >= other_expected else other

    def finish(self, request: Request) -> None:
        """Drop a finished request's trie; its output joins the global one (oldest leave)."""
        self.tries.pop(request.request_id, None)
        output_token_ids = request.output_token_ids
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        self.global_trie.add(output_token_ids)
        self.cached_outputs.append(list(output_token_ids))
        while len(self.cached_outputs) > self.max_cached_requests:
            self.global_trie.add(self.cached_outputs.popleft(), sign=-1)

    def close(self) -> None:
        """Nothing to release."""
