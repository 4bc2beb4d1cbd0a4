"""The Responses API with the openai SDK: text and message-list input, instructions, streaming
with typed events, function tools and their outputs, stored responses and their limits."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from servers import InProcessServer

TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_time", "description": "Now.", "parameters": TIME}]


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_text_input_gives_a_message(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", input="Hello", max_output_tokens=6, extra_body={"seed": 1}
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert (
        response.status == "incomplete"
        and response.incomplete_details.reason == "max_output_tokens"
    )
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and response.output_text
    assert response.usage.output_tokens == 6


def test_instructions_and_message_lists_reach_the_prompt(client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "More"}]},
    ]
    plain = client.responses.create(model="tiny", input=messages, max_output_tokens=1)
    instructed = client.responses.create(
        model="tiny", input=messages, instructions="Be brief.", max_output_tokens=1
    )
    # Byte tokens, and one token per special token. The turns "<|im_start|>user\nHi<|im_end|>\n",
    # "<|im_start|>assistant\nHello!<|im_end|>\n", "<|im_start|>user\nMore<|im_end|>\n" and the
    # generation prompt "<|im_start|>assistant\n": 10 + 19 + 12 + 11 tokens.
    assert plain.usage.input_tokens == 52
    # "<|im_start|>system\nBe brief.<|im_end|>\n" comes first: 19 more.
    assert instructed.usage.input_tokens == 52 + 19


def test_streamed_events_carry_the_same_response(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "input": "Tell me",
        "max_output_tokens": 12,
        "extra_body": {"seed": 3},
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text


def test_a_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny", input="What time is it in Tokyo?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60,
    )  # fmt: skip
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "09:00"}
    chained = client.responses.create(
        model="tiny", previous_response_id=first.id, input=[result], max_output_tokens=4
    )
    # The same conversation written out in full gives the same prompt.
    explicit = client.responses.create(
        model="tiny", max_output_tokens=4,
        input=[
            {"role": "user", "content": "What time is it in Tokyo?"},
            {
                "type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments,
            },
            result,
        ],
    )  # fmt: skip
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.previous_response_id == first.id and chained.output_text


def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="tiny", input="Time?", tools=TOOLS, max_output_tokens=60, stream=True,
            tool_choice={"type": "function", "name": "get_time"},
        )
    )  # fmt: skip
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    [call] = events[-1].response.output
    assert arguments == done.arguments == call.arguments and call.name == "get_time"
    jsonschema.validate(json.loads(arguments), TIME)


def test_a_call_cut_by_max_output_tokens_is_not_in_the_output(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", input="Time?", tools=TOOLS, max_output_tokens=5,
        tool_choice={"type": "function", "name": "get_time"},
    )  # fmt: skip
    assert response.status == "incomplete" and response.output == []
    events = list(
        client.responses.create(
            model="tiny", input="Time?", tools=TOOLS, max_output_tokens=5, stream=True,
            tool_choice={"type": "function", "name": "get_time"},
        )
    )  # fmt: skip
    assert "response.function_call_arguments.delta" in [e.type for e in events]  # shown, cut
    assert events[-1].type == "response.incomplete" and events[-1].response.output == []


def test_stored_responses_can_be_read_and_deleted(
    client: openai.OpenAI, server: InProcessServer
) -> None:
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    for method in ("GET", "DELETE"):
        gone = httpx.request(method, f"{server.url}/v1/responses/{response.id}", timeout=30)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}", timeout=30).status_code == 404


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input.content"),
        ({"input": 5}, 400, "input"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}}, 400, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_requests(server: InProcessServer, fields: dict, status: int, param: str) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **fields}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


LARGEST_METADATA = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}


@pytest.mark.parametrize(
    ("metadata", "allowed"),
    [
        ({str(i): "v" for i in range(17)}, "at most 16 pairs"),
        ({"k" * 65: "v"}, "keys of at most 64 characters"),
        ({"k": "v" * 513}, "values of at most 512 characters"),
        ({"k": 5}, "values of at most 512 characters"),
    ],
    ids=["17 pairs", "65-character key", "513-character value", "not a string"],
)
def test_metadata_over_openais_limits_is_a_400(
    server: InProcessServer, metadata: dict, allowed: str
) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "metadata": metadata}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "metadata" and allowed in error["message"], error


def test_metadata_at_openais_limits_is_stored(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", input="Hi", max_output_tokens=2, metadata=LARGEST_METADATA
    )
    assert response.metadata == LARGEST_METADATA
    assert client.responses.retrieve(response.id).metadata == LARGEST_METADATA
