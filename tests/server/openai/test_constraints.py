"""Structured output over HTTP: response_format, structured_outputs and the guided_* names make a
random-weight model's output valid; a bad constraint is a 400 that names the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from servers import InProcessServer

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
# Nested objects, arrays, enums and required fields, with bounds a random model reaches.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "scores", "active"],
    "additionalProperties": False,
}


class Address(BaseModel):
    city: str = Field(max_length=5)
    country: Literal["FR", "DE", "JP"]


class Person(BaseModel):
    name: str = Field(max_length=6)
    role: Literal["admin", "user"]
    address: Address
    tags: list[bool] = Field(max_length=2)


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parse_with_a_pydantic_model_returns_the_object(client: openai.OpenAI, seed: int) -> None:
    completion = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Person, seed=seed, max_tokens=300
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed.role in ("admin", "user")


def test_a_nested_json_schema_validates_for_50_seeds(client: openai.OpenAI) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    # n = 50 with a seed: choice i samples with seed 7 + i.
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=response_format,
        n=50, seed=7, temperature=1.0, max_tokens=300,
    )  # fmt: skip
    assert len(completion.choices) == 50
    texts = set()
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
        texts.add(choice.message.content)
    assert len(texts) > 40  # the seeds really sampled different outputs


def test_json_object_gives_a_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
        n=20, seed=0, max_tokens=400,
    )  # fmt: skip
    # An unbounded object can outlast max_tokens; every one that ended is a JSON object.
    ended = [c.message.content for c in completion.choices if c.finish_reason == "stop"]
    assert len(ended) >= 3
    assert all(isinstance(json.loads(text), dict) for text in ended)
    assert all(c.message.content.startswith("{") for c in completion.choices)


def test_streamed_json_is_the_same_json(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny", "messages": MESSAGES, "seed": 11, "max_tokens": 300,
        "extra_body": {"structured_outputs": {"json": PERSON_SCHEMA}},
    }  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    )
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON_SCHEMA)


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, r"red|green|blue"),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{3}"}}, r"[0-9]{3}-[a-z]{3}"),
        ({"structured_outputs": {"grammar": 'start: "<" ("a" | "b")+ ">"'}}, r"<[ab]+>"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"guided_regex": "[A-Z]{4}"}, r"[A-Z]{4}"),
        ({"guided_grammar": 'root ::= "x" | "y" "z"'}, r"x|yz"),
        ({"guided_json": {"type": "boolean"}}, r"true|false"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_completions_follow_every_kind_of_constraint(
    server: InProcessServer, fields: dict, check: str
) -> None:
    body = {"prompt": "Answer:", "max_tokens": 60, "n": 8, "seed": 5, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        assert re.fullmatch(check, choice["text"]), choice["text"]


def test_chat_takes_structured_outputs_too(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    assert completion.choices[0].message.content in ("alpha", "beta")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no"}}}},
            "response_format",
            "Invalid type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "needs json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "unknown name"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"guided_json": "{broken"}, "guided_json", "invalid structured output json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice", "most one"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_the_field(
    server: InProcessServer, fields: dict, param: str, message: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "guided_regex": "(["},
            "guided_regex",
            "unclosed character class",
        ),
        (
            "/v1/completions",
            {"prompt": "a", "structured_outputs": {"grammar": "start: nope"}},
            "structured_outputs",
            "unknown name",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tool_choice": "required",
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ],
            },
            "tools",
            "Invalid type",
        ),
    ],
    ids=["chat regex", "completions grammar", "forced tool"],
)
def test_a_grammar_the_worker_cannot_compile_is_a_400_before_any_stream(
    server: InProcessServer, path: str, fields: dict, param: str, message: str, n: int, stream: bool
) -> None:
    body = {"max_tokens": 5, "n": n, "stream": stream, **fields}
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_bad_text_format_schema_is_a_400_naming_text_format(
    server: InProcessServer, stream: bool
) -> None:
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no"}}}
    body = {"input": "hi", "max_output_tokens": 5, "stream": stream, "text": text}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "text.format" and "Invalid type" in error["message"]


@pytest.mark.parametrize(
    "fields",
    [{"guided_regex": ""}, {"structured_outputs": {"grammar": "  "}}, {"guided_json": ""}],
    ids=["regex", "grammar", "json text"],
)
def test_an_empty_constraint_is_refused_in_the_front(server: InProcessServer, fields: dict) -> None:
    body = {"prompt": "a", "max_tokens": 5, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == next(iter(fields)) and "is empty" in error["message"]
