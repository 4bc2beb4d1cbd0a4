"""The block pool: allocation order, sharing, LRU eviction and prefix lookup, exactly."""

import pytest

from nanoserve.common.prefix_hash import hash_block_tokens
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.kv_cache_manager import BlockPool, KVCacheManager
from nanoserve.core.request import Request


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4))


def test_allocate_takes_lowest_free_blocks_then_free_returns_them_to_the_tail():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free([1, 0])
    assert list(pool.free_queue) == [2, 3, 1, 0]
    assert pool.allocate(3) == [2, 3, 1]
    pool.check_invariants()


def test_allocate_more_than_free_raises():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)


def test_block_hash_chains_parent():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, [3, 4])


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    kv.allocate(first, 10, [])
    assert first.block_ids == [0, 1, 2]

    second = make_request("b", list(range(8)) + [99, 98])
    cached, num_cached = kv.find_cached_prefix(second)
    assert (cached, num_cached) == ([0, 1], 8)
    kv.allocate(second, 2, cached, num_cached)
    assert second.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]

    # A prompt that is exactly two cached blocks: its last token must still run.
    exact = make_request("c", list(range(8)))
    assert kv.find_cached_prefix(exact) == ([0], 4)
    kv.pool.check_invariants()


def test_freed_cached_blocks_stay_findable_until_evicted_lru_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old = make_request("old", [1, 2, 3, 4, 5])
    kv.allocate(old, 5, [])  # blocks 0, 1 full and cached; block 2 partial
    kv.free(old)
    # Freed in reverse: the partial block first, so the prefix's head is evicted last.
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]
    again = make_request("again", [1, 2, 3, 4, 9])
    assert kv.find_cached_prefix(again) == ([0, 1], 4)

    kv.allocate(make_request("x", [7, 7, 7]), 3, [])  # takes blocks 3 and 2
    assert kv.find_cached_prefix(again) == ([0, 1], 4)
    kv.allocate(make_request("y", [8]), 1, [])  # takes block 1: evicts the second block
    assert kv.find_cached_prefix(again) == ([0], 2)
    kv.pool.check_invariants()


def test_can_allocate_counts_reviving_free_cached_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    old = make_request("old", [1, 2, 3, 4])
    kv.allocate(old, 4, [])
    kv.free(old)
    new = make_request("new", [1, 2, 3, 4, 5, 6])
    cached, num_cached = kv.find_cached_prefix(new)
    assert num_cached == 4
    # 2 cached blocks leave the free queue and 1 new block is needed: 3 of 3.
    assert kv.can_allocate(new, 2, cached, num_cached)
    kv.allocate(new, 2, cached, num_cached)
    assert new.block_ids == [0, 1, 2]
    assert kv.num_free_blocks == 0


def test_prefix_caching_off_finds_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    first = make_request("a", [1, 2, 3])
    kv.allocate(first, 3, [])
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3])) == ([], 0)
    assert kv.pool.cached == {}


def test_a_kept_tail_shares_the_tokens_both_have_and_never_the_last_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    old = make_request("old", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate(old, 7, [])
    old.num_computed_tokens = 7  # block 0 full and cached; block 1 holds 5, 6, 7
    kv.free(old)
    assert kv.pool.tails == {hash_block_tokens(None, [1, 2, 3, 4]): 1}
    assert kv.find_cached_prefix(make_request("a", [1, 2, 3, 4, 5, 6, 9, 9])) == ([0, 1], 6)
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5, 6, 7])) == ([0, 1], 6)
    assert kv.find_cached_prefix(make_request("c", [1, 2, 3, 4, 8, 8])) == ([0], 4)
    assert kv.find_cached_prefix(make_request("d", [9, 2, 3, 4, 5, 6])) == ([], 0)
    kv.pool.check_invariants()


def test_a_tail_without_full_blocks_before_it_and_one_kept_per_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    for request_id, tokens in (("old", [1, 2]), ("newer", [1, 3, 3])):
        request = make_request(request_id, tokens)
        kv.allocate(request, len(tokens), [])
        request.num_computed_tokens = len(tokens)
        kv.free(request)
    assert list(kv.pool.tails) == [None] and kv.pool.blocks[1].tail == (None, (1, 3, 3))
    assert kv.pool.blocks[0].tail is None  # replaced by the newer one
    new = make_request("new", [1, 3, 5])
    cached, num_cached = kv.find_cached_prefix(new)
    assert (cached, num_cached) == ([1], 2)
    kv.allocate(new, 1, cached, num_cached)
    assert new.block_ids == [1] and kv.pool.tails == {}
    kv.pool.check_invariants()


def test_a_full_block_a_prompt_ended_in_is_a_tail_and_taking_it_over_evicts_its_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    old = make_request("old", [1, 2, 3, 4, 5, 6])
    kv.allocate(old, 6, [])
    for computed, generated in ((6, 7), (7, 8), (8, 9)):  # decode steps: the 2nd block fills
        old.append_output_token(generated)
        old.num_computed_tokens = computed
        if computed < 8:
            kv.allocate(old, 1, [])
    full_hash = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert kv.pool.cached[full_hash] == 1
    kv.free(old)
    assert kv.pool.tails == {hash_block_tokens(None, [1, 2, 3, 4]): 1}
    new = make_request("new", [1, 2, 3, 4, 5, 6, 10])
    cached, num_cached = kv.find_cached_prefix(new)
    assert (cached, num_cached) == ([0, 1], 6)
    kv.allocate(new, 1, cached, num_cached)
    assert full_hash not in kv.pool.cached and kv.pool.blocks[1].block_hash is None
    assert kv.pool.tails == {}
    kv.pool.check_invariants()
