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

The tries below are the method, in Python (~0.25 µs a node, 24 nodes a token). The proposer
makes its tries of `TrieKinds`: these, or a platform's with the same counts and drafts (the CPU
kernels' C++ tries, `platforms/cpu/suffix_tries.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from nanoserve.core.request import Request

ROOT = 0  # the empty substring's node
# Substring starts of finished outputs counted into the global trie per proposer call (each up
# to max_depth nodes: ~0.2 ms of Python at the default depth of 24).
GLOBAL_STARTS_PER_CALL = 32


class SuffixTrie:
    """Counts of every substring of at most `max_depth` tokens of the sequences added.

    A node is an index into two lists: its count, and its children ({token id: node}). Nodes
    are ints and hold only ints, so that Python's garbage collector does not track (and
    traverse, again and again) the hundreds of thousands of nodes a few long requests make.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts: list[int] = [0]  # [node]
        self.children: list[dict[int, int]] = [{}]  # [node]: {token id: child node}
        self.free_nodes: list[int] = []  # removed nodes, reused first

    def _new_node(self) -> int:
        """A node with count 0 and no children: a removed one if any, else a new one."""
        if self.free_nodes:
            node = self.free_nodes.pop()
            self.counts[node], self.children[node] = 0, {}
            return node
        self.counts.append(0)
        self.children.append({})
        return len(self.counts) - 1

    def add(
        self, token_ids: list[int], sign: int = 1, first: int = 0, end: int | None = None
    ) -> None:
        """Count (sign 1) or uncount (-1) every substring of a whole sequence (those starting
        at `first` .. `end` - 1 only: a sequence may be counted a part at a time)."""
        counts, children = self.counts, self.children
        for start in range(first, len(token_ids) if end is None else end):
            node = ROOT
            for token_id in token_ids[start : start + self.max_depth]:
                child = children[node].get(token_id)
                if child is None:
                    child = children[node][token_id] = self._new_node()
                counts[child] += sign
                if counts[child] == 0:  # no occurrence left below it either
                    del children[node][token_id]
                    self._free_subtree(child)
                    break
                node = child

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node] = {}
            self.free_nodes.append(node)

    def suffix_nodes(self, context: list[int]) -> Iterator[int]:
        """The node of each suffix of `context` the trie holds (of at most `max_depth` tokens),
        shortest first; a suffix it does not hold ends them (no longer one can match)."""
        context = context[-self.max_depth :]
        for match_len in range(1, len(context) + 1):
            node: int | None = ROOT
            for token_id in context[-match_len:]:
                node = self.children[node].get(token_id) if node is not None else None
            if node is None:
                return
            yield node

    def draft(
        self, context: list[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """The best draft over every match length of `context`'s suffix, and its score."""
        return self.best_draft(self.suffix_nodes(context), max_tokens, factor, min_prob)

    def best_draft(
        self, suffix_nodes: Iterable[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """Of the drafts after each matched suffix (`suffix_nodes`: of lengths 1, 2, ...), the
        best.

        Each matched suffix drafts its most frequent continuation; the score is the draft's
        expected number of accepted tokens (the sum of its running probabilities), and the
        highest wins (ties: the longer match; none scoring above 0: no draft).
        """
        nodes = list(suffix_nodes)
        # A draft scores at most its length: its match's limit, and the max_depth - m tokens
        # below a node m deep. Walks go highest bound first (ties: the longer match), so that
        # once a draft scores its bound (a copied passage's usual case) the rest are skipped.
        bounds = sorted(
            (
                (min(max_tokens, int(factor * match_len), self.max_depth - match_len), match_len)
                for match_len in range(1, len(nodes) + 1)
            ),
            reverse=True,
        )
        best: tuple[list[int], float] = ([], 0.0)
        best_len = 0
        for bound, match_len in bounds:
            if bound <= 0 or bound < best[1] or (bound == best[1] and match_len < best_len):
                break  # neither this walk nor any after it can win
            limit = min(max_tokens, int(factor * match_len))
            draft, score = self.follow_likeliest(nodes[match_len - 1], limit, min_prob)
            if score > best[1] or (score == best[1] > 0 and match_len > best_len):
                best, best_len = (draft, score), match_len
        return best

    def follow_likeliest(self, node: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Walk down the most frequent child while the running probability holds."""
        counts, draft = self.counts, list[int]()
        prob, score = 1.0, 0.0
        while len(draft) < limit and (children := self.children[node]):
            if len(children) == 1:  # a copied passage's usual case: no counts to compare
                ((token_id, child),) = children.items()
            else:
                token_id, child = max(children.items(), key=lambda item: counts[item[1]])
            prob *= counts[child] / counts[node]
            if prob < min_prob:
                break
            draft.append(token_id)
            score += prob
            node = child
        return draft, score


class GrowingSuffixTrie(SuffixTrie):
    """A request's own trie, extended token by token as its output grows.

    It keeps the nodes of its sequence's suffixes (`open_nodes`): extending counts one child
    of each, and drafting after its own sequence starts from them, with no walk from the root.
    """

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.open_nodes: list[int] = []  # suffixes of 1 .. max_depth - 1 tokens
        self.num_tokens = 0

    def extend(self, token_ids: list[int]) -> None:
        """Count the substrings that end at each new token.

        Suffixes go shortest first; once one followed by the token is new, so is every longer
        one (it ends with the shorter), so the rest are made without looking.
        """
        keep, counts, children = self.max_depth - 1, self.counts, self.children
        for token_id in token_ids:
            opened = []
            nodes = [ROOT, *self.open_nodes]
            for node in nodes:
                child = children[node].get(token_id)
                if child is None:
                    break
                counts[child] += 1
                opened.append(child)
            for node in nodes[len(opened) :]:  # new nodes (a growing trie frees none to reuse)
                children[node][token_id] = len(counts)
                opened.append(len(counts))
                counts.append(1)
                children.append({})
            self.open_nodes = opened[:keep]
            self.num_tokens += 1

    def draft_after_own(
        self, max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """`draft` with this trie's own sequence as the context (its suffixes' nodes are open;
        a suffix of max_depth tokens has no children to draft from).

        A suffix counted once occurs only at the end, where nothing follows it yet: no draft.
        A longer suffix occurs no more often than a shorter one, so those that occurred
        before are the shortest few (in fresh text, one or two of the 23).
        """
        nodes, counts = self.open_nodes, self.counts
        num_seen_before = len(nodes)
        while num_seen_before and counts[nodes[num_seen_before - 1]] < 2:
            num_seen_before -= 1
        return self.best_draft(nodes[:num_seen_before], max_tokens, factor, min_prob)


class OwnTrie(Protocol):
    """What the proposer asks of a request's own trie (`GrowingSuffixTrie`'s methods)."""

    @property
    def num_tokens(self) -> int: ...

    def extend(self, token_ids: list[int]) -> None: ...

    def draft_after_own(
        self, max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]: ...


class SharedTrie(Protocol):
    """What the proposer asks of the global trie of earlier outputs (`SuffixTrie`'s methods)."""

    def add(
        self, token_ids: list[int], sign: int = 1, first: int = 0, end: int | None = None
    ) -> None: ...

    def draft(
        self, context: list[int], max_tokens: int, factor: float, min_prob: float
    ) -> tuple[list[int], float]: ...


@dataclass(frozen=True)
class TrieKinds:
    """What the proposer makes its tries of, each given max_depth: the Python classes above,
    or a platform's with the same counts and drafts (the CPU kernels' C++ ones)."""

    own: Callable[[int], OwnTrie] = GrowingSuffixTrie
    shared: Callable[[int], SharedTrie] = SuffixTrie


@dataclass
class PendingCount:
    """A finished output still to be counted into (sign 1) or out of (-1) the global trie,
    from substring start `next_start` on."""

    token_ids: list[int]
    sign: int
    next_start: int = 0


class SuffixProposer:
    """Suffix decoding over each request's own tokens and earlier requests' outputs.

    A finished request's output is counted into the global trie (and the oldest cached one out)
    a part at a time, `GLOBAL_STARTS_PER_CALL` substring starts at each `propose` or `finish`:
    counting a long output at once is milliseconds of Python in the engine loop, a stall for
    every stream in the step that sees it finish. Where proposes are rare (a batch too large to
    draft for) `finish` also counts an eighth of what is pending, so it stays bounded.
    """

    can_peek = True  # a draft stops where its match's limit or likelihood does: its own peek

    def __init__(
        self,
        max_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_prob: float,
        kinds: TrieKinds = TrieKinds(),
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_prob = min_prob
        self.kinds = kinds
        self.tries: dict[str, OwnTrie] = {}  # running requests' own tries
        self.global_trie = kinds.shared(max_depth)
        self.cached_outputs: deque[list[int]] = deque()  # in the global trie, oldest first
        self.pending: deque[PendingCount] = deque()  # in order: an output's "in" before its "out"
        self.num_pending_starts = 0

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        self.count_pending(GLOBAL_STARTS_PER_CALL)
        return [
            self.propose_one(r.request_id, r.all_token_ids, n)
            for r, n in zip(requests, num_tokens, strict=True)
        ]

    def peek(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Its drafts: each as long as its match and its continuation's likelihood allow."""
        return self.propose(requests, num_tokens)

    def propose_one(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        """The best draft of at most `num_tokens` from the request's own trie or the global one."""
        trie = self.tries.get(request_id)
        if trie is None:
            trie = self.tries[request_id] = self.kinds.own(self.max_depth)
        trie.extend(token_ids[trie.num_tokens :])
        args = (num_tokens, self.max_spec_factor, self.min_prob)
        own, own_expected = trie.draft_after_own(*args)
        other, other_expected = self.global_trie.draft(token_ids[-self.max_depth :], *args)
        return own if own_expected >= other_expected else other

    def finish(self, request: Request) -> None:
        """Drop a finished request's trie; its output joins the global one (oldest leave)."""
        self.tries.pop(request.request_id, None)
        output_token_ids = request.output_token_ids
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        self.cached_outputs.append(list(output_token_ids))
        self._queue(PendingCount(self.cached_outputs[-1], 1))
        while len(self.cached_outputs) > self.max_cached_requests:
            self._queue(PendingCount(self.cached_outputs.popleft(), -1))
        self.count_pending(max(GLOBAL_STARTS_PER_CALL, self.num_pending_starts // 8))

    def _queue(self, part: PendingCount) -> None:
        self.pending.append(part)
        self.num_pending_starts += len(part.token_ids)

    def count_pending(self, max_starts: int) -> None:
        """Count the pending outputs' next `max_starts` substring starts (in order)."""
        while self.pending and max_starts > 0:
            part = self.pending[0]
            end = min(len(part.token_ids), part.next_start + max_starts)
            # (only the tokens these starts' substrings take: a C++ trie copies what it is given)
            window = part.token_ids[part.next_start : end + self.max_depth - 1]
            self.global_trie.add(window, part.sign, 0, end - part.next_start)
            max_starts -= end - part.next_start
            self.num_pending_starts -= end - part.next_start
            part.next_start = end
            if end == len(part.token_ids):
                self.pending.popleft()

    def close(self) -> None:
        """Nothing to release."""
