"""The data-parallel router: prefixes stay with the engine that computed them, load evens out."""

from __future__ import annotations

from nanoserve.client.prefix_router import PrefixRouter

BLOCK = 4
READY = [True, True]


def prompt(prefix: int, tail: int, num_blocks: int = 3) -> list[int]:
    return [prefix] * (num_blocks * BLOCK) + [tail, tail + 1]


def test_a_new_prompt_goes_to_the_least_loaded_engine():
    router = PrefixRouter(2, BLOCK)
    assert router.choose(prompt(1, 7), loads=[3, 1], ready=READY) == 1
    # Equally loaded engines take turns.
    turns = [router.choose(prompt(p, 7), loads=[0, 0], ready=READY) for p in range(4)]
    assert sorted(turns) == [0, 0, 1, 1] and turns[0] != turns[1]


def test_prompts_sharing_a_prefix_follow_the_engine_that_computed_it():
    router = PrefixRouter(2, BLOCK)
    router.record(prompt(1, 7), engine=1)
    router.record(prompt(2, 7), engine=0)
    assert router.choose(prompt(1, 50), loads=[0, 2], ready=READY) == 1
    assert router.choose(prompt(2, 50), loads=[2, 0], ready=READY) == 0
    # A shorter shared prefix still counts: only the first block is in common here.
    assert router.choose([1] * BLOCK + [9] * 8, loads=[0, 1], ready=READY) == 1


def test_the_longest_remembered_prefix_wins():
    router = PrefixRouter(2, BLOCK)
    router.record([5] * BLOCK, engine=0)
    router.record([5] * (3 * BLOCK), engine=1)
    assert router.choose([5] * (3 * BLOCK) + [1], loads=[0, 0], ready=READY) == 1


def test_an_overloaded_or_down_owner_loses_the_prompt():
    router = PrefixRouter(2, BLOCK, max_imbalance=4)
    router.record(prompt(1, 7), engine=1)
    assert router.choose(prompt(1, 8), loads=[0, 4], ready=READY) == 1
    assert router.choose(prompt(1, 8), loads=[0, 5], ready=READY) == 0
    assert router.choose(prompt(1, 8), loads=[9, 0], ready=[True, False]) == 0


def test_a_restarted_engine_holds_nothing_and_the_table_is_bounded():
    router = PrefixRouter(2, BLOCK, max_entries=5)
    router.record(prompt(1, 7), engine=1)
    router.forget_engine(1)
    assert router.choose(prompt(1, 8), loads=[1, 0], ready=READY) == 1  # by load, not owner
    assert router.choose(prompt(1, 8), loads=[0, 1], ready=READY) == 0
    for prefix in range(10):
        router.record(prompt(prefix, 0), engine=prefix % 2)
    assert len(router._owners) == 5
