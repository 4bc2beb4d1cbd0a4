"""Suffix decoding: counted substrings, the most frequent continuation, its probability
threshold, the global cache of earlier outputs and its bound."""

import random

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.request import Request
from nanoserve.spec_decode.suffix import ROOT, GrowingSuffixTrie, SuffixProposer, SuffixTrie


def as_dict(trie: SuffixTrie, node: int = ROOT) -> dict:
    """{token: (count, its children as such a dict)} below `node`."""
    return {t: (trie.counts[c], as_dict(trie, c)) for t, c in trie.children[node].items()}


def test_counts_every_substring_up_to_the_depth():
    trie = SuffixTrie(max_depth=3)
    trie.add([1, 2, 1, 2])
    assert as_dict(trie) == {
        1: (2, {2: (2, {1: (1, {})})}),  # "1 2 1", and no "1 2 1 2": depth 3 at most
        2: (2, {1: (1, {2: (1, {})})}),
    }
    trie.add([1, 2, 1, 2], sign=-1)
    assert as_dict(trie) == {}
    assert sorted(trie.free_nodes) == list(range(1, 7))  # every node but the root, to reuse
    trie.add([3, 3])
    assert as_dict(trie) == {3: (2, {3: (1, {})})}
    assert len(trie.counts) == 7  # in nodes that were freed


def test_a_cached_sequence_removed_leaves_the_others_counts():
    trie = SuffixTrie(max_depth=4)
    trie.add([1, 2, 3])
    trie.add([1, 2, 4, 5])
    trie.add([1, 2, 4, 5], sign=-1)
    alone = SuffixTrie(max_depth=4)
    alone.add([1, 2, 3])
    assert as_dict(trie) == as_dict(alone)


def test_a_growing_trie_equals_one_built_at_once():
    tokens = [5, 6, 5, 6, 7, 5, 6, 5]
    growing = GrowingSuffixTrie(max_depth=4)
    growing.extend(tokens[:3])
    growing.extend(tokens[3:])
    whole = SuffixTrie(max_depth=4)
    whole.add(tokens)
    assert as_dict(growing) == as_dict(whole)


def test_a_growing_trie_drafts_from_its_open_nodes_what_a_walk_from_the_root_finds():
    rng = random.Random(0)
    for depth in (1, 2, 5, 24):
        trie = GrowingSuffixTrie(max_depth=depth)
        tokens: list[int] = []
        for _ in range(40):
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]  # repeats: long matches
            trie.extend(new)
            tokens += new
            for max_tokens, factor, min_prob in ((8, 1.0, 0.1), (3, 4.0, 0.0), (24, 0.5, 0.4)):
                walked = trie.draft(tokens, max_tokens, factor, min_prob)  # from the root
                assert trie.draft_after_own(max_tokens, factor, min_prob) == walked


def test_drafts_the_most_frequent_continuation_while_it_is_likely():
    trie = SuffixTrie(max_depth=8)
    for _ in range(3):
        trie.add([1, 2, 3, 4, 5])
    trie.add([1, 2, 9])
    draft, score = trie.draft([7, 1, 2], max_tokens=5, factor=4.0, min_prob=0.5)
    assert draft == [3, 4, 5]  # after "1 2": 3 three times, 9 once
    assert score == 0.75 * 3
    draft, _ = trie.draft([7, 1, 2], max_tokens=5, factor=4.0, min_prob=0.8)
    assert draft == []  # 3 follows "1 2" only 3 times in 4


def test_the_draft_is_at_most_factor_times_the_match():
    trie = SuffixTrie(max_depth=8)
    trie.add([1, 2, 3, 4, 5, 6])
    assert trie.draft([2], max_tokens=8, factor=2.0, min_prob=0.0)[0] == [3, 4]
    assert trie.draft([1, 2], max_tokens=8, factor=2.0, min_prob=0.0)[0] == [3, 4, 5, 6]
    assert trie.draft([1, 2], max_tokens=3, factor=2.0, min_prob=0.0)[0] == [3, 4, 5]


def finished_request(request_id: str, prompt: list[int], output: list[int]) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=8))
    for token_id in output:
        request.append_output_token(token_id)
    return request


def test_earlier_outputs_draft_for_new_requests_and_the_oldest_leave():
    proposer = SuffixProposer(8, max_cached_requests=1, max_spec_factor=4.0, min_prob=0.1)
    proposer.finish(finished_request("a", [0], [10, 11, 12, 13]))
    new = finished_request("b", [50, 10, 11], [])
    assert proposer.propose([new], [3]) == [[12, 13]]
    proposer.finish(finished_request("c", [0], [20, 21]))  # "a" leaves the global trie
    assert proposer.global_trie.children[ROOT].keys() == {20, 21}
    assert proposer.propose([finished_request("d", [10, 11], [])], [3]) == [[]]
    assert "b" in proposer.tries and "d" in proposer.tries


def test_long_outputs_join_the_global_trie_a_part_at_a_time_and_in_order():
    rng = random.Random(1)
    outputs = [[rng.randrange(50) for _ in range(n)] for n in (300, 200, 250)]
    proposer = SuffixProposer(8, max_cached_requests=2, max_spec_factor=1.0, min_prob=0.1)
    for index, output in enumerate(outputs):
        proposer.finish(finished_request(f"r{index}", [0], output))
    # The third output pushed the first out; nothing is counted in one go.
    assert 0 < proposer.num_pending_starts < sum(map(len, outputs)) + len(outputs[0])
    for _ in range(200):
        proposer.propose([], [])  # each call counts a few more
    assert proposer.num_pending_starts == 0 and not proposer.pending
    expected = SuffixTrie(max_depth=8)
    for output in outputs[1:]:
        expected.add(output)
    assert as_dict(proposer.global_trie) == as_dict(expected)


def test_without_proposals_the_pending_outputs_stay_bounded():
    proposer = SuffixProposer(8, max_cached_requests=1000, max_spec_factor=1.0, min_prob=0.1)
    for index in range(200):  # no `propose` between them: a batch too large to draft for
        proposer.finish(finished_request(f"r{index}", [0], list(range(index, index + 400))))
        assert proposer.num_pending_starts <= 8 * 400 + 400


def every_walk_draft(trie: SuffixTrie, context: list[int], max_tokens, factor, min_prob):
    """`draft` without skipping walks: every matched suffix's, the best score, the longer
    match on ties (the definition `best_draft` must keep)."""
    best: tuple[list[int], float] = ([], 0.0)
    for match_len, node in enumerate(trie.suffix_nodes(context), start=1):
        limit = min(max_tokens, int(factor * match_len))
        draft, score = trie.follow_likeliest(node, limit, min_prob)
        if score > 0 and score >= best[1]:
            best = (draft, score)
    return best


def test_skipping_walks_that_cannot_win_never_changes_the_draft():
    rng = random.Random(1)
    for depth in (3, 8, 24):
        trie = GrowingSuffixTrie(max_depth=depth)
        tokens: list[int] = []
        for _ in range(60):
            new = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
            trie.extend(new)
            tokens += new
            for max_tokens, factor, min_prob in ((24, 1.0, 0.1), (4, 3.0, 0.0), (9, 0.5, 0.3)):
                expected = every_walk_draft(trie, tokens, max_tokens, factor, min_prob)
                assert trie.draft_after_own(max_tokens, factor, min_prob) == expected
