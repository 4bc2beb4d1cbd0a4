"""A request's grammar state and the masks it gives, on the byte-level test tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.structured_output.manager import StructuredOutputManager, bias_from_bitmask

EOS = 258  # <|im_end|> of the byte tokenizer
VOCAB_SIZE = 320


class FakeRequest:
    def __init__(self, grammar) -> None:
        self.grammar = grammar


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StructuredOutputManager]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")
    manager = StructuredOutputManager(Path(checkpoint), VOCAB_SIZE, frozenset({EOS}))
    yield manager
    manager.shutdown()  # its probe processes end with it


def allowed_ids(manager: StructuredOutputManager, grammar) -> set[int]:
    future = manager.start_masks([FakeRequest(grammar)], [[]])
    assert future is not None
    bias = future.result(timeout=30).bias[0]
    return set(torch.isfinite(bias).nonzero().flatten().tolist())


def test_eos_is_allowed_only_when_the_grammar_is_complete(manager) -> None:
    grammar = manager.compile(StructuredOutputsParams(regex="ab+")).result(timeout=60)
    assert allowed_ids(manager, grammar) == {ord("a")}
    assert grammar.accept(ord("a")) and not grammar.is_complete
    assert allowed_ids(manager, grammar) == {ord("b")}  # no EOS yet: "a" is not a match
    assert grammar.accept(ord("b")) and grammar.is_complete and not grammar.is_terminated
    assert allowed_ids(manager, grammar) == {ord("b"), EOS}


def test_a_finished_choice_terminates_and_then_allows_only_eos(manager) -> None:
    grammar = manager.compile(StructuredOutputsParams(choice=["yes", "no"])).result(timeout=60)
    assert allowed_ids(manager, grammar) == {ord("y"), ord("n")}
    for byte in b"no":
        assert grammar.accept(byte)
    assert grammar.is_terminated
    assert allowed_ids(manager, grammar) == {EOS}
    assert not grammar.accept(ord("x")) and grammar.error  # a token the mask forbids


def test_speculative_hooks_check_a_draft_and_roll_back(manager) -> None:
    grammar = manager.compile(StructuredOutputsParams(choice=["abc"])).result(timeout=60)
    assert grammar.count_valid([ord("a"), ord("b"), ord("x")]) == 2
    for byte in b"ab":
        assert grammar.accept(byte)
    grammar.rollback(2)
    assert allowed_ids(manager, grammar) == {ord("a")}


def test_a_grammar_that_cannot_be_built_fails_its_future(manager) -> None:
    future = manager.compile(StructuredOutputsParams(regex="(["))
    with pytest.raises(ValueError, match="invalid structured output regex"):
        future.result(timeout=60)


def test_only_constrained_rows_get_masks(manager) -> None:
    grammar = manager.compile(StructuredOutputsParams(regex="x")).result(timeout=60)
    assert manager.start_masks([FakeRequest(None)], [[]]) is None
    requests = [FakeRequest(None), FakeRequest(grammar), FakeRequest(None)]
    future = manager.start_masks(requests, [[], [], []])
    assert future is not None and future.result(timeout=30).rows == [1]


def test_draft_rows_are_masked_at_the_state_after_the_drafts_before_them(manager) -> None:
    grammar = manager.compile(StructuredOutputsParams(regex="ab(c|d)e")).result(timeout=60)
    requests = [FakeRequest(None), FakeRequest(grammar)]
    # The free request drafts 2 tokens (rows 0-2); the constrained one drafts "ab" (rows 3-5).
    future = manager.start_masks(requests, [[7, 8], [ord("a"), ord("b")]])
    assert future is not None
    masks = future.result(timeout=30)
    assert masks.rows == [3, 4, 5]
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in masks.bias]
    assert allowed == [{ord("a")}, {ord("b")}, {ord("c"), ord("d")}]
    assert allowed_ids(manager, grammar) == {ord("a")}  # rolled back to where it was


def test_the_bitmask_becomes_a_bias_in_token_order() -> None:
    bitmask = np.zeros((2, 3), dtype=np.int32)  # [G=2, W=3]: 96 bits for 70 tokens
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[0, 2] = 1 << 1  # token 65
    bitmask[1, 0] = -(2**31)  # bit 31 is the sign bit: token 31
    bias = bias_from_bitmask(bitmask, 70)
    assert bias.shape == (2, 70) and bias.dtype == torch.float32
    assert torch.isfinite(bias[0]).nonzero().flatten().tolist() == [5, 65]
    assert torch.isfinite(bias[1]).nonzero().flatten().tolist() == [31]
    assert set(bias.unique().tolist()) == {0.0, float("-inf")}


def test_a_constraint_is_compiled_once_and_each_request_gets_its_own_matcher(manager) -> None:
    constraint = StructuredOutputsParams(choice=["ab", "cd"])
    builds = []
    original = manager._build
    manager._build = lambda c: builds.append(c) or original(c)  # type: ignore[method-assign]
    try:
        first, second = (manager.compile(constraint).result(timeout=60) for _ in range(2))
    finally:
        manager._build = original  # type: ignore[method-assign]
    assert len(builds) <= 1  # once, or not at all when an earlier test compiled the same
    assert first.matcher is not second.matcher
    assert first.accept(ord("a"))  # one request's tokens do not move the other's grammar
    assert allowed_ids(manager, second) == {ord("a"), ord("c")}
    assert allowed_ids(manager, first) == {ord("b")}


def test_a_failed_compile_is_remembered_and_fails_every_request(manager) -> None:
    for _ in range(2):
        future = manager.compile(StructuredOutputsParams(regex="(("))
        with pytest.raises(ValueError, match="invalid structured output regex"):
            future.result(timeout=60)
