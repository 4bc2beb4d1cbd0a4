"""ResponseStore: stored responses for `previous_response_id` and GET/DELETE /v1/responses/{id}.

Bounded two ways, least recently used first out: at most `max_responses` responses and
`max_bytes` of them. A response is held as its JSON text, not as the objects it was built from
(a dict per entry and a str per key and value take several times their JSON size), so the bytes
counted are the bytes held; it is decoded again when read. The store lives in the front's
memory: a restart forgets it, and an evicted or unknown id is a 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

MAX_STORED_RESPONSES = 1000
MAX_STORED_BYTES = 256 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    """A response as the API returned it, and the conversation it ended, as chat messages, both
    held as JSON."""

    response_json: bytes
    messages_json: bytes  # every turn so far, this response's output included

    @property
    def num_bytes(self) -> int:
        return len(self.response_json) + len(self.messages_json)

    @property
    def response(self) -> dict[str, Any]:
        return msgspec.json.decode(self.response_json)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return msgspec.json.decode(self.messages_json)


class ResponseStore:
    """An LRU map of response id → StoredResponse, bounded in count and bytes."""

    def __init__(
        self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        entry = StoredResponse(_json_bytes(response), _json_bytes(messages))
        if entry.num_bytes > self.max_bytes:
            return  # larger than the whole store: not kept
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self.num_bytes += entry.num_bytes
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True


def _json_bytes(value: Any) -> bytes:
    """`value` as JSON, in bytes of exactly its length (msgspec's own buffer keeps its spare
    capacity, up to half as much again)."""
    return memoryview(msgspec.json.encode(value)).tobytes()
