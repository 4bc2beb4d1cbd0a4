"""Suffix decoding: counted substrings, the most frequent continuation, its probability
threshold, the global cache of earlier outputs and its bound."""

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.request import Request
from nanoserve.spec_decode.suffix import GrowingSuffixTrie, SuffixProposer, SuffixTrie


def test_counts_every_substring_up_to_the_depth():
    trie = SuffixTrie(max_depth=3)
    trie.add([1, 2, 1, 2])
    assert trie.root.children[1].count == 2
    assert trie.root.children[1].children[2].count == 2
    assert trie.root.children[1].children[2].children[1].count == 1
    assert 2 not in trie.root.children[1].children[2].children[1].children  # depth 3 at most
    trie.add([1, 2, 1, 2], sign=-1)
    assert trie.root.children == {}


def test_a_growing_trie_equals_one_built_at_once():
    tokens = [5, 6, 5, 6, 7, 5, 6, 5]
    growing = GrowingSuffixTrie(max_depth=4)
    growing.extend(tokens[:3])
    growing.extend(tokens[3:])
    whole = SuffixTrie(max_depth=4)
    whole.add(tokens)

    def as_dict(node):
        return {t: (c.count, as_dict(c)) for t, c in node.children.items()}

    assert as_dict(growing.root) == as_dict(whole.root)


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
    assert proposer.global_trie.root.children.keys() == {20, 21}
    assert proposer.propose([finished_request("d", [10, 11], [])], [3]) == [[]]
    assert "b" in proposer.tries and "d" in proposer.tries
