"""A request's structured-output fields → one `Constraint` (or None), checked as far as is cheap.

Three spellings reach the same constraint: vLLM's `structured_outputs`, its older `guided_*`
fields, and OpenAI's `response_format` (`json_object`, `json_schema`); a required or named
`tool_choice` adds one of the server's own. At most one may be given. The front checks what it
can see without compiling: one kind, a non-empty value, and the bounds of what the grammar
engine can take (`constraint_limits.py`: size, depth, branches, rules, repetitions). The worker
compiles the grammar (once per content); one that does not compile comes back as the run's
first event, an error the front answers with a 400 naming the `Constraint.param` that gave it
(`request_run.start_run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import SamplingFields
from nanoserve.server.openai.constraint_limits import check_constraint

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint and the request field that gave it (for its 400s)."""

    params: StructuredOutputsParams
    param: str


def request_constraint(
    request: SamplingFields, forced: StructuredOutputsParams | None = None
) -> Constraint | None:
    """The request's one constraint; None when it asks for none.

    `forced` is a constraint the server adds (a required or named tool choice, from `tools`);
    it cannot be combined with one the request asks for.
    """
    requested = _requested_constraint(request)
    if requested is not None and forced is not None:
        raise APIError(
            f"{requested.param} cannot be combined with a required or named tool_choice",
            400,
            requested.param,
        )
    if forced is not None:
        check_constraint(forced, "tools")
        return Constraint(forced, "tools")
    return requested


def _requested_constraint(request: SamplingFields) -> Constraint | None:
    found: list[tuple[dict[str, Any], str]] = []
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
        params = StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), 400, param) from None
    _check_not_empty(params, param)
    check_constraint(params, param)
    return Constraint(params, param)


def _response_format_fields(request: SamplingFields) -> dict[str, Any]:
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


def _check_not_empty(params: StructuredOutputsParams, param: str) -> None:
    """A regex, a grammar or a schema's JSON text that is blank constrains to nothing useful."""
    value = getattr(params, params.kind)
    if isinstance(value, str) and not value.strip():
        raise APIError(
            f"{param}: the {params.kind} is empty; give a non-empty {params.kind}", 400, param
        )
