"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

A Responses request becomes a chat completion: `instructions` a system message, input items
chat messages (`function_call` items an assistant turn's tool calls, `function_call_output`
items tool messages), function tools chat tools, `text.format` a response_format. The chat
path does the rest (`chat.start_chat`: checks, template, tools, structured output, the run);
`OutputItems` turns its parsed output into output items and typed stream events; a function
call the parser did not finish (cut off by max_output_tokens) is left out of the response, as
out of a chat message, though its stream has shown its start. Stored
responses (`store`, on by default) keep their conversation in a bounded `ResponseStore`, so that
`previous_response_id` continues it.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from nanoserve.server.errors import APIError, validation_error
from nanoserve.server.openai.api_models import ChatCompletionRequest
from nanoserve.server.openai.chat import start_chat
from nanoserve.server.openai.chat_tools import ToolPlan
from nanoserve.server.openai.checks import check_metadata
from nanoserve.server.openai.request_run import RequestRun, stream_answer, whole_answer
from nanoserve.server.openai.response_output import OutputItems, new_id, response_body
from nanoserve.server.openai.response_store import ResponseStore
from nanoserve.server.openai.responses_models import ResponsesRequest
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.openai.tool_parsers import ParsedDelta, ToolParser
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.server.sse import NamedEvent
from nanoserve.text.output_processor import ChoiceState


def router(model: ServedModel, store: ResponseStore) -> APIRouter:
    """The Responses routes, serving `model` and keeping stored responses in `store`."""
    routes = APIRouter()

    @routes.post("/v1/responses", openapi_extra=json_body_schema(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        body = await read_json_body(request, ResponsesRequest, model.config)
        turn = await start_turn(model, store, body, request)
        if body.stream:
            return stream_answer(turn.run, turn_events(turn))
        return await whole_answer(request, turn.run, whole_turn(turn))

    @routes.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return Response(entry.response_json, media_type="application/json")

    @routes.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return routes


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        f"no stored response with id {response_id!r} (unknown, deleted, not stored or evicted)",
        404,
        param,
    )


# The chat request's fields that a Responses request spells differently (for errors' `param`).
RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def _in_responses_terms(error: APIError) -> APIError:
    """A chat path error, its `param` named as the Responses request spells it."""
    if error.param is not None:  # messages.3.content: the chat messages hold history too
        error.param = RESPONSES_PARAMS.get(error.param.split(".", 1)[0], error.param)
    return error


@dataclass
class Turn:
    """One Responses request in flight: its run, its tools and the conversation so far."""

    request: ResponsesRequest
    run: RequestRun
    tools: ToolPlan
    messages: list[dict[str, Any]]  # earlier turns and this input, as chat messages
    response_id: str
    model_name: str
    store: ResponseStore


async def start_turn(
    model: ServedModel, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Turn:
    """The conversation so far and this input, started as a chat completion."""
    check_metadata(body.metadata)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        entry = store.get(body.previous_response_id)
        if entry is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = entry.messages
    if isinstance(body.input, str):
        items: list[dict[str, Any]] = [{"role": "user", "content": body.input}]
    else:
        items = [item.model_dump(exclude_none=True) for item in body.input]
    messages = history + items_to_messages(items)
    try:
        chat_request = ChatCompletionRequest.model_validate(chat_body(body, messages))
    except ValidationError as e:  # e.g. more messages, with the history, than a chat takes
        raise _in_responses_terms(validation_error([dict(x) for x in e.errors()])) from None
    try:
        run, tools = await start_chat(model, chat_request, request)
    except APIError as e:
        raise _in_responses_terms(e) from None
    return Turn(body, run, tools, messages, new_id("resp"), model.name, store)


async def whole_turn(turn: Turn) -> dict[str, Any]:
    """The whole response, once the run has finished."""
    await turn.run.finish()
    [choice] = turn.run.choices
    output, parser = OutputItems(), _parser(turn)
    for parsed in _parsed(parser, choice.text, is_final=True):
        output.add(parsed)
    output.close()
    return _finish(turn, _complete_calls_only(output.items, parser), choice)


def _complete_calls_only(items: list[dict[str, Any]], parser: ToolParser | None) -> list[dict]:
    """The items without a function call the parser did not finish (cut by max_output_tokens,
    or broken): the chat message's calls, and what a later turn carries (the stream has
    already shown its start)."""
    if parser is None:
        return items
    finished = {call.id for call in parser.calls}
    return [i for i in items if i["type"] != "function_call" or i["call_id"] in finished]


async def turn_events(turn: Turn) -> AsyncIterator[NamedEvent]:
    """The typed stream: created, in_progress, the output items' events, then the end."""
    numbers = itertools.count()

    def event(data: dict[str, Any]) -> NamedEvent:
        return NamedEvent(data["type"], {**data, "sequence_number": next(numbers)})

    started = _body(turn, [], "in_progress")
    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    output, parser = OutputItems(), _parser(turn)
    async for updates in turn.run.updates():
        for update in updates:
            for parsed in _parsed(parser, update.text, update.choice.is_finished):
                for data in output.add(parsed):
                    yield event(data)
    for data in output.close():
        yield event(data)
    final = _finish(turn, _complete_calls_only(output.items, parser), turn.run.choices[0])
    yield event({"type": f"response.{final['status']}", "response": final})


def _finish(turn: Turn, output: list[dict[str, Any]], choice: ChoiceState) -> dict[str, Any]:
    """The finished response; stored with its conversation when `store` is on."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    body = _body(turn, output, status, _usage(turn.run, choice))
    if turn.request.store:
        turn.store.put(body, turn.messages + items_to_messages(output))
    return body


def _body(turn: Turn, output: list, status: str, usage: dict | None = None) -> dict:
    body = response_body(turn.response_id, turn.request, turn.model_name, output, status, usage)
    text = turn.request.text
    if text is not None and text.format is not None:
        body["text"] = {"format": text.format.model_dump(exclude_none=True, by_alias=True)}
    return body


def _parser(turn: Turn) -> ToolParser | None:
    return turn.tools.make_parser() if turn.tools.make_parser is not None else None


def _parsed(parser: ToolParser | None, text: str, is_final: bool) -> list[ParsedDelta]:
    if parser is None:
        return [ParsedDelta(content=text)]
    return [parser.feed(text), *([parser.finish()] if is_final else [])]


def _usage(run: RequestRun, choice: ChoiceState) -> dict[str, Any]:
    usage = run.usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input or output items as chat messages (a run of function calls: one assistant turn)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            messages.append({"role": role, "content": _text(item.get("content"), "content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:  # function_call_output
            content = _text(item.get("output"), "output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}
            )
    return messages


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise APIError(
                f"only text input is served, got a {part.get('type')!r} part", 400, f"input.{param}"
            )
        texts.append(part.get("text") or "")
    return "".join(texts)


def chat_body(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request that answers a Responses request."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {
        "model": request.model,
        "messages": system + messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "user": request.user,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.tools:
        body["tools"] = [_chat_tool(tool) for tool in request.tools]
    choice = request.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    body["tool_choice"] = choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        schema = {"name": text_format.name or "response", "schema": text_format.schema_}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return {key: value for key, value in body.items() if value is not None}


def _chat_tool(tool: Any) -> dict[str, Any]:
    if tool.type != "function" or not tool.name:
        raise APIError(
            f"only function tools (with a name) are served, got a {tool.type!r} tool", 400, "tools"
        )
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}
