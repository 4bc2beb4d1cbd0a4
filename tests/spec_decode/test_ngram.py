"""N-gram prompt lookup: the longest recent match of the suffix, its continuation."""

import random

import numpy as np

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.request import Request
from nanoserve.spec_decode.ngram import NgramProposer, TokenArray, longest_earlier_match


def drafted(proposer: NgramProposer, token_ids: list[int], num_tokens: int) -> list[int]:
    """The proposer's draft after `token_ids`."""
    return proposer.draft(np.asarray(token_ids, dtype=np.int64), num_tokens)


def test_the_most_recent_earlier_match_wins():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3])
    assert longest_earlier_match(tokens, 3, 3, 4) == (4, 3)
    assert drafted(NgramProposer(1, 3), tokens.tolist(), 4) == [8, 5, 1, 2]
    assert longest_earlier_match(tokens, 3, 3, 6) == (0, 3)  # only the first leaves room for 6


def test_longer_suffixes_are_tried_first():
    # "2 3" last occurred before 7, but "1 2 3" only before 4.
    tokens = [1, 2, 3, 4, 0, 2, 3, 7, 0, 1, 2, 3]
    assert drafted(NgramProposer(2, 3), tokens, 2) == [4, 0]
    assert drafted(NgramProposer(2, 2), tokens, 2) == [7, 0]  # "2 3": most recent first
    assert drafted(NgramProposer(1, 1), tokens, 1) == [7]


def test_no_match_shorter_than_the_minimum_drafts_nothing():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert drafted(NgramProposer(3, 4), tokens, 3) == []
    assert drafted(NgramProposer(2, 4), tokens, 3) == [3, 4, 5]
    assert drafted(NgramProposer(1, 4), [*tokens, 9], 3) == []


def test_the_draft_is_cut_at_the_known_tokens_and_the_limit():
    tokens = [4, 5, 6, 4, 5]
    assert drafted(NgramProposer(1, 2), tokens, 10) == [6, 4, 5]
    assert drafted(NgramProposer(1, 2), tokens, 1) == [6]
    assert drafted(NgramProposer(1, 2), [7], 3) == []


def test_a_peek_drafts_only_after_a_match_of_the_longest_n_tried():
    # The last 2 tokens (5 6) occurred before, the last 3 (4 5 6) did not: a draft, no peek.
    tokens = [5, 6, 7, 8, 9, 4, 5, 6]
    proposer = NgramProposer(2, 3)
    request = Request("r", tokens, SamplingParams(max_tokens=20))
    assert proposer.propose([request], [2]) == [[7, 8]]
    assert proposer.peek([request], [2]) == [[]]
    request.append_output_token(7)  # now "5 6 7" repeats a passage: a peek drafts
    assert proposer.peek([request], [2]) == [[8, 9]]


def test_a_repeating_run_drafts_a_whole_draft():
    tokens = [3, 9, 9, 9, 9, 9, 9]
    assert drafted(NgramProposer(2, 2), tokens, 3) == [9, 9, 9]


def earliest_or_latest_with_room(tokens: list[int], n: int, num_tokens: int) -> int:
    """best_earlier_match by its definition: every earlier n-gram compared with the suffix."""
    starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
    with_room = [s for s in starts if s + n + num_tokens <= len(tokens)]
    return with_room[-1] if with_room else starts[0] if starts else -1


def longest_by_definition(tokens: list[int], min_n: int, max_n: int, num_tokens: int):
    """longest_earlier_match by its definition: each n from max_n down, every n-gram compared."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        start = earliest_or_latest_with_room(tokens, n, num_tokens)
        if start >= 0:
            return start, n
    return -1, 0


def test_the_lookup_finds_what_comparing_every_earlier_n_gram_finds():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 40))]
        for min_n, max_n in ((1, 1), (1, 5), (2, 3), (3, 6), (4, 4)):
            for num_tokens in (1, 3, 8):
                expected = longest_by_definition(tokens, min_n, max_n, num_tokens)
                found = longest_earlier_match(np.array(tokens), min_n, max_n, num_tokens)
                assert found == expected


def test_a_request_s_tokens_are_appended_to_its_array_not_copied_again():
    array, rng = TokenArray(), random.Random(1)
    tokens = [rng.randrange(100) for _ in range(200)]
    first = array.sync(tokens)
    buffer = array.buffer
    for _ in range(50):  # step by step, within its room: the same buffer
        tokens.append(rng.randrange(100))
        assert array.sync(tokens).tolist() == tokens
    assert array.buffer is buffer and first.base is buffer
    tokens += [rng.randrange(100) for _ in range(1000)]  # past its room: grown, all kept
    assert array.sync(tokens).tolist() == tokens and len(array.buffer) >= len(tokens)
    assert array.sync(tokens[:10]).tolist() == tokens[:10]  # another sequence: started over


def test_the_proposer_keeps_an_array_per_running_request_and_drops_it_when_it_finishes():
    proposer = NgramProposer(2, 3)
    request = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=10))
    assert proposer.propose([request], [2]) == [[3, 4]]
    request.append_output_token(3)
    assert proposer.propose([request], [2]) == [[4, 1]]
    assert proposer.arrays["r"].length == 7
    proposer.finish(request)
    assert proposer.arrays == {}
