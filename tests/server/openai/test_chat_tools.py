"""Tool calling over HTTP: tools reach the template, tool_choice none/auto/required/named, calls
parsed out of the output (streamed and not, identically), and the openai SDK's round trip."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hostile_constraints import deep_named_call, deep_sent_arguments
from servers import InProcessServer

from nanoserve.server.openai.api_models import ChatCompletionRequest
from nanoserve.server.openai.chat_prompt import template_messages
from nanoserve.text.tokenizer import apply_chat_template, load_tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Now.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Makes the random model write a Hermes call, so that the auto path's parser has one to read.
HERMES_CALL = (
    r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{1,6}", "unit": "(C|F)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def auto_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    flags = (
        "--served-model-name",
        "tiny",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
    )
    with InProcessServer(tiny_model, log, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def auto_client(auto_server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{auto_server.url}/v1", api_key="unused", max_retries=0)


def check_call(call) -> None:
    """A call to a declared tool whose arguments follow that tool's schema."""
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def stream_message(client: openai.OpenAI, **kwargs) -> tuple[str | None, list[dict], str]:
    """Content, tool calls and finish reason, put together from a stream as clients do."""
    content, calls, finish_reason = "", {}, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content or None, [calls[i] for i in sorted(calls)], finish_reason


def as_dicts(tool_calls) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in tool_calls
    ]


def test_required_always_calls_a_declared_tool(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, n=12, seed=3, temperature=1.0, max_tokens=100,
    )  # fmt: skip
    assert len({c.message.tool_calls[0].function.arguments for c in completion.choices}) > 6
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=1, max_tokens=50
    )
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call(call)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_calls_stream_as_they_answer(client: openai.OpenAI, tool_choice) -> None:
    kwargs = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "seed": 5,
        "max_tokens": 100,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish_reason = stream_message(client, **kwargs)
    assert (content, finish_reason) == (whole.message.content, whole.finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["name"], c["arguments"]) for c in as_dicts(whole.message.tool_calls)
    ]


CHOOSE = {
    "type": "object",
    "properties": {"z": {"enum": ["A", "B"]}},
    "required": ["z"],
    "additionalProperties": False,
}


def test_required_cut_by_max_tokens_gives_the_complete_calls_only(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": [{"type": "function", "function": {"name": "t", "parameters": CHOOSE}}],
        "tool_choice": "required",
        "logit_bias": {str(ord("]")): -100},  # the list of calls never closes
        "temperature": 0,
        "max_tokens": 60,  # a call is about 40 tokens: one call and a piece of the next
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert len(whole.message.tool_calls) >= 1
    for call in whole.message.tool_calls:
        assert call.function.name == "t"
        jsonschema.validate(json.loads(call.function.arguments), CHOOSE)
    content, calls, finish_reason = stream_message(client, **kwargs)
    assert (content, finish_reason) == (None, "length")
    complete = [(c["name"], c["arguments"]) for c in calls[: len(whole.message.tool_calls)]]
    assert complete == [(c["name"], c["arguments"]) for c in as_dicts(whole.message.tool_calls)]


def test_named_arguments_nested_past_the_depth_limit_are_no_call(server: InProcessServer) -> None:
    body = {"model": "tiny", **deep_named_call(max_tokens=200)}
    url = f"{server.url}/v1/chat/completions"
    response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 200, response.text[:300]
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and not choice["message"].get("tool_calls")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and all("error" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(not c["choices"][0]["delta"].get("content") for c in chunks)


def test_sent_arguments_1000_deep_reach_the_template_as_their_text(
    server: InProcessServer,
) -> None:
    body = {"messages": deep_sent_arguments(1000)}
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    error = response.json()["error"]  # rendered, with the 2,000 brackets: too long to serve
    assert (response.status_code, error["param"]) == (400, "messages"), error
    match = re.search(r"your request has (\d+) input tokens", error["message"])
    assert match is not None and int(match[1]) > 2000


def test_auto_reads_the_models_calls_streamed_and_not(auto_client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "seed": 2,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }  # fmt: skip
    whole = auto_client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Let me look."
    [call] = whole.message.tool_calls
    check_call(call)
    content, calls, finish_reason = stream_message(auto_client, **kwargs)
    assert (content, finish_reason) == ("Let me look.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_auto_with_no_call_is_plain_text(auto_client: openai.OpenAI) -> None:
    completion = auto_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, seed=0, max_tokens=20,
        extra_body={"structured_outputs": {"regex": "Sunny, [0-9]{2} degrees"}},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls == []
    assert choice.message.content.startswith("Sunny, ")


def test_a_malformed_call_comes_back_as_text(auto_client: openai.OpenAI) -> None:
    text = r'<tool_call>\n\{"name": "get_weather", "arguments": "oops"\}\n</tool_call>'
    completion = auto_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100,
        extra_body={"structured_outputs": {"regex": text}},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls == []
    assert '"arguments": "oops"' in choice.message.content


def test_tool_choice_none_gives_text(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls == []


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # auto by default
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined",
        ),
        (
            {
                "tools": [{"function": {"name": "f", "parameters": {"type": "x"}}}],
                "tool_choice": "required",
            },
            "tools",
            "Invalid type",
        ),
    ],
)  # fmt: skip
def test_tool_choices_the_server_cannot_honour_are_a_400(
    server: InProcessServer, fields: dict, param: str, message: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_the_sdk_round_trip_templates_the_call_and_its_result(
    auto_client: openai.OpenAI, tiny_model: Path
) -> None:
    first = auto_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, seed=4, max_tokens=100,
    )  # fmt: skip
    message = first.choices[0].message
    call = message.tool_calls[0]
    check_call(call)
    history = [
        *MESSAGES,
        message.model_dump(exclude_none=True),  # content None, arguments a JSON string
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
    ]
    answer = auto_client.chat.completions.create(
        model="tiny", messages=history, seed=0, max_tokens=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "length"
    # The prompt it answered: the call written back as the template writes calls, the result in
    # a <tool_response>.
    arguments = json.loads(call.function.arguments)
    expected = (
        '<|im_start|>assistant\n<tool_call>\n{"name": "' + call.function.name
        + '", "arguments": ' + json.dumps(arguments, ensure_ascii=False)
        + "}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )  # fmt: skip
    tokenizer = load_tokenizer(tiny_model)
    request = ChatCompletionRequest.model_validate({"messages": history})
    prompt = apply_chat_template(tokenizer, template_messages(request.messages))
    assert tokenizer.decode(prompt).endswith(expected)
    assert answer.usage.prompt_tokens == len(prompt)


def test_json_string_arguments_reach_the_template_as_objects() -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": {"y": 2}}},
    ]
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}
    )
    [message] = template_messages(request.messages)
    assert message["content"] == ""
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
        {"x": [1]},
        "not json",
        {"y": 2},
    ]
