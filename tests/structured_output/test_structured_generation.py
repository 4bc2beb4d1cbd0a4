"""The engine under structured output: a random model's output always matches its constraint,
through sampling, batching and preemption, and grammars come and go with their requests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import Future

import jsonschema
import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import FinishReason
from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.core.engine import Engine
from nanoserve.engine_setup import build_engine

# Bounded strings and arrays: a random model must reach the end within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "n", "role", "tags"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,2}/'
REGEX = "[0-9]{3}-[a-z]{2,4}"
CHECKS = {
    "json": (
        StructuredOutputsParams(json=SCHEMA),
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: _match(REGEX, t)),
    "choice": (
        StructuredOutputsParams(choice=["red", "green"]),
        lambda t: _member(t, ["red", "green"]),
    ),
    "grammar": (
        StructuredOutputsParams(grammar=GRAMMAR),
        lambda t: _match(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", t),
    ),
}


def _match(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), text


def _member(text: str, choices: list[str]) -> None:
    assert text in choices, text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


_ENGINES: list[Engine] = []  # this test's engines, shut down when it ends


@pytest.fixture(autouse=True)
def _shut_down_engines() -> Iterator[None]:
    yield
    while _ENGINES:
        _ENGINES.pop().shutdown()  # their grammar threads and probe processes end with them


def make_engine(checkpoint, **overrides) -> Engine:
    args = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "max_model_len": 128}
    args.update(overrides)
    engine = build_engine(EngineConfig(**args))
    _ENGINES.append(engine)
    return engine


def run(engine: Engine, params: list[SamplingParams]) -> dict[str, tuple[list[int], object]]:
    """Every request to its end: request id -> (tokens, finish reason)."""
    results: dict[str, tuple[list[int], object]] = {}
    for i, p in enumerate(params):
        engine.add_request(str(i), [1, 2, 3, 4 + i], p)
        results[str(i)] = ([], None)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens, _ = results[delta.request_id]
            results[delta.request_id] = (tokens + delta.new_token_ids, delta.finish_reason)
    return results


def text_of(token_ids: list[int], eos: int = 258) -> str:
    return bytes(t for t in token_ids if t != eos).decode()


@pytest.mark.parametrize("kind", CHECKS)
def test_random_model_output_always_matches(checkpoint, kind: str) -> None:
    constraint, check = CHECKS[kind]
    engine = make_engine(checkpoint)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=100, structured_outputs=constraint)
        for seed in range(12)
    ] + [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=constraint)]
    for tokens, reason in run(engine, params).values():
        assert reason == FinishReason.STOP
        check(text_of(tokens))
    assert engine.stats().kv_cache_usage == 0.0


def test_constrained_and_free_requests_share_a_batch(checkpoint) -> None:
    constraint, check = CHECKS["regex"]
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    constrained = SamplingParams(seed=1, max_tokens=50, structured_outputs=constraint)
    results = run(make_engine(checkpoint), [free, constrained])
    check(text_of(results["1"][0]))
    alone = run(make_engine(checkpoint), [free])
    assert results["0"][0] == alone["0"][0]  # the mask touched its own row only


def test_preempted_requests_keep_their_grammar(checkpoint) -> None:
    constraint, check = CHECKS["json"]
    engine = make_engine(checkpoint, num_kv_blocks=8, max_num_seqs=8)
    params = [
        SamplingParams(seed=seed, max_tokens=100, structured_outputs=constraint)
        for seed in range(8)
    ]
    for tokens, reason in run(engine, params).values():
        assert reason == FinishReason.STOP
        check(text_of(tokens))
    assert engine.stats().num_preemptions_total > 0


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(checkpoint) -> None:
    params = SamplingParams(
        seed=0, max_tokens=50, ignore_eos=True, structured_outputs=CHECKS["choice"][0]
    )
    ((tokens, reason),) = run(make_engine(checkpoint), [params]).values()
    assert reason == FinishReason.STOP and text_of(tokens) in ("red", "green")


def test_abort_and_finish_drop_the_grammar(checkpoint) -> None:
    engine = make_engine(checkpoint)
    constraint = StructuredOutputsParams(regex="[a-z]{20}")
    engine.add_request("a", [1, 2], SamplingParams(seed=0, structured_outputs=constraint))
    engine.add_request(
        "b", [1, 3], SamplingParams(seed=1, max_tokens=3, structured_outputs=constraint)
    )
    a, b = engine.scheduler.requests["a"], engine.scheduler.requests["b"]
    while b.num_output_tokens < 3:
        engine.step()
    assert a.grammar is not None and b.grammar is None  # b finished at max_tokens
    engine.abort(["a"])
    assert a.grammar is None and a.grammar_future is None
    assert engine.stats().kv_cache_usage == 0.0


def test_a_grammar_that_fails_to_build_ends_its_request_with_the_reason(checkpoint) -> None:
    engine = make_engine(checkpoint)
    # The grammar is compiled once, here in the worker: a bad one ends its request with why.
    engine.add_request(
        "bad", [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(["))
    )
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in deltas] == [
        ("bad", [], FinishReason.ABORT)
    ]
    assert "invalid structured output regex" in (deltas[0].error or "")
    assert engine.stats().kv_cache_usage == 0.0


def test_a_request_whose_grammar_is_being_built_is_passed_over(checkpoint) -> None:
    engine = make_engine(checkpoint)
    slow: Future = Future()
    build = engine.grammars.compile
    engine.grammars.compile = lambda constraint: slow  # type: ignore[method-assign]
    engine.add_request(
        "slow", [1, 2], SamplingParams(seed=0, max_tokens=5, structured_outputs=CHECKS["choice"][0])
    )
    engine.add_request(
        "free", [1, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    finished = {
        d.request_id for _ in range(2) for d in engine.step() if d.finish_reason is not None
    }
    assert finished == {"free"}
    assert engine.scheduler.requests["slow"].num_computed_tokens == 0
    slow.set_result(build(CHECKS["choice"][0]).result(timeout=60))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert text_of([t for d in deltas for t in d.new_token_ids]) in ("red", "green")


def late_wide_row_schema() -> dict:
    """Refused by llguidance only once generation reaches the array (after a 40-character
    key, deeper than the probe's walk): its first row holds one item per anyOf branch."""
    branches = [
        {"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]}
        for i in range(2001)
    ]
    key = "x" * 40
    array = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    return {"type": "object", "properties": {key: array}, "required": [key]}


def test_a_grammar_refused_after_admission_ends_its_request_with_an_error(checkpoint) -> None:
    engine = make_engine(checkpoint)
    late = StructuredOutputsParams(json=late_wide_row_schema())
    engine.add_request("late", [1, 2], SamplingParams(seed=0, structured_outputs=late))
    engine.add_request("free", [1, 3], SamplingParams(seed=1, max_tokens=8, ignore_eos=True))
    deltas: dict[str, list] = {"late": [], "free": []}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    *_, last = deltas["late"]
    assert last.finish_reason == FinishReason.ABORT
    assert "Current row has" in (last.error or "") and "max is 2000" in (last.error or "")
    assert all(d.error is None for d in deltas["late"][:-1])  # output until then, then the error
    assert sum(len(d.new_token_ids) for d in deltas["free"]) == 8  # the other one ran on
    assert deltas["free"][-1].finish_reason == FinishReason.LENGTH
    assert engine.stats().kv_cache_usage == 0.0
