"""The grammar sandbox: a constraint that crashes llguidance, or compiles past the deadline, fails
its own probe and nothing else; llguidance's refusals on the first tokens are errors before any
generation; probes run side by side; no probe process outlives its sandbox."""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_constraints import ref_chain, rule_chain, slow_grammar
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.structured_output.manager import StructuredOutputManager
from nanoserve.structured_output.sandbox import GrammarSandbox
from nanoserve.text.tokenizer import load_tokenizer

VOCAB_SIZE, EOS = 320, 258


CRASHING = {
    "a $ref chain inside a Lark grammar": StructuredOutputsParams(
        grammar="start: %json " + json.dumps(ref_chain(1000))
    ),
    "3,000 chained rules": StructuredOutputsParams(grammar=rule_chain(3000)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3"))


@pytest.fixture(scope="module")
def tokenizer_json(checkpoint: Path) -> str:
    backend = copy.copy(load_tokenizer(checkpoint).backend_tokenizer)
    return backend.to_str()


@pytest.fixture
def sandbox(tokenizer_json: str) -> Iterator[GrammarSandbox]:
    sandbox = GrammarSandbox(tokenizer_json, VOCAB_SIZE, [EOS], timeout_s=60)
    yield sandbox
    sandbox.close()


def child_pids(sandbox: GrammarSandbox) -> list[int]:
    return [child.process.pid for child in sandbox._children]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("constraint", CRASHING.values(), ids=list(CRASHING))
def test_a_crashing_compile_fails_its_probe_and_the_next_one_runs(
    sandbox: GrammarSandbox, constraint: StructuredOutputsParams
) -> None:
    assert sandbox.probe(StructuredOutputsParams(regex="[ab]+"))  # a child is up
    [first_child] = child_pids(sandbox)
    with pytest.raises(ValueError, match=r"the grammar compiler crashed on it \(killed by SIG"):
        sandbox.probe(constraint)
    assert not is_running(first_child)  # the child that crashed is gone (and reaped)
    grammar = sandbox.probe(StructuredOutputsParams(choice=["yes", "no"]))
    assert "CHOICE" in grammar  # a new child compiled it
    assert child_pids(sandbox) != [first_child]


def test_a_compile_past_the_deadline_is_killed_and_refused(tokenizer_json: str) -> None:
    sandbox = GrammarSandbox(tokenizer_json, VOCAB_SIZE, [EOS], timeout_s=0.3)
    try:
        sandbox.probe(StructuredOutputsParams(regex="x"))  # started (a start has its own)
        [child] = child_pids(sandbox)
        with pytest.raises(ValueError, match=r"took longer than 0.3 s"):
            sandbox.probe(StructuredOutputsParams(grammar=slow_grammar()))  # ~3 s here
        assert not is_running(child)
        assert sandbox.probe(StructuredOutputsParams(regex="y"))
    finally:
        sandbox.close()


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        # every optional property adds parser items; llguidance refuses past 2,000 in a row
        (
            StructuredOutputsParams(
                json={"type": "object", "properties": {f"p{i}": {} for i in range(600)}}
            ),
            r"Current row has \d+ items; max is 2000",
        ),
        (StructuredOutputsParams(regex="a{999999}"), "too many expressions constructed"),
        (  # refused on the second token: the first row holds one item per choice of array
            StructuredOutputsParams(
                json={
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]}
                            for i in range(2001)
                        ]
                    },
                }
            ),
            r"Current row has \d+ items; max is 2000",
        ),
    ],
)
def test_refusals_on_the_first_tokens_are_errors_before_any_generation(
    sandbox: GrammarSandbox, constraint: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        sandbox.probe(constraint)
    assert "<state>" not in str(info.value)  # llguidance's parser dump is left out


def test_close_ends_every_probe_process(tokenizer_json: str) -> None:
    sandbox = GrammarSandbox(tokenizer_json, VOCAB_SIZE, [EOS])
    threads = [
        threading.Thread(target=sandbox.probe, args=(StructuredOutputsParams(regex=f"{i}+"),))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    pids = child_pids(sandbox)
    assert len(pids) == 2 and all(map(is_running, pids))
    sandbox.close()
    assert not any(map(is_running, pids))
    with pytest.raises(ValueError, match="shutting down"):
        sandbox.probe(StructuredOutputsParams(regex="x"))


def test_a_slow_compile_holds_one_thread_and_never_the_others(checkpoint: Path) -> None:
    manager = StructuredOutputManager(checkpoint, VOCAB_SIZE, frozenset({EOS}))
    try:
        warm = [manager.compile(StructuredOutputsParams(regex=f"w{i}")) for i in range(2)]
        for future in warm:
            future.result(timeout=60)  # both probe processes are up
        slow = manager.compile(StructuredOutputsParams(grammar=slow_grammar()))
        quick = [manager.compile(StructuredOutputsParams(regex=f"q{i}")) for i in range(3)]
        for future in quick:
            assert not future.result(timeout=60).is_terminated
        assert not slow.done()  # the three quick ones went by it
    finally:
        manager.shutdown()  # the slow probe's process is killed: its request fails
    with pytest.raises(ValueError):
        slow.result(timeout=60)


def test_a_crashing_constraint_fails_only_its_own_requests(checkpoint: Path) -> None:
    manager = StructuredOutputManager(checkpoint, VOCAB_SIZE, frozenset({EOS}))
    try:
        crashing = [manager.compile(c) for c in CRASHING.values()]
        fine = manager.compile(StructuredOutputsParams(choice=["red", "green"]))
        for future in crashing:
            with pytest.raises(ValueError, match="crashed"):
                future.result(timeout=60)
        grammar = fine.result(timeout=60)
        assert all(grammar.accept(byte) for byte in b"red") and grammar.is_terminated
        with pytest.raises(ValueError, match="crashed"):  # remembered: no second crash
            manager.compile(CRASHING["3,000 chained rules"]).result(timeout=1)
    finally:
        manager.shutdown()


def test_the_fronts_bounds_are_llguidances_own(sandbox: GrammarSandbox) -> None:
    """The front's limits (it never imports llguidance) against llguidance itself."""
    import llguidance

    from nanoserve.server.openai import constraint_limits as limits

    llguidance_limits = llguidance.LLParserLimits()
    assert llguidance_limits.max_items_in_row == limits.MAX_ALTERNATIVES
    assert llguidance_limits.initial_lexer_fuel - 1 == limits.MAX_REPEAT_COUNT

    def branches(num: int) -> StructuredOutputsParams:
        objects = [
            {"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]}
            for i in range(num)
        ]
        return StructuredOutputsParams(json={"anyOf": objects})

    assert sandbox.probe(branches(limits.MAX_ALTERNATIVES))  # the most the front lets through
    with pytest.raises(ValueError, match="max is 2000"):
        sandbox.probe(branches(limits.MAX_ALTERNATIVES + 1))
    # Branches that open with more items each (open objects whose one key is optional) are
    # refused sooner: by the probe, not the front.
    open_object = {"type": "object", "additionalProperties": True}
    optional = {"anyOf": [open_object | {"properties": {"k": {"const": i}}} for i in range(200)]}
    with pytest.raises(ValueError, match="max is 2000"):
        sandbox.probe(StructuredOutputsParams(json=optional))
    rules = StructuredOutputsParams(grammar=rule_chain(limits.MAX_GRAMMAR_RULES - 2))
    assert sandbox.probe(rules)  # as many chained rules as the front allows: no crash
    assert sandbox.probe(StructuredOutputsParams(json=ref_chain(limits.MAX_SCHEMA_DEPTH // 2)))
