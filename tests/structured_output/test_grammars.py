"""Constraints → llguidance grammars, compiled in the worker (the grammar backend's matchers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
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
