"""Constraints → llguidance grammars, compiled in the worker (the grammar backend's matchers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.structured_output.grammars import closed_objects
from nanoserve.structured_output.manager import StructuredOutputManager


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StructuredOutputManager]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")
    manager = StructuredOutputManager(Path(checkpoint), 320, frozenset({258}))
    yield manager
    manager.shutdown()  # its probe processes end with it


def check_constraint(manager: StructuredOutputManager, constraint: StructuredOutputsParams):
    """The request's grammar, as the worker builds it (ValueError if it cannot be)."""
    return manager.compile(constraint).result(timeout=60)


VALID = [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "array", "items": {"enum": ["x", "y"]}}'),
    StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
    StructuredOutputsParams(choice=["yes", "no", 'é"\\n']),
    StructuredOutputsParams(grammar='start: "(" expr ")"\nexpr: "x" | "y"'),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),  # GBNF
    StructuredOutputsParams(json_object=True),
]


@pytest.mark.parametrize("constraint", VALID, ids=lambda c: c.kind)
def test_valid_constraints_compile(manager, constraint: StructuredOutputsParams) -> None:
    assert not check_constraint(manager, constraint).is_terminated


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputsParams(json={"type": "objectx"}), "Invalid type: objectx"),
        (StructuredOutputsParams(json="{not json"), "invalid structured output json"),
        (StructuredOutputsParams(json={"type": "string", "format": "odd"}), "format: odd"),
        (StructuredOutputsParams(regex="(["), "unclosed character class"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "unknown name"),
    ],
)
def test_invalid_constraints_say_what_is_wrong(
    manager, constraint: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_constraint(manager, constraint)


@pytest.mark.parametrize(
    "fields",
    [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False}, {"choice": []}, {"choice": [""]}],
)
def test_exactly_one_non_empty_constraint(fields: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


def test_the_constraint_crosses_the_wire() -> None:
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert decoded.structured_outputs is not None and decoded.structured_outputs.kind == "json"


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json={"$ref": "file:///etc/passwd"}),
        StructuredOutputsParams(json={"$ref": "http://127.0.0.1:1/schema.json"}),
        StructuredOutputsParams(grammar='%import /etc/passwd\nstart: "a"'),
    ],
    ids=["file-ref", "url-ref", "lark-import"],
)
def test_a_constraint_cannot_name_a_file_or_a_url(
    manager, constraint: StructuredOutputsParams
) -> None:
    with pytest.raises(ValueError, match="invalid structured output"):
        check_constraint(manager, constraint)


OBJECT_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("schema", "valid_prefix"),
    [
        (OBJECT_A, b'{"a": 1'),  # another key is refused, as vLLM's default engine does
        (json.dumps(OBJECT_A), b'{"a": 1'),  # the schema as text
        (OBJECT_A | {"additionalProperties": True}, b'{"a": 1, "b": 2}'),  # said: kept
        ({"type": "object"}, b'{"a": 1, "b": 2}'),  # names no properties: any object
    ],
    ids=["closed", "closed-text", "open-by-request", "any-object"],
)
def test_an_object_schema_allows_only_its_properties_unless_it_says_so(
    manager, schema, valid_prefix: bytes
) -> None:
    grammar = check_constraint(manager, StructuredOutputsParams(json=schema))
    assert grammar.count_valid(list(b'{"a": 1, "b": 2}')) == len(valid_prefix)


def test_closed_objects_closes_every_object_schema_and_leaves_data_alone() -> None:
    inner = {"type": "object", "properties": {"x": {"type": "string"}}}
    constant = {"properties": {"y": 1}}  # a value, not a schema
    schema = {
        "type": "object",
        "properties": {"inner": inner, "fixed": {"const": constant, "enum": [constant]}},
        "$defs": {"Item": inner},
        "items": [inner],  # `items` as a list (older drafts)
        "anyOf": [inner],
        "allOf": [inner],
        "not": inner,
    }
    closed = closed_objects(schema)
    shut = inner | {"additionalProperties": False}
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"] == shut
    assert closed["$defs"]["Item"] == shut and closed["items"] == [shut]
    assert closed["anyOf"] == [shut] and closed["not"] == shut
    assert closed["allOf"] == [inner]  # parts of an allOf stay open: closed, they could clash
    assert closed["properties"]["fixed"] == {"const": constant, "enum": [constant]}
    assert "additionalProperties" not in inner and "additionalProperties" not in schema  # a copy


def test_closed_objects_keeps_what_a_schema_says_of_other_properties() -> None:
    for rule in ({"additionalProperties": {"type": "integer"}}, {"unevaluatedProperties": True}):
        schema = OBJECT_A | rule
        assert closed_objects(schema) == schema
    nested = {"allOf": [{"properties": {"p": OBJECT_A}}]}  # inside an open part: closed
    assert closed_objects(nested)["allOf"][0]["properties"]["p"]["additionalProperties"] is False
