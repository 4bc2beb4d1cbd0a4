"""A response's output items, built from what the tool parser lets through, with their events.

`OutputItems` turns the stream of `ParsedDelta`s of one choice into Responses API output
items (an assistant `message` with `output_text`, and `function_call`s) and, on the way, the
typed events a streaming client receives (`response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, the `...done`
events). The non-streamed response runs the same builder and keeps only the items, so both
carry the same output.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from nanoserve.server.openai.tool_parsers import ParsedDelta

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response, in the order the model wrote them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._text = ""
        self._call: dict[str, Any] | None = None  # the open function call item
        self._call_index = -1

    def add(self, parsed: ParsedDelta) -> list[Event]:
        """Events for one parsed delta: new text, new calls and their argument text."""
        events: list[Event] = []
        if parsed.content:
            events += self._close_call()
            events += self._open_message() if self._message is None else []
            self._text += parsed.content
            events.append(self._text_event("response.output_text.delta", delta=parsed.content))
        for piece in parsed.tool_calls:
            if piece.index != self._call_index:
                events += self._close_message() + self._close_call()
                events += self._open_call(piece.id or new_id("call"), piece.name or "")
                self._call_index = piece.index
            if piece.arguments:
                assert self._call is not None
                self._call["arguments"] += piece.arguments
                events.append(self._call_event("delta", delta=piece.arguments))
        return events

    def close(self) -> list[Event]:
        """The `...done` events of the items still open."""
        return self._close_message() + self._close_call()

    def _open_message(self) -> list[Event]:
        self._message = {
            "type": "message",
            "id": new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(self._message)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._item_event("response.output_item.added", self._message),
            self._text_event("response.content_part.added", part=part),
        ]

    def _close_message(self) -> list[Event]:
        if self._message is None:
            return []
        part = {"type": "output_text", "text": self._text, "annotations": [], "logprobs": []}
        events = [
            self._text_event("response.output_text.done", text=self._text),
            self._text_event("response.content_part.done", part=part),
        ]
        self._message.update(status="completed", content=[part])
        events.append(self._item_event("response.output_item.done", self._message))
        self._message, self._text = None, ""
        return events

    def _open_call(self, call_id: str, name: str) -> list[Event]:
        self._call = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(self._call)
        return [self._item_event("response.output_item.added", self._call)]

    def _close_call(self) -> list[Event]:
        if self._call is None:
            return []
        call = self._call
        events = [self._call_event("done", arguments=call["arguments"], name=call["name"])]
        call["status"] = "completed"
        events.append(self._item_event("response.output_item.done", call))
        self._call = None
        return events

    def _item_event(self, type_: str, item: dict[str, Any]) -> Event:
        return {"type": type_, "output_index": self.items.index(item), "item": dict(item)}

    def _text_event(self, type_: str, **fields: Any) -> Event:
        assert self._message is not None
        event = {"type": type_, "item_id": self._message["id"], "content_index": 0, **fields}
        if type_.startswith("response.output_text"):
            event["logprobs"] = []
        return {**event, "output_index": self.items.index(self._message)}

    def _call_event(self, stage: str, **fields: Any) -> Event:
        assert self._call is not None
        return {
            "type": f"response.function_call_arguments.{stage}",
            "item_id": self._call["id"],
            "output_index": self.items.index(self._call),
            **fields,
        }


def response_body(
    response_id: str,
    request: Any,
    model: str,
    output: list[dict[str, Any]],
    status: str = "completed",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `response` object; `request` is the ResponsesRequest it answers."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in request.tools or []],
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "user": request.user,
        "usage": usage,
    }
