"""What the front lets through to the grammar engine: every bound a 400 naming the field, at its
exact limit, found before anything is built from the constraint; and through the server, a
constraint that crashes the compiler fails its own request only."""

from __future__ import annotations

import json

import httpx
import pytest
from hostile_constraints import COMPLETIONS, ISSUE_CASES, ref_chain
from servers import InProcessServer

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.openai.constraint_limits import (
    MAX_ALTERNATIVES,
    MAX_CONSTRAINT_BYTES,
    MAX_GRAMMAR_RULES,
    MAX_REPEAT_COUNT,
    MAX_SCHEMA_DEPTH,
    check_constraint,
)


def nested_objects(levels: int) -> dict:
    """An object schema `levels` objects deep (2 JSON levels each: the object, `properties`)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def any_of(num_branches: int) -> dict:
    return {"anyOf": [{"const": i} for i in range(num_branches)]}


def refused(constraint: StructuredOutputsParams) -> str:
    with pytest.raises(APIError) as info:
        check_constraint(constraint, "response_format")
    assert info.value.status_code == 400 and info.value.param == "response_format"
    return info.value.message


def test_size_is_bounded_for_every_kind() -> None:
    big = MAX_CONSTRAINT_BYTES + 1
    for constraint in (
        StructuredOutputsParams(json={"enum": ["x" * (big // 2), "y" * (big // 2)]}),
        StructuredOutputsParams(json=json.dumps({"enum": ["x" * big]})),
        StructuredOutputsParams(regex="a" * big),
        StructuredOutputsParams(grammar='start: "' + "a" * big + '"'),
        StructuredOutputsParams(choice=[f"{i:08d}" for i in range(big // 10)]),
    ):
        assert f"at most {MAX_CONSTRAINT_BYTES} bytes" in refused(constraint)
    check_constraint(StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_BYTES - 10)), "regex")


def test_a_2_8_million_entry_enum_is_refused_before_anything_is_built_from_it() -> None:
    schema = {"enum": [str(i) for i in range(2_800_000)]}  # the issue's 31 MB body
    assert "bytes" in refused(StructuredOutputsParams(json=schema))


def test_depth_counts_refs_followed() -> None:
    # 63 objects: 127 levels with the root; one more is over
    check_constraint(StructuredOutputsParams(json=nested_objects(63)), "response_format")
    assert f"deeper than {MAX_SCHEMA_DEPTH}" in refused(
        StructuredOutputsParams(json=nested_objects(64))
    )
    check_constraint(StructuredOutputsParams(json=ref_chain(30)), "response_format")
    for num_refs in (60, 1000):  # 1,000 crashed llguidance in the front before the sandbox
        message = refused(StructuredOutputsParams(json=ref_chain(num_refs)))
        assert "with its $refs followed" in message
    as_text = json.dumps(ref_chain(1000))
    assert "$refs" in refused(StructuredOutputsParams(json=as_text))


def test_a_recursive_schema_is_not_deep() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    check_constraint(StructuredOutputsParams(json=tree), "response_format")
    check_constraint(StructuredOutputsParams(json={"items": {"$ref": "#"}}), "response_format")


def test_branches_are_bounded_by_llguidances_row() -> None:
    check_constraint(StructuredOutputsParams(json=any_of(MAX_ALTERNATIVES)), "response_format")
    message = refused(StructuredOutputsParams(json={"items": any_of(MAX_ALTERNATIVES + 1)}))
    assert f"{MAX_ALTERNATIVES + 1} branches" in message
    enum = {"enum": list(range(50_000))}  # one lexeme: no row limit
    check_constraint(StructuredOutputsParams(json=enum), "response_format")
    check_constraint(StructuredOutputsParams(choice=[str(i) for i in range(50_000)]), "choice")


def test_grammar_rules_are_bounded() -> None:
    def chain(num_rules: int) -> str:
        rules = "\n".join(f'r{i}: "a" r{i + 1}' for i in range(num_rules - 2))
        return f'start: r0\n{rules}\nr{num_rules - 2}: "a"'

    check_constraint(StructuredOutputsParams(grammar=chain(MAX_GRAMMAR_RULES)), "grammar")
    message = refused(StructuredOutputsParams(grammar=chain(MAX_GRAMMAR_RULES + 1)))
    assert f"defines {MAX_GRAMMAR_RULES + 1} rules" in message
    gbnf = "\n".join(f'r{i} ::= "a"' for i in range(MAX_GRAMMAR_RULES + 1))
    assert "rules" in refused(StructuredOutputsParams(grammar=gbnf))


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(regex="a{1000000}"),
        StructuredOutputsParams(regex="x(ab){2,1000000}"),
        StructuredOutputsParams(json={"type": "string", "pattern": "^a{1000000}$"}),
        StructuredOutputsParams(grammar='start: "a" ~ 1000000'),
        StructuredOutputsParams(grammar="start: A\nA: /b{1000000}/"),
    ],
)
def test_repetition_counts_are_bounded(constraint: StructuredOutputsParams) -> None:
    assert "repeats 1000000 times" in refused(constraint)


def test_repetitions_up_to_the_bound_pass() -> None:
    check_constraint(StructuredOutputsParams(regex=f"a{{{MAX_REPEAT_COUNT}}}"), "regex")
    grammar = f'start: "a" ~ {MAX_REPEAT_COUNT} | /b{{1,{MAX_REPEAT_COUNT}}}/'
    check_constraint(StructuredOutputsParams(grammar=grammar), "grammar")
    # the whole text is read, string literals too: a `%json` schema's patterns are strings
    schema = json.dumps({"type": "string", "pattern": "a{1000000}"})
    assert "repeats" in refused(StructuredOutputsParams(grammar=f"start: %json {schema}"))


# ---- through the server ----


def post(server: InProcessServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def assert_400(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_issue_cases_are_400s_naming_their_field(server: InProcessServer) -> None:
    refused = [case for case in ISSUE_CASES if case.status == 400]
    assert {"tools", "response_format", "structured_outputs", "guided_grammar"} <= {
        case.param for case in refused
    }
    for case in refused:
        assert_400(post(server, case.path, case.body), case.param, case.words)


def test_2001_choices_hold_their_constraint(server: InProcessServer) -> None:
    choices = [f"c{i}" for i in range(2001)]
    body = {"prompt": "x", "max_tokens": 16, "guided_choice": choices, "n": 3, "seed": 1}
    response = post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text[:300]
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop" and choice["text"] in choices


def test_a_constraint_that_crashes_the_compiler_fails_only_its_request(
    server: InProcessServer,
) -> None:
    engines = server.engine_ids()
    crashing = "start: %json " + json.dumps(ref_chain(1000))  # a chain inside a grammar
    free = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
    response = post(server, COMPLETIONS, {**free, "guided_grammar": crashing})
    assert_400(response, "guided_grammar", "the grammar compiler crashed")
    ok = post(server, COMPLETIONS, {**free, "guided_regex": "[ab]{3}"})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 3
    assert post(server, COMPLETIONS, free).json()["usage"]["completion_tokens"] == 3
    assert server.engine_ids() == engines  # the same engine served them all
