"""Request bodies in `/openapi.json`.

The routes read their bodies themselves (`request_body.read_json_body`: media type, size,
deadline, strict JSON), so FastAPI does not know their shape. `json_body_schema(Model)` gives a
route the pydantic model's JSON schema as its documented request body, with every `$ref`
inlined so that it stands alone in the route's operation. Clients, docs and the fuzzer
(schemathesis, in the tests) read it there.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def json_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inline(schema, definitions)}},
        }
    }


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    """`node` with each `{"$ref": "#/$defs/Name"}` replaced by that definition (no cycles)."""
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _inline(definitions[ref.removeprefix("#/$defs/")], definitions)
    return {key: _inline(value, definitions) for key, value in node.items()}
