"""A request's structured-output fields → one checked `StructuredOutputsParams` (or None).

Three spellings reach the same constraint: vLLM's `structured_outputs`, its older `guided_*`
fields, and OpenAI's `response_format` (`json_object`, `json_schema`). At most one may be
given. The grammar is compiled and validated on a thread, since a large schema takes long
enough to stall every other request if it ran on the event loop.
"""

from __future__ import annotations

import asyncio

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import SamplingFields
from nanoserve.structured_output.grammars import check_constraint

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def requested_constraint(request: SamplingFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field that gave it; None when it asks for none."""
    found: list[tuple[dict, str]] = []
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append((fields, "structured_outputs"))
    for name, kind in GUIDED_FIELDS.items():
        if getattr(request, name) is not None:
            found.append(({kind: getattr(request, name)}, name))
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        found.append((_response_format_fields(request), "response_format"))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise APIError(f"give at most one structured output field, got {names}", 400, names)
    fields, param = found[0]
    try:
        return StructuredOutputsParams(**fields), param
    except (ValueError, TypeError) as e:
        raise APIError(str(e), 400, param) from None


def _response_format_fields(request: SamplingFields) -> dict:
    response_format = request.response_format
    assert response_format is not None
    if response_format.type == "json_object":
        return {"json_object": True}
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        raise APIError(
            "response_format of type json_schema needs json_schema.schema",
            400,
            "response_format.json_schema",
        )
    return {"json": json_schema.schema_}


async def checked_constraint(
    request: SamplingFields, forced: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The request's constraint, compiled and validated off the event loop (APIError if bad).

    `forced` is a constraint the server adds (a required or named tool choice); it comes from
    `tools`, and cannot be combined with one the request asks for.
    """
    requested = requested_constraint(request)
    if requested is not None and forced is not None:
        raise APIError(
            f"{requested[1]} cannot be combined with a required or named tool_choice",
            400,
            requested[1],
        )
    if forced is not None:
        requested = forced, "tools"
    if requested is None:
        return None
    constraint, param = requested
    try:
        await asyncio.to_thread(check_constraint, constraint)
    except ValueError as e:
        raise APIError(str(e), 400, param) from None
    return constraint
